"""kvxferd as a vLLM KV connector (``kv_connector_module_path: kvxferd.integrations.vllm``).

::

    --kv-transfer-config '{"kv_connector": "KvxferdConnector",
                           "kv_connector_module_path": "kvxferd.integrations.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

vLLM is imported only when the connector class itself is: the parameter
schema, the settings and the cache description import without vLLM, so
kvxferd never depends on it (see docs/vllm.md).
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "KvxferdConnector":
        from kvxferd.integrations.vllm.connector import KvxferdConnector

        return KvxferdConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
