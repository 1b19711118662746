"""Simulated RDMA fabric on SimPy: fake registered memory, NICs, links and a control channel.

The transport here implements the same primitives as the NIXL backend, so the shared driver and
the protocol core run unchanged over it; bytes really move, time is virtual (integer ns).
"""
