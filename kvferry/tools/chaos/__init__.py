"""``kvferry chaos``: prefill and decode on separate hosts (network namespaces), real faults."""
