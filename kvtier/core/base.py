"""What both policy cores offer, whoever owns the device memory.

:class:`CoreBase` is the top of the layers both cores share (:mod:`~kvtier.core.state`:
the tree, host page ids, plan dispatch, host eviction, L3 save and prefetch). Two
siblings build on it:

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
from kvtier.core.plans import Completion, Done, Tier, copy_plan
from kvtier.core.port import ExecutorPort
from kvtier.core.host_tier import HostTier
from kvtier.core.tags import GroupBackup
from kvtier.errors import IndexTypeError
from kvtier.hashing import Namespace, PageHash, page_keys
from kvtier.metrics import CacheStats
from kvtier.pages import is_ordered_sequence
from kvtier.radix import NO_PAGE, SAVING, PageNode
from kvtier.spec import KVSpec


class CoreBase(HostTier):
    """The tree, host pages, plans and L3 of a policy core (see the module docstring).
    ``device_pages``: how many device pages the tree may have to index (0 when the engine
    owns the device: its nodes are host-only)."""

    def __init__(self, spec: KVSpec, host: PageAllocator, port: ExecutorPort, config: CacheConfig = CacheConfig(),
                 storage_config: StorageConfig = StorageConfig(), *, namespace: Namespace | None = None,
                 stats: CacheStats | None = None, device_pages: int = 0):
        super().__init__(spec, host, port, config, storage_config, namespace=namespace, stats=stats, device_pages=device_pages)
        self._on[GroupBackup] = self._finish_group_backup

    @property
    def has_storage(self) -> bool:
        return self.port.has_storage

    @property
    def components(self) -> list:
        """A hybrid model's other KV groups (each a :class:`~kvtier.core.group_objects.Component`); none
        for full attention."""
        return self.groups.components

    def component(self, name: str):
        """The KV group ``name`` beside full attention (an :class:`~kvtier.errors.UnknownNameError` if none)."""
        return self.groups.component(name)

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

    def _stored_prefix(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` the storage tier holds (asked through the port)."""
        return self._ask(self.port.stored_prefix, keys)

    def wait_layer(self, op: int, layer: int) -> None:
        """Layer ``layer`` of plan ``op``'s pages is in place (the executor's per-layer wait)."""
        self._ask(self.port.wait_layer, op, layer)

    def snapshot_boundaries(self, first: int, pages: int) -> list[int]:
        """Boundaries in ``(first, pages]`` a request should keep its state at (a model with a state group):
        every ``state_every`` pages, and its last full page."""
        state = next((c for c in self.groups.components if c.kind.keeps == "state"), None)
        return [] if state is None else [p + 1 for p in self.groups.handed_places(state.name, first, pages)]

    @property
    def state_every(self) -> int:
        """The cadence of state snapshots, in pages (1 for a model without groups)."""
        return self.groups.state_every if self.groups else 1

    @property
    def model(self):
        """The hybrid :class:`~kvtier.groups.ModelSpec` whose other groups the core keeps (None: full attention)."""
        return self.groups.model if self.groups else None

    def _backup_objects(self, nodes: Sequence[PageNode], sources: dict[str, dict[PageNode, int]] | None = None) -> int | None:
        """Copy to host the device objects ``nodes``' host copies lack (:meth:`~kvtier.core.group_objects.Groups.objects_to_copy`:
        from the tree's device objects, or ``sources``, an engine's ids per group and node), as a plan of
        no pages. The nodes stay pinned and the host objects unreadable until it completes. Returns its
        op (None: nothing to copy)."""
        runs, pinned = self.groups.objects_to_copy(nodes, sources)
        if not runs:
            return None
        self.tree.pin(pinned)
        return self._submit(copy_plan, GroupBackup(pinned), Tier.DEVICE, [], Tier.HOST, [], 0, runs)

    def _finish_group_backup(self, c: Completion, tag: GroupBackup) -> None:
        self.tree.unpin(tag.nodes)
        ok = type(c) is Done
        self.groups.copied(tag.nodes, ok)
        if not ok:
            self.stats.transfer_failures += 1

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
        objects = self.groups.shared_ids(Tier.HOST)
        assert not objects & (set(host_owned) | parked), "a host id is both a page's and another group's object"
        assert set(host_owned) | set(caller_host_pages) | parked | objects == self.host_alloc.allocated_pages(), (
            "host allocator and tree disagree (leak or foreign page)"
        )
