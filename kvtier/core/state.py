"""What every layer of a policy core holds: built once, declared here, read by the layers above.

A core is one chain of classes, each adding one concern on top of the one below
(no class reads what neither it nor a class below it defines: ``tests/test_core_shape.py``)::

    CoreState          the tree, host page ids, spec, configs, stats, the executor port, the KV groups
    PlanDispatch       plans out, completions in (dispatch.py)
    HostTier           host allocation and eviction, L3 prefetch and save (host_tier.py)
    CoreBase           what both cores offer (base.py)
    DeviceSpace        device pages, backups, device eviction (device_space.py)
    CacheCore          matches, loads back, inserts, requests (cache_core.py)
    EngineDeviceCore   (on CoreBase) the engine owns its device blocks (engine_device.py)

Parts with state of their own are objects the core holds, built with explicit inputs:
``groups`` (:class:`~kvtier.core.group_objects.Groups`, or :data:`~kvtier.core.group_objects.NO_GROUPS`
for a model of full attention only: the choice is made once, here and in the sibling's constructor)
and, in :class:`~kvtier.core.cache_core.CacheCore` alone, ``quarantine``.
"""

from __future__ import annotations

from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core.group_objects import NO_GROUPS, Groups, NoGroups
from kvtier.core.port import ExecutorPort
from kvtier.hashing import Namespace
from kvtier.metrics import CacheStats
from kvtier.radix import PrefixTree
from kvtier.spec import KVSpec


class CoreState:
    """The state every layer of a core reads. ``device_pages``: how many device pages the tree may have
    to index (0 when the engine owns the device: its nodes are host-only)."""

    spec: KVSpec
    config: CacheConfig
    storage_config: StorageConfig
    namespace: Namespace
    root_key: bytes
    stats: CacheStats
    port: ExecutorPort
    host_alloc: PageAllocator
    tree: PrefixTree
    #: a hybrid model's other KV groups' objects (NO_GROUPS: full attention only)
    groups: Groups | NoGroups

    def __init__(self, spec: KVSpec, host: PageAllocator, port: ExecutorPort, config: CacheConfig, storage_config: StorageConfig, *,
                 namespace: Namespace | None, stats: CacheStats | None, device_pages: int):
        self.spec = spec
        self.config = config
        self.storage_config = storage_config
        self.namespace = namespace or Namespace("default", spec.fingerprint())
        self.root_key = self.namespace.root(config.hash_algo)
        #: a cached prefix shorter than this many pages is served as a miss (``min_hit_tokens``; 0: off)
        self.min_hit_pages = -(-config.min_hit_tokens // spec.page_size)
        self.stats = stats or CacheStats()
        self.port = port
        self.host_alloc = host
        self.tree = PrefixTree(reserve=device_pages + host.num_pages if config.preallocate_nodes else 0, device_pages=device_pages)
        self._page_bytes = spec.page_bytes
        self.groups = NO_GROUPS
        #: called with the keys of host pages eviction is about to free (an engine's event stream)
        self.on_host_evicted = None
