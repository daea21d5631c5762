"""The SGLang harness the storage-backend tests drive (it lives in the app: ``kvtier bench sglang`` uses it too)."""

from peers.sglang_harness import *  # noqa: F401,F403  (imports SGLang from its wheel first)
from peers.sglang_harness import StorageBackendFactory  # noqa: F401
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: F401,E402
