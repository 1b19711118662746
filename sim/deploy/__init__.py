"""Deployment simulation: prefill and decode instances, request arrivals, compute rooflines and the
KV transfers between them, run through the real core engines over the simulated fabric."""
