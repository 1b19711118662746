"""Serving engines that load kvferry through their own plugin points (``vllm``: a KV connector)."""
