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
from kvtier.core.shared_host import NO_SHARED_HOST, SharedHost
from kvtier.core.tenants import NAMESPACE_OWNER, SHARED_OWNER, TenantLedger, TenantQuota, TenantUsage
from kvtier.core.tags import GroupBackup
from kvtier.errors import ConfigError, IndexTypeError
from kvtier.hashing import Namespace, PageHash, hasher, page_keys, scoped_root, tenant_scope
from kvtier.metrics import CacheStats
from kvtier.pages import is_ordered_sequence
from kvtier.radix import NO_PAGE, SAVING, PageNode
from kvtier.shared_prefixes import DEFAULT_SCOPE, SharedPrefixes
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
        #: prefixes declared shareable across tenants (:meth:`share_prefix`; None: none declared)
        self.shared_prefixes: SharedPrefixes | None = None
        #: host pages, quotas and counters per tenant (:mod:`kvtier.core.tenants`; None: not accounted)
        self.tenants: TenantLedger | None = None
        if config.accounts_tenants or storage_config.bounds_tenants:
            self.tenants = TenantLedger(TenantQuota.from_config(config), self._tenant_label)
            self.tree.host_by_owner = self.tenants.host

    def _tenant_label(self, scope: bytes) -> str:
        """A tenant's label in reports and metrics: a digest of its scope under the namespace (never its name)."""
        return scoped_root(self.root_key, scope, hasher(self.config.hash_algo))[:8].hex()

    def act_for(self, scope: bytes) -> None:
        """The calls that follow serve a request of ``scope`` (:func:`~kvtier.hashing.request_scope`, a tenant's
        scope): the pages they make are its, counted and bounded by its quota. For an engine that gives page keys
        (vLLM's connector, per request), where token ids with a ``tenant`` do this themselves. Nothing when tenants
        are not accounted."""
        if self.tenants is not None:
            self.tree.current_owner = self._keys_owner = self.tenants.owner(scope)

    #: whose the pages of calls that give page keys are (:meth:`act_for`; the namespace's own by default)
    _keys_owner = NAMESPACE_OWNER

    def tenant_label(self, tenant: object) -> str:
        """``tenant``'s label in :meth:`tenant_usage` and metrics (a digest of its scope; "namespace" for None)."""
        scope = b"" if tenant is None else tenant_scope(tenant)
        return "namespace" if not scope else self._tenant_label(scope)

    def set_tenant_quota(self, tenant: object, quota: TenantQuota) -> None:
        """``tenant``'s own bounds in the host tier (:class:`~kvtier.core.tenants.TenantQuota`), in place of the
        config's ``tenant_*`` defaults. Needs a cache that accounts tenants (``CacheConfig.tenant_accounting`` or a
        ``tenant_*`` bound)."""
        if self.tenants is None:
            raise ConfigError("this cache does not account tenants: set CacheConfig.tenant_accounting=True (or a tenant_* bound) "
                              "when it is made, then give tenants their quotas")
        self.tenants.set_quota(b"" if tenant is None else tenant_scope(tenant), quota)

    def tenant_usage(self) -> list[TenantUsage]:
        """Per tenant (a digest): host pages held, bounds, lookups, hits, evictions, expiries, copies refused at
        its cap. Empty when tenants are not accounted."""
        return [] if self.tenants is None else self.tenants.usage()

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

    def page_keys(self, token_ids: Sequence[int], tenant: object = None) -> list[PageHash]:
        """The page keys of ``token_ids``' full pages, in ``tenant``'s scope (:func:`~kvtier.hashing.tenant_scope`: a str,
        bytes or int; None or "": the namespace's own): two tenants' keys of one prompt never meet, in any tier -- but
        for a prefix declared shareable (:meth:`share_prefix`), whose pages every tenant's request starting with it shares."""
        scope = b"" if tenant is None else tenant_scope(tenant)
        if self.tenants is not None:  # (the nodes this call makes are this tenant's)
            self.tree.current_owner = self.tenants.owner(scope)
        if self.shared_prefixes is not None:
            keys = self.shared_prefixes.keys(token_ids, scope)
            if keys is not None:
                return keys
        root = scoped_root(self.root_key, scope, hasher(self.config.hash_algo)) if scope else self.root_key
        return page_keys(token_ids, self.spec.page_size, root, self.config.hash_algo)

    def share_prefix(self, token_ids: Sequence[int], scope: str = DEFAULT_SCOPE) -> int:
        """Declare the full pages of ``token_ids`` (a system prompt) shareable across tenants in ``scope``
        (:mod:`kvtier.shared_prefixes`): a request of any tenant that starts with exactly these tokens shares their
        pages, and keeps what follows in its own scope. Returns the pages declared. Keys change for requests that
        start with the prefix, so declare it before serving (pages cached under the old keys are misses)."""
        if self.shared_prefixes is None:
            self.shared_prefixes = SharedPrefixes(self.root_key, self.spec.page_size, self.config.hash_algo)
        pages = self.shared_prefixes.declare(token_ids, scope)
        self.own_shared(self.shared_prefixes.keys(token_ids, b"")[:pages])
        return pages

    def own_shared(self, keys: Sequence[PageHash]) -> None:
        """``keys`` are a declared shared prefix's pages: in a tenants' ledger, the shared scope's, whichever tenant's
        request makes them (an engine that keys its own requests, vLLM's connector, declares them here)."""
        if self.tenants is not None:
            self.tree.fixed_owners.update(dict.fromkeys(keys, SHARED_OWNER))

    def _keys(self, tokens_or_keys, tenant: object = None) -> list[PageHash]:
        if type(tokens_or_keys) is not list and not is_ordered_sequence(tokens_or_keys):
            raise IndexTypeError(f"token ids (or page keys) must be an ordered sequence -- a list, tuple, numpy array or tensor -- "
                                 f"got {type(tokens_or_keys).__name__}; a set has no order and a generator no length: list() it first")
        if not len(tokens_or_keys):  # no full page (a prompt shorter than a page): nothing to hash
            return []
        if isinstance(tokens_or_keys[0], bytes):
            if tenant_scope(tenant):
                raise IndexTypeError("a tenant scopes token ids; page keys are scoped already (page_keys(tokens, tenant) made them): "
                                     "give the token ids with the tenant, or the keys alone")
            self.tree.current_owner = self._keys_owner  # (keys alone: the namespace's own, or act_for's tenant)
            return list(tokens_or_keys)
        return self.page_keys(tokens_or_keys, tenant)

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
        runs, pinned, moved = self.groups.objects_to_copy(nodes, sources)
        if not runs:
            return None
        self.tree.pin(pinned)
        return self._submit(copy_plan, GroupBackup(pinned, moved), Tier.DEVICE, [], Tier.HOST, [], 0, runs)

    def _finish_group_backup(self, c: Completion, tag: GroupBackup) -> None:
        self.tree.unpin(tag.nodes)
        ok = type(c) is Done
        self.groups.copied(tag.moved, ok)
        if ok:
            self.groups.publish((), tag.moved, None if self.tenants is None else self.tenants.labels)
        else:
            self.stats.transfer_failures += 1

    # ---- a host tier other engines share (:mod:`~kvtier.core.shared_host`) -------------------------
    #: the node service's host tier, or :data:`~kvtier.core.shared_host.NO_SHARED_HOST` (falsy): told of every
    #: finished backup, asked where a walk ends early
    shared_host: SharedHost = NO_SHARED_HOST

    def _share_host(self, shared_host: SharedHost) -> None:
        """Use ``shared_host`` (at construction). A core on the node service accounts tenants: it labels each page it
        publishes with its tenant's digest, by which the service bounds and counts them (``kvtier serve --tenant-*``)."""
        self.shared_host = shared_host
        if shared_host and self.tenants is None:
            self.tenants = TenantLedger(TenantQuota.from_config(self.config), self._tenant_label)
            self.tree.host_by_owner = self.tenants.host

    def _backed_up(self, nodes: list[PageNode]) -> None:
        """A copy of ``nodes`` to host completed: their host copies are readable, other engines sharing the
        host tier may have them, and they count."""
        self.tree.mark_host_ready(nodes)
        if self.shared_host:  # (their objects first: an engine that finds the pages finds their objects with them)
            labels = self.tenants.labels
            self.groups.publish(nodes, labels=labels)
            self.shared_host.publish([n.key for n in nodes], [n.host_page for n in nodes], [labels[n.owner] for n in nodes])
        self.stats.backed_up_pages += len(nodes)
        self.stats.backed_up_bytes += len(nodes) * self._page_bytes

    def _settle_shared_pages(self) -> None:
        """Before :meth:`_forget_shared_host`: nothing here (a copy in flight locks its pages, so the
        forget leaves them unreadable and takes them at a later walk); kvtier's own device waits."""

    def _may_adopt_below(self, path: list[PageNode]) -> bool:
        """Whether pages of the shared tier may hang below ``path`` (see :meth:`_shared_walk`)."""
        return True

    def _shared_walk(self, keys: list[PageHash], limit: int | None) -> list[PageNode]:
        """The tree's walk of ``keys``, continued by what other engines published to the shared host tier;
        where the tier was lost, its pages are forgotten first."""
        self._forget_if_lost()
        path = self.tree.walk(keys)
        if len(path) < len(keys) and self._may_adopt_below(path):
            path += self._adopt_shared(keys, path, limit)
        return path

    def _forget_if_lost(self) -> None:
        """Before any answer that reads the tree: where the shared host tier was lost, its pages go first."""
        if self.shared_host.lost and self.tree.hosted:
            self._forget_shared_host()

    def _forget_shared_host(self) -> None:
        """The shared host tier is lost (:mod:`~kvtier.core.shared_host`), and every host page is one of its
        region's: once the copies in flight have completed, the tree forgets them -- misses from now on,
        freed into the host allocator once each (it gives nothing back to a lost tier). A host-only page a
        request still locks is made unreadable now (no match offers it, no load reads it) and forgotten
        at a later match (an engine-device core's copies in flight lock their pages: they are among those)."""
        self._settle_shared_pages()
        tree = self.tree
        hosted = list(tree.hosted)
        on_device = [n for n in hosted if n.device_page != NO_PAGE]
        host_only = [n for n in hosted if n.device_page == NO_PAGE]
        gone = _unlocked_from_leaves_up(host_only)
        self.groups.left(Tier.HOST, on_device + gone)  # (their objects are the region's too)
        pages = [tree.clear_host(n) for n in on_device]
        for n in set(host_only).difference(gone):
            n.host_ready = False
        if self.on_host_evicted is not None:
            self.on_host_evicted([n.key for n in hosted if n.device_page != NO_PAGE] + [n.key for n in gone])
        pages += tree.remove_host_only(gone)
        self.host_alloc.free(pages)
        self.stats.shared_host_lost_pages += len(pages)

    def _adopt_shared(self, keys: list[PageHash], path: list[PageNode], limit: int | None) -> list[PageNode]:
        """The pages after ``path`` (up to ``limit``) that other engines published to the shared host tier:
        this core's readable host pages from now on, room made for them by its own host LRU."""
        rest = keys[len(path) : limit]
        pages = self.shared_host.lookup(rest)
        if not pages:
            return []
        return self._hang_shared(rest, pages, path[-1] if path else None)

    def shared_ask_from(self, keys: list[PageHash]) -> int | None:
        """Where a lookup of ``keys`` would start asking the shared host tier -- the tree's run of them, when
        one is attached and not lost and the tree ends before ``keys`` do at a place pages may hang below --
        or None when it would not ask."""
        if not self.shared_host or self.shared_host.lost:
            return None
        path = self.tree.walk(keys)
        return len(path) if len(path) < len(keys) and self._may_adopt_below(path) else None

    def prefetch_shared(self, key_lists: Sequence[list[PageHash]], scopes: Sequence[bytes] | None = None) -> list[tuple[int, int]]:
        """Ask the shared host tier, in one round trip, for what it holds after this core's own pages of each
        of ``key_lists`` (a step's requests), and hang what it gives in the tree: a lookup of those keys
        then finds them here without asking (``lookup(keys, shared=False)``). A key two lists share is
        asked once, in the first; pages whose place in the tree is gone by the time they are hung (the
        list's earlier pages were not found, or made room for the others) are let go. Returns, for each
        list, the pages adopted for it and the tree's run of it right after. ``scopes``: each list's request scope (its
        tenant, :meth:`act_for`), whose the pages hung for it are."""
        self._forget_if_lost()
        asked: set[PageHash] = set()
        runs: list[tuple[int, int, list[PageHash]]] = []  # (list, where its run starts, the run)
        for i, keys in enumerate(key_lists):
            path = self.tree.walk(keys)
            if len(path) == len(keys) or not self._may_adopt_below(path):
                continue
            start = len(path)
            while start < len(keys) and keys[start] in asked:  # an earlier list asks these
                start += 1
            if start < len(keys):
                runs.append((i, start, keys[start:]))
                asked.update(keys[start:])
        answers = dict(zip((i for i, _s, _r in runs), self.shared_host.lookup_many([r for _i, _s, r in runs]))) if runs else {}
        starts = {i: start for i, start, _r in runs}
        out: list[tuple[int, int]] = []
        hung: list[PageNode] = []
        for i, keys in enumerate(key_lists):
            path = self.tree.walk(keys)
            pages = answers.get(i)
            if not pages:
                out.append((0, len(path)))
                continue
            start = starts[i]
            if len(path) != start:  # the pages before the run are not (or no longer) here, or its first one is now
                self.shared_host.let_go(pages)
                out.append((0, len(path)))
                continue
            if scopes is not None:
                self.act_for(scopes[i])
            nodes = self._hang_shared(keys[start:], pages, path[-1] if path else None, objects=False)
            self.tree.touch(path + nodes)  # (the next list's room is made from older pages first)
            hung += nodes
            out.append((len(nodes), len(path) + len(nodes)))
        if hung and self.groups:  # a hybrid model's objects of every list's pages: one find a group for the step (of the pages
            nodes = self.tree.nodes  # still there: a later list's room may have been made from an earlier one's)
            # (a node object made room for one list may be hung again for a later one: once, by what it holds now)
            self.groups.adopt_shared([n for n in dict.fromkeys(hung) if nodes.get(n.key) is n and n.host_page != NO_PAGE])
        return out

    def _hang_shared(self, rest: list[PageHash], pages: list[int], parent: PageNode | None, *, objects: bool = True) -> list[PageNode]:
        """``pages`` (the shared tier's, of the keys ``rest``) adopted below ``parent``, as many as the host
        allocator makes room for (its LRU evicts for them); the rest let go. ``objects``: a hybrid model's objects
        of them adopted too (else the caller does, for many runs at once)."""
        self.tree.lock(parent)  # the path the adopted pages hang from stays
        try:
            if self.tenants is not None:  # (within its tenant's cap: what does not fit is let go)
                keep = self._room_under_cap(self.tree.current_owner, len(pages))
                if keep < len(pages):
                    self.shared_host.let_go(pages[keep:])
                    pages = pages[:keep]
            short = len(pages) - self.host_alloc.num_free
            if short > 0:
                self._evict_host_for_room(short)
        finally:
            self.tree.unlock(parent)
        if not pages:
            return []
        n = self.shared_host.adopt(pages)
        self.stats.shared_host_pages += n
        if not n:
            return []
        nodes = self.tree.add_host_chain(rest[:n], pages[:n], parent, ready=True)
        if objects:
            self.groups.adopt_shared(nodes)
        return nodes

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


def _unlocked_from_leaves_up(host_only: list[PageNode]) -> list[PageNode]:
    """Of host-only ``host_only`` (a union of whole subtrees below device pages), those no lock keeps,
    each after its children: the order :meth:`~kvtier.radix.PrefixTree.remove_host_only` takes them in.
    (A lock on a host-only node counts on each host-only node above it, so a node whose count is zero
    has none below it.)"""
    children_left = {n: n.num_children for n in host_only}
    ready = [n for n in host_only if not n.num_children and not n.lock_ref]
    order = []
    while ready:
        n = ready.pop()
        order.append(n)
        parent = n.parent
        if parent in children_left:
            children_left[parent] -= 1
            if not children_left[parent] and not parent.lock_ref:
                ready.append(parent)
    return order
