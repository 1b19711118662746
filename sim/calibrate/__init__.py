"""Calibration (``kvferry calibrate``): fit the simulated fabric and kernels to real telemetry,
write the fit as a named profile, and put the simulator's prediction beside a measurement."""
