"""kvferry inside vLLM: ``KvferryConnector``, a v1 KV connector vLLM loads by module path
(``"kv_connector_module_path": "kvferry.integrations.vllm"``). Needs vLLM (0.33) installed."""

from kvferry.integrations.vllm.connector import KvferryConnector

__all__ = ["KvferryConnector"]
