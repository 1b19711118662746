"""Deterministic simulation of whole deployments on the fake RDMA backend."""
