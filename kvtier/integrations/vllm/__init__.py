"""kvtier as a vLLM v1 KV connector (``pip install kvtier[vllm]``).

Use it through vLLM's ``kv_transfer_config``::

    KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_gb": 1, "storage_url": "file:///tmp/kvtier"},
    )

Options are listed in :mod:`kvtier.integrations.vllm.options`. Importing this
package does not import vLLM; the connector module does.
"""
