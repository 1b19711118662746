"""kvferry: move an LLM request's KV cache from prefill to decode, and prove it moved right."""

__version__ = "0.1.0"
