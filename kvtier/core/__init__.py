"""The policy core: what is cached where, decided without touching a byte.

Two cores share one base (:mod:`~kvtier.core.base`: the page-keyed prefix tree,
host pages, plan dispatch, host eviction, L3 save and prefetch):

* :class:`CacheCore` -- kvtier owns the device pool too; requests go through
  :class:`CacheRequest` (:mod:`~kvtier.core.request`, the request protocol);
* :class:`EngineDeviceCore` -- the engine owns its device blocks (vLLM); kvtier
  keeps host and L3 and copies into and out of the engine's blocks.

Every byte either core decides to move leaves as a :class:`~kvtier.core.plans.Transfer`
through an :class:`ExecutorPort` and comes back as a typed completion.
:class:`NullCache` caches nothing behind :class:`CacheCore`'s request API (the
recompute baseline).
"""

from kvtier.core.cache_core import CacheCore
from kvtier.core.engine_device import EngineDeviceCore, EngineLoad, HostLookup, OffloadResult
from kvtier.core.nullcache import NullCache
from kvtier.core.plans import Completion, CutShort, Done, Failed, Reason, Tier, Transfer
from kvtier.core.port import ExecutorPort
from kvtier.core.request import CacheRequest, RequestState
from kvtier.core.results import EvictResult, InsertResult, LoadResult, MatchResult
from kvtier.core.tags import Backup, EvictionBackup, EvictionSave, JobTag, LoadBack, PrefetchHandle, Save

__all__ = [
    "Backup",
    "CacheCore",
    "CacheRequest",
    "Completion",
    "CutShort",
    "Done",
    "EngineDeviceCore",
    "EngineLoad",
    "EvictResult",
    "EvictionBackup",
    "EvictionSave",
    "ExecutorPort",
    "Failed",
    "HostLookup",
    "InsertResult",
    "JobTag",
    "LoadBack",
    "LoadResult",
    "MatchResult",
    "NullCache",
    "OffloadResult",
    "PrefetchHandle",
    "Reason",
    "RequestState",
    "Save",
    "Tier",
    "Transfer",
]
