"""What both policy cores share, whoever owns the device memory.

:class:`CoreBase` holds the page-keyed prefix tree, the host page ids (kvtier
always owns the host pool), plan dispatch (:mod:`~kvtier.core.dispatch`), host
eviction (:mod:`~kvtier.core.host_space`) and the L3 save/prefetch state
(:mod:`~kvtier.core.storage_policy`). Two siblings build on it:

* :class:`~kvtier.core.cache_core.CacheCore` -- kvtier owns the device pool too:
  device pages in the tree, matches, loads back, inserts, device eviction;
* :class:`~kvtier.core.engine_device.EngineDeviceCore` -- the engine owns its
  device blocks (vLLM): tree nodes are host-only, copies name the engine's blocks.

Threading: one thread (the engine's scheduler) calls every method; completions
are applied by :meth:`~kvtier.core.dispatch.PlanDispatch.poll`, which every
public method calls first.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core.dispatch import PlanDispatch
from kvtier.core.host_space import HostSpace
from kvtier.core.plans import Tier
from kvtier.core.port import ExecutorPort
from kvtier.core.storage_policy import StoragePolicy
from kvtier.core.tags import EvictionSave, PrefetchHandle, Save
from kvtier.errors import IndexTypeError
from kvtier.hashing import Namespace, PageHash, page_keys
from kvtier.metrics import CacheStats
from kvtier.pages import is_ordered_sequence
from kvtier.radix import NO_PAGE, SAVING, PageNode, PrefixTree
from kvtier.spec import KVSpec


class CoreBase(PlanDispatch, HostSpace, StoragePolicy):
    """The tree, host pages, plans and L3 of a policy core (see the module docstring).
    ``device_pages``: how many device pages the tree may have to index (0 when the engine
    owns the device: its nodes are host-only)."""

    def __init__(self, spec: KVSpec, host: PageAllocator, port: ExecutorPort, config: CacheConfig = CacheConfig(),
                 storage_config: StorageConfig = StorageConfig(), *, namespace: Namespace | None = None,
                 stats: CacheStats | None = None, device_pages: int = 0):
        self.spec = spec
        self.config = config
        self.storage_config = storage_config
        self._init_dispatch(port)
        self.namespace = namespace or Namespace("default", spec.fingerprint())
        self.root_key = self.namespace.root(config.hash_algo)
        self.stats = stats or CacheStats()
        self.host_alloc = host
        self.tree = PrefixTree(reserve=device_pages + host.num_pages if config.preallocate_nodes else 0, device_pages=device_pages)
        self._page_bytes = spec.page_bytes
        #: called with the keys of host pages eviction is about to free (an engine's event stream)
        self.on_host_evicted = None
        self._on |= {Save: self._finish_save, EvictionSave: self._applied_where_waited, PrefetchHandle: self._finish_prefetch}

    @property
    def has_storage(self) -> bool:
        return self.port.has_storage

    def page_keys(self, token_ids: Sequence[int]) -> list[PageHash]:
        return page_keys(token_ids, self.spec.page_size, self.root_key, self.config.hash_algo)

    def _keys(self, tokens_or_keys) -> list[PageHash]:
        if type(tokens_or_keys) is not list and not is_ordered_sequence(tokens_or_keys):
            raise IndexTypeError(f"token ids (or page keys) must be an ordered sequence -- a list, tuple, numpy array or tensor -- "
                                 f"got {type(tokens_or_keys).__name__}; a set has no order and a generator no length: list() it first")
        if not len(tokens_or_keys):  # no full page (a prompt shorter than a page): nothing to hash
            return []
        if isinstance(tokens_or_keys[0], bytes):
            return list(tokens_or_keys)
        return self.page_keys(tokens_or_keys)

    def lock(self, node: PageNode | None) -> None:
        """Protect ``node`` and its ancestors from eviction until :meth:`unlock`."""
        self.tree.lock(node)

    def unlock(self, node: PageNode | None) -> None:
        self.tree.unlock(node)

    def wait_layer(self, op: int, layer: int) -> None:
        """Layer ``layer`` of plan ``op``'s pages is in place (the executor's per-layer wait)."""
        self._ask(self.port.wait_layer, op, layer)

    #: a hybrid model's other KV groups (:mod:`~kvtier.core.group_residency`); none in this core
    components: tuple = ()

    def _groups_left(self, tier: Tier, nodes) -> None:
        """``nodes``' pages leave ``tier``; a core that keeps other KV groups' objects beside them frees
        those too (:mod:`~kvtier.core.group_residency`). Called wherever a page is cleared."""

    def _shared_ids(self, tier: Tier, caller=None, quarantined=None) -> set[int]:
        """Ids of ``tier``'s own pool held by other KV groups' objects (none in this core)."""
        return set()

    def _computed_under_prefetch(self, nodes: list[PageNode]) -> None:
        """``nodes`` (one path's run, root side first) got device pages while a prefetch that gave
        them their host pages failed. Only a core with device pages in its tree has any."""

    def _check_host(self, caller_host_pages: set[int], idle: bool) -> None:
        """The shared half of ``check_integrity``: the tree's own invariants, host accounting and,
        when ``idle``, liveness (nothing locked or in flight, every host page readable)."""
        self.tree.check()
        if idle:
            assert not self._inflight and not self._deferred, f"idle, yet {len(self._inflight)} plans are in flight"
            for n in self.tree.nodes.values():
                assert n.lock_ref == 0, f"idle, yet a node is locked ({n.lock_ref}): a lock or transfer completion was lost"
                assert n.host_page == NO_PAGE or n.host_ready, "idle, yet a host page is not readable: it could never be evicted or used"
                assert n.stored != SAVING, "idle, yet an L3 save is marked in flight: its host page could never be evicted"
        host_owned = [n.host_page for n in self.tree.nodes.values() if n.host_page != NO_PAGE]
        assert len(host_owned) == len(set(host_owned)), "a host page is owned by two nodes"
        parked = self.host_alloc.parked  # freed, held for a plan that timed out (see PageAllocator.hold)
        assert not set(host_owned) & parked, "a host page held for a timed-out plan is in the tree"
        objects = self._shared_ids(Tier.HOST)
        assert not objects & (set(host_owned) | parked), "a host id is both a page's and another group's object"
        assert set(host_owned) | set(caller_host_pages) | parked | objects == self.host_alloc.allocated_pages(), (
            "host allocator and tree disagree (leak or foreign page)"
        )
