"""Drivers that execute core commands: real (NIXL, ZMQ, Triton) and simulated (SimPy fake RDMA)."""
