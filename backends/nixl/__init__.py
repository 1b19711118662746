"""Real data plane: NIXL (UCX backend) agents, registration, prepared lists, WRITE/READ, telemetry."""
