"""kvtier inside SGLang: a HiCache storage backend (:mod:`.backend`, ``KvtierStorage``).

Importing this package does not import SGLang; ``kvtier.integrations.sglang.backend``
does (SGLang's ``HiCacheStorage`` is its base class), and SGLang loads it by
module path on its ``dynamic`` storage-backend path. Options:
:mod:`.options`; page views of SGLang's host pools: :mod:`.pool_pages`.
"""

BACKEND_MODULE = "kvtier.integrations.sglang.backend"
BACKEND_CLASS = "KvtierStorage"


def extra_config(storage_url: str | None = None, **options) -> dict:
    """The ``--hicache-storage-backend-extra-config`` object that loads kvtier (``interface_v1``: the
    zero-copy page path); ``service=...`` instead of a ``storage_url``: the node service."""
    url = {} if storage_url is None else {"storage_url": storage_url}
    return {"backend_name": "kvtier", "module_path": BACKEND_MODULE, "class_name": BACKEND_CLASS, "interface_v1": 1, **url, **options}
