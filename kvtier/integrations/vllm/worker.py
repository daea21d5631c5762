"""The connector on one vLLM worker (one tensor-parallel rank): bytes only, no policy.

It holds this rank's slice of everything: vLLM's KV blocks (the device side),
a host pool addressed by the page ids every rank shares -- attached to the node
service, its rank's slice of the service's region (:meth:`ConnectorWorker.use_region`) --,
and its own L3 I/O under a namespace that carries the rank. Each step it runs the plans the
scheduler's core sent (:class:`~kvtier.integrations.vllm.messages.KVTierConnectorMetadata`)
and reports their completions back; it decides nothing.

Per step, in vLLM's order:

* ``start_load_kv`` -> :meth:`ConnectorWorker.start_loads`: L3 fetches start and
  are settled per the storage config's prefetch policy; the copies into vLLM's
  blocks that follow them start with what arrived (``Transfer.after``), one layer
  at a time on kvtier's transfer worker;
  the step's copies out of vLLM's blocks are submitted *layered*: nothing moves yet;
* ``wait_for_layer_load(layer)`` -> :meth:`ConnectorWorker.wait_layer`: that layer only;
* ``save_kv_layer(layer)`` -> :meth:`ConnectorWorker.save_layer`: that layer of the
  blocks being computed is written, so its copy out starts while the forward goes
  on with the next layers;
* ``wait_for_save`` -> :meth:`ConnectorWorker.finish_step`: the loads have landed;
  any layer vLLM did not announce is released; the copies out finish in the
  background (the forward already hid most of them), and vLLM keeps their blocks:
  a running request's full blocks are never rewritten, a finished request's are
  kept until ``get_finished`` -> :meth:`ConnectorWorker.finished_sending` reports
  its copies done (the scheduler side asked vLLM to wait), and a preempted one's
  are waited for in ``handle_preemptions`` -> :meth:`ConnectorWorker.wait_copies`
  before the next forward may overwrite them. The write-through L3 saves that
  follow read kvtier's host pages, never vLLM's blocks;
* ``get_block_ids_with_load_errors`` -> the blocks whose pages did not arrive
  (vLLM recomputes them);
* a hybrid model (:mod:`.groups`): each sliding-window or state group's layers are
  a pool of their own beside the full group's, moved by the same plans (a layer of a
  group's objects is copied out once vLLM wrote that layer); its loads are
  asynchronous (``get_transfer_results`` reports each request once its load
  ended here, and as failed unless it brought everything);
* ``build_connector_worker_meta`` -> :meth:`ConnectorWorker.take_results`: every
  completion since the last step, once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import torch

from kvtier.l3.tier import open_storage_tier
from kvtier.core.plans import Completion, Done, Failed, Reason, Tier, Transfer, completed_pages
from kvtier.errors import ConfigError, ServiceError
from kvtier.executors.chain import ChainedExecutor
from kvtier.executors.local import LocalExecutor, group_movers
from kvtier.hashing import Namespace, split_fingerprint
from kvtier.integrations.vllm.groups import VllmGroup, hybrid_fingerprint
from kvtier.integrations.vllm.layout import ModelShape, map_kv_caches, map_state_caches
from kvtier.integrations.vllm.messages import KVTierConnectorMetadata, KVTierHandshake, KVTierWorkerMeta, RankResult
from kvtier.integrations.vllm.metrics import KVTierConnectorStats
from kvtier.integrations.vllm.options import ConnectorOptions
from kvtier.l3.base import redact_url
from kvtier.pools import HostPool
from kvtier.service.backoff import AttachBackoff
from kvtier.service.client import SessionWriter
from kvtier.service.peer import check_socket_dir
from kvtier.service.region import REPLICATED_ATTENTION, ObjectPool, Region, map_region, region_format_of
from kvtier.spec import KVSpec
from kvtier.transfer.engine import TransferEngine

log = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    """What this rank moved (pages): the figures a test or an operator reads from each worker."""

    loaded_pages: int = 0
    fetched_pages: int = 0
    load_failed_pages: int = 0
    offloaded_pages: int = 0
    saved_pages: int = 0
    save_failures: int = 0
    #: layer copies out of vLLM's blocks started in save_kv_layer, during the forward ...
    offload_layers_in_forward: int = 0
    #: ... and those released in wait_for_save (layers vLLM did not announce)
    offload_layers_at_step_end: int = 0
    #: copies out of vLLM's blocks given up after rank_timeout_s (the blocks went back to vLLM)
    copies_abandoned: int = 0
    #: on the node service with MLA's latent (one shard every rank shares): copies out this rank left to rank 0
    copies_out_left_to_rank0: int = 0
    #: with an L3 of its own and MLA's latent at TP>1 (one object a page, every rank's): saves this rank left to rank 0
    saves_left_to_rank0: int = 0
    #: bytes of full-attention pages copied into vLLM's blocks
    loaded_bytes: int = 0
    #: a hybrid model, per KV group beside full attention: its objects (sliding-window pages, state
    #: snapshots) copied into vLLM's blocks (a load brings only what its boundary reads), their bytes,
    #: and the objects copied out
    group_objects_loaded: dict[str, int] = field(default_factory=dict)
    group_bytes_loaded: dict[str, int] = field(default_factory=dict)
    group_objects_offloaded: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class ConnectorWorker:
    def __init__(self, options: ConnectorOptions, model: ModelShape, model_name: str, tp_rank: int,
                 groups: list[VllmGroup] | None = None, tp_size: int = 1, *, shared_latent: bool = True):
        """``shared_latent``: every rank holds MLA's latent whole (False under context parallelism, which splits it
        by tokens: each rank then keeps L3 objects of its own)."""
        self.options = options
        self.shared_latent = shared_latent
        self.model = model
        self.model_name = model_name
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        #: attached to the node service: the region this rank's host pool is a shard of (None: not mapped yet)
        self.region: Region | None = None
        self._host: HostPool | None = None
        #: attached to the node service, until the first step names its region: the spec and the device pool
        self._unmapped: tuple[KVSpec, object] | None = None
        #: the region and session this rank last failed to use (warned about once)
        self._unusable: tuple[str, str | None] | None = None
        #: this rank's join of the scheduler's session on the node service
        self._writer: SessionWriter | None = None
        #: a region page holds one shard every rank shares (MLA's latent) and this rank is not rank 0: its copies
        #: out are rank 0's to make (it reports them done at once; the scheduler publishes when rank 0's is)
        self._leaves_copies_out = False
        #: MLA's latent in an L3 of its own at TP>1: rank 0 saves each page's one object, every rank loads it
        self._leaves_saves = False
        self._join_backoff = AttachBackoff()
        self.groups = groups if groups is not None and len(groups) > 1 else None
        self.stats = WorkerStats()
        self.executor: ChainedExecutor | None = None
        self.storage = None
        #: this rank's L3 namespace (set when the KV caches are registered)
        self.namespace: Namespace | None = None
        #: layer name -> (its KV group, None for the full one; its layer index in that group)
        self._layer_index: dict[str, tuple[str | None, int]] = {}
        #: a hybrid model's asynchronous loads running here (op -> (request, whether whole)), and the
        #: requests whose load ended since vLLM last asked (and those of them that failed)
        self._async: dict[int, tuple[str, bool]] = {}
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        #: copies into vLLM's blocks started this step
        self._loads: list[int] = []
        #: this step's copies out of vLLM's blocks (layered) and the layers released so far
        self._offloads: list[int] = []
        self._released: set[int] = set()
        #: copies out that have not completed here: op -> when the step that made them ended
        self._copying: dict[int, float] = {}
        #: finished requests whose blocks vLLM keeps for copies out: req id -> their ops
        self._delayed: dict[str, list[int]] = {}
        self._num_layers = 0
        #: plans whose completion has not come back yet (op -> plan), across steps
        self._open: dict[int, Transfer] = {}
        self._done: dict[int, Completion] = {}
        self._failed_blocks: set[int] = set()
        #: this interval's numbers for vLLM's stats path (get_kv_connector_stats)
        self.interval = KVTierConnectorStats()
        self._page_tokens = self._page_bytes = 0
        self._group_page_bytes: dict[str, int] = {}
        #: on the node service, a hybrid model's groups until the region is mapped (name -> (object spec, device pool)), and then
        #: their host pools over the region's object pools
        self._unmapped_groups: dict = {}
        self._group_hosts: dict[str, HostPool] = {}
        self._load_started: float | None = None

    # ---- start-up --------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> KVTierHandshake:
        tiers = self.options.tiers
        if self.groups is None:
            spec, device, index = map_kv_caches(kv_caches, self.model)
            self._layer_index = {n: (None, i) for n, i in index.items()}
            host = HostPool(spec, tiers.host_pages_for(spec.page_bytes), tiers.host_layout) if not tiers.service else None
            fingerprint, pools = spec.fingerprint(), {}
        else:  # each group's layers are a pool of their own (vLLM's block ids index every one of them)
            built = {}
            for g in self.groups:
                caches = {n: kv_caches[n] for n in g.layer_names}
                if g.kind == "state":
                    gspec, gdev, index = map_state_caches(caches, g.name)
                else:
                    gspec, gdev, index = map_kv_caches(caches, self.model)
                built[g.name] = (gspec, gdev)
                self._layer_index.update({n: (None if g.kind == "full" else g.name, i) for n, i in index.items()})
            spec, device = built.pop("full")
            if tiers.service:  # (each group's host objects: an object pool of the region, mapped with its pages -- use_region)
                host, pools = None, {}
                self._unmapped_groups = built
            else:  # one host budget: as many objects of every other group as full pages
                pages = tiers.host_pages_for(spec.page_bytes + sum(gspec.page_bytes for gspec, _ in built.values()))
                host = HostPool(spec, pages, tiers.host_layout)
                pools = {name: (gdev, HostPool(gspec, pages, tiers.host_layout)) for name, (gspec, gdev) in built.items()}
            fingerprint = hybrid_fingerprint(spec, [(name, gspec) for name, (gspec, _d) in built.items()], tiers.host_layout, self.tp_size)
        # (the split is in it: a rank's shard is another head at another split, see split_fingerprint). MLA's latent, the same
        # on every rank, is one L3 object a page, in rank 0's namespace: rank 0 saves it, every rank loads it -- not under
        # context parallelism (each rank's latent is other tokens'), nor for a hybrid model (one object a rank, every group's)
        replicated = (self.groups is None and spec.attention in REPLICATED_ATTENTION and self.tp_size > 1 and self.shared_latent)
        self._leaves_saves = replicated and self.tp_rank > 0
        split = fingerprint if self.groups else split_fingerprint(fingerprint, self.tp_size)  # (a hybrid's region format has it)
        namespace = self.namespace = Namespace(self.model_name, split, 0 if replicated else self.tp_rank, self.options.salt)
        self._page_tokens, self._page_bytes = spec.page_size, spec.page_bytes
        self._group_page_bytes = {name: hp.spec.page_bytes for name, (_, hp) in pools.items()}
        self._group_page_bytes.update({name: gspec.page_bytes for name, (gspec, _d) in self._unmapped_groups.items()})
        self._num_layers = len(self._layer_index)
        if host is None:  # the node service's region: mapped when the first step names it (use_region)
            self._unmapped = (spec, device)
            log.info("kvtier worker rank %d of %d: %s, host tier on the node service %s", self.tp_rank, self.tp_size, spec.name,
                     tiers.service)
            return KVTierHandshake(self.tp_rank, spec, 0, None, {name: (gspec, 0) for name, (gspec, _d) in self._unmapped_groups.items()})
        self._start_executor(host, device, pools)
        log.info("kvtier worker rank %d: %s, %d host pages (%s)%s, L3 %s", self.tp_rank, spec.name, host.num_pages, host.layout.kind,
                 f", KV groups {sorted(pools)} beside full attention" if pools else "", redact_url(self.options.storage.url) or "off")
        return KVTierHandshake(self.tp_rank, spec, host.num_pages, str(namespace) if self.storage is not None else None,
                               {name: (hp.spec, hp.num_pages) for name, (_, hp) in pools.items()})

    def _start_executor(self, host: HostPool, device, pools: dict) -> None:
        self._host = host
        self.storage = open_storage_tier(self.options.storage, host, self.namespace)
        io = self.options.cache.io_backend
        engine = TransferEngine(host, device, io, name=f"kvtier-worker{self.tp_rank}")
        self.executor = ChainedExecutor(LocalExecutor(engine, self.storage, *group_movers(pools, io, self.storage)))

    def use_region(self, region: Region) -> None:
        """Attached to the node service: this rank's shard of ``region`` (:meth:`~kvtier.service.region.RegionFormat.shard`)
        is its host pool, mapped where the service made it (no pool of its own, no copy). The first step's
        region starts the executor; another one later -- the scheduler attached to a restarted service -- is
        mapped in its place before any of the step's plans runs. No plan on the old region is running then:
        the scheduler attaches again only once none of the old region's pages is in its books, so every
        copy that touched them has completed on every rank."""
        if region == self.region:
            return
        if self._host is None and self._unmapped is None or not self.options.tiers.service:
            raise ConfigError("kvtier worker: the scheduler names a node service region, but this worker was not configured with "
                              "service=...; give every rank the same kv_connector_extra_config")
        spec = self._unmapped[0] if self._unmapped is not None else self._host.spec
        groups = self._unmapped_groups
        want, shards = region_format_of(spec, self.options.tiers.host_layout, self.tp_size, hybrid=bool(groups))
        want = want.with_objects([ObjectPool(name, gspec) for name, (gspec, _d) in groups.items()])
        if region.format != want:
            raise ConfigError(f"kvtier worker rank {self.tp_rank}: the node service's region holds pages of {region.format}, this rank's "
                              f"shards make {want}; every rank must register the same model, split {self.tp_size} ways")
        # one shard for every rank (MLA's latent): rank 0's copies out fill it, every rank's loads read it
        self._leaves_copies_out = shards == 1 and self.tp_rank > 0
        start, size = region.format.shard(region.num_pages, self.tp_rank if shards > 1 else 0, shards)
        # this rank's slice alone, registered with CUDA where there is one (in the background when it replaces a
        # mapping: this is a step of vLLM's, and page-locking a large slice takes seconds); only a file the service made
        # (of its uid, in its socket directory's group at most: the scheduler checked the service it names, this rank checks again)
        tiers = self.options.tiers
        trust = check_socket_dir(tiers.service, tiers.service_uid)
        parts = {0: (start, size)}
        if groups:  # (a hybrid model's region: mapped whole, this rank's slice of its pages and of every object pool used)
            parts.update({k: region.format.object_shard(k, region.num_pages, self.tp_rank) for k in range(1, region.format.pools)})
            start, size = 0, region.size
        memory = map_region(region.path, region.size, trust=trust, offset=start, length=size, pin_in_background=self._host is not None)
        parts = {k: memory[slice(*_span(span))] for k, span in parts.items()} if groups else {0: memory}
        if self._host is None:
            spec, device = self._unmapped
            self._unmapped = None
            layout = self.options.tiers.host_layout
            host = HostPool(spec, region.num_pages, layout, memory=parts[0], name="node service region", pin_memory=memory.is_pinned())
            pools = {name: (gdev, HostPool(gspec, region.num_pages, layout, memory=parts[k], name=f"node service region, KV group {name!r}",
                                           pin_memory=memory.is_pinned()))
                     for k, (name, (gspec, gdev)) in enumerate(groups.items(), start=1)}
            self._group_hosts = {name: hp for name, (_d, hp) in pools.items()}
            self._start_executor(host, device, pools)
        else:
            self._host.remap(parts[0], region.num_pages)
            for k, name in enumerate(groups, start=1):
                self._group_hosts[name].remap(parts[k], region.num_pages)
        self.region = region
        log.info("kvtier worker rank %d: host tier mapped from the node service's region %s (bytes %d..%d of %d pages)", self.tp_rank,
                 region.path, start, start + size, region.num_pages)

    # ---- one step --------------------------------------------------------------------------
    def begin_step(self, meta: KVTierConnectorMetadata) -> None:
        """A step's metadata, once, before its forward: the node service's region mapped and the scheduler's
        session joined (when the scheduler names them), then the step's plans started. A region this rank
        cannot map or a session it cannot join -- the region's file removed under the service, the service
        gone or the scheduler's session ended since the scheduler's lookup -- never raises into vLLM's step:
        every plan of the step fails here before any byte moves (vLLM recomputes the loads' blocks, the copies
        out are dropped and their pages released), and the next step tries again."""
        unusable = None
        if meta.region is not None:
            try:
                self.use_region(meta.region)
                self._join(meta.service_session)
            except ServiceError as e:
                unusable = str(e)
        if unusable is None:
            self._unusable = None
            self.start_loads(meta.plans, meta.unavailable_blocks, meta.delayed, meta.async_loads, meta.async_failed, meta.preempted_copies)
            return
        if (meta.region.path, meta.service_session) != self._unusable:
            self._unusable = (meta.region.path, meta.service_session)
            log.warning("kvtier worker rank %d: %s; this step's %d kvtier copies fail (vLLM recomputes what they would have "
                        "loaded) and the next step tries again", self.tp_rank, unusable, len(meta.plans))
        self.start_loads([], meta.unavailable_blocks, meta.delayed, meta.async_loads, meta.async_failed, meta.preempted_copies)
        self._open.update((p.op, p) for p in meta.plans)
        self._collect([Failed(p.op, Reason.ERROR, unusable) for p in meta.plans])

    def _join(self, session: str | None) -> None:
        """Join the scheduler's ``session`` as a process writing into its pages (once per session): if the
        engine core dies while a copy of this rank's is landing, the service frees none of its pages until
        this rank is gone too. The session before it is left then: the scheduler attached anew only once
        every copy into the old session's pages had completed on every rank."""
        if session is None or (self._writer is not None and self._writer.session == session):
            return
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if not self._join_backoff.due():  # (a session that cannot be joined is not asked again every step)
            raise ServiceError(f"the scheduler's session on the node service {self.options.tiers.service} is not joined yet")
        try:
            tiers = self.options.tiers
            self._writer = SessionWriter(tiers.service, session, tiers.service_lookup_timeout_s, tiers.service_uid)
        except ServiceError:
            self._join_backoff.failed()
            raise
        self._join_backoff.attached()

    def start_loads(self, plans: list[Transfer], unavailable_blocks: list[int] = (), delayed: dict[str, list[int]] | None = None,
                    async_loads: dict[int, tuple[str, bool]] | None = None, async_failed: list[str] = (),
                    fenced: list[int] = ()) -> None:
        """``fenced``: copies out of blocks this step may write (they finish first); ``async_loads``: loads
        among ``plans`` the step does not wait for (reported by :meth:`finished_recving`)."""
        ex = self.executor
        self.wait_copies(list(fenced))
        self._loads, self._offloads, self._released = [], [], set()
        self._failed_blocks.update(unavailable_blocks)
        self._delayed.update(delayed or {})
        self._async.update(async_loads or {})
        self._recv_done.update(async_failed)
        self._recv_failed.update(async_failed)
        self._load_started = time.perf_counter() if any(p.dst is Tier.DEVICE or p.src is Tier.STORAGE for p in plans) else None
        for p in plans:  # in plan order: a save follows the copy that fills its host pages (Transfer.after)
            if p.src is Tier.DEVICE and self._leaves_copies_out:  # rank 0 writes the one shard every rank shares
                self._done[p.op] = Done(p.op)
                self.stats.copies_out_left_to_rank0 += 1
                continue
            if p.dst is Tier.STORAGE and self._leaves_saves:  # rank 0 saves the one object every rank loads
                self._done[p.op] = Done(p.op)
                self.stats.saves_left_to_rank0 += 1
                continue
            self._open[p.op] = p
            if p.src is Tier.DEVICE:
                ex.submit(p, layered=True)
                self._offloads.append(p.op)
            else:
                ex.submit(p)
                if p.dst is Tier.DEVICE and p.op not in self._async:
                    self._loads.append(p.op)
        cfg = self.options.storage
        for p in plans:
            if p.src is Tier.STORAGE:  # the copy that follows starts with what this lets arrive
                ex.settle(p.op, cfg.prefetch_policy, cfg.prefetch_budget_s(p.num_pages))
        self._collect(self._poll())

    def wait_layer(self, layer_name: str) -> None:
        where = self._layer_index.get(layer_name)
        if where is None or not self._loads:
            return
        group, layer = where
        for op in self._loads:
            self.executor.wait_layer(op, layer, group)

    def save_layer(self, layer_name: str) -> None:
        """vLLM wrote layer ``layer_name`` of this step's blocks: copy that layer of the step's offloads out now."""
        where = self._layer_index.get(layer_name)
        if where is None or not self._offloads or layer_name in self._released:
            return
        self._released.add(layer_name)
        group, layer = where
        for op in self._offloads:
            self.executor.release_layer(op, layer, group)

    def finish_step(self) -> None:
        ex = self.executor
        if self._loads:
            self._collect(ex.wait(self._loads))
            self._loads = []
        if self._load_started is not None:
            self.interval.data["load_seconds"].append(time.perf_counter() - self._load_started)
            self._load_started = None
        offloads, self._offloads = self._offloads, []
        if offloads:  # they finish in the background; vLLM keeps their blocks until they did (module docstring)
            self.stats.offload_layers_in_forward += len(offloads) * len(self._released)
            self.stats.offload_layers_at_step_end += len(offloads) * (self._num_layers - len(self._released))
            now = time.perf_counter()
            for op in offloads:
                ex.release_rest(op)
                if op in self._open:
                    self._copying[op] = now
        self._collect(self._poll())

    def finished_sending(self) -> set[str]:
        """Finished requests whose blocks vLLM kept for this rank's copies out of them, now done (each once)."""
        if not self._delayed:
            return set()
        self._collect(self._poll())
        self._abandon_overdue_copies()
        done = {req for req, ops in self._delayed.items() if not any(op in self._copying for op in ops)}
        for req in done:
            del self._delayed[req]
        return done

    def _abandon_overdue_copies(self) -> None:
        """Copies out of vLLM's blocks still running ``rank_timeout_s`` after their step ended: vLLM
        gets the blocks back (the copy counts as failed: its completion comes back Failed, so no save
        follows it, and the scheduler holds its host pages until it answers)."""
        deadline = time.perf_counter() - self.options.rank_timeout_s
        for op, ended in list(self._copying.items()):
            if ended <= deadline:
                del self._copying[op]
                self.executor.abandon(op, f"copy out of vLLM's blocks ran past rank_timeout_s={self.options.rank_timeout_s:g}")
                self.stats.copies_abandoned += 1
                self.interval.data["copies_abandoned"] += 1
                log.warning("kvtier worker rank %d: copy %d out of vLLM's blocks still running after %.1f s; its blocks go back "
                            "to vLLM and the copy counts as failed", self.tp_rank, op, self.options.rank_timeout_s)

    def finished_recving(self) -> tuple[set[str], set[str]]:
        """(requests whose asynchronous load ended here since the last call, those of them that failed)."""
        if self._async and self.executor is not None:
            self._collect(self.executor.poll())
        done, failed = self._recv_done, self._recv_failed
        self._recv_done, self._recv_failed = set(), set()
        return done, failed

    def wait_copies(self, ops: list[int]) -> None:
        """Block until these copies out of vLLM's blocks completed here (preempted requests' blocks)."""
        running = [op for op in ops if op in self._copying]
        if running:
            self._collect(self.executor.wait(running))

    def _poll(self) -> list[Completion]:
        """The executor's completions since the last poll (none before a service's region is mapped)."""
        return self.executor.poll() if self.executor is not None else []

    def _collect(self, completions: list[Completion]) -> None:
        for c in completions:
            plan = self._open.pop(c.op, None)
            self._done[c.op] = c
            if plan is None:
                continue
            ended = self._copying.pop(c.op, None)
            if ended is not None:  # a copy out: how long it ran past the end of its step
                self.interval.data["store_seconds"].append(time.perf_counter() - ended)
            done = completed_pages(c, plan.num_pages)
            st = self.stats
            moved = done - c.existing if plan.dst is Tier.STORAGE else done
            tier = "storage" if Tier.STORAGE in (plan.src, plan.dst) else "host"
            direction = "load" if plan.dst is not Tier.STORAGE and plan.src is not Tier.DEVICE else "store"
            # (tokens once per request: rank 0 counts them; bytes on every rank, each moves its own shard)
            self.interval.record(tier, direction, moved * self._page_tokens if self.tp_rank == 0 else 0, moved * self._page_bytes)
            if plan.dst is Tier.DEVICE and done < plan.num_pages:
                self.interval.data["load_failed_tokens"] += (plan.num_pages - done) * self._page_tokens
            waiting = self._async.pop(c.op, None)
            if waiting is not None:  # a hybrid model's load, whole or nothing: vLLM recomputes the request if not
                req, whole = waiting
                self._recv_done.add(req)
                if not whole or done < plan.num_pages:
                    self._recv_failed.add(req)
            whole = type(c) is Done
            if plan.dst is Tier.DEVICE:
                for run in plan.groups if whole else ():
                    st.group_objects_loaded[run.group] = st.group_objects_loaded.get(run.group, 0) + len(run.dst_pages)
                    st.group_bytes_loaded[run.group] = (st.group_bytes_loaded.get(run.group, 0)
                                                        + len(run.dst_pages) * self._group_page_bytes[run.group])
                st.loaded_pages += done
                st.loaded_bytes += done * self._page_bytes
                if done < plan.num_pages:
                    st.load_failed_pages += plan.num_pages - done
                if done < plan.num_pages and waiting is not None:  # (reported per request: finished_recving)
                    log.info("kvtier worker rank %d: a load of %d pages failed (%s); vLLM recomputes request %s", self.tp_rank,
                             plan.num_pages, c.reason, waiting[0])
                elif done < plan.num_pages:
                    self._failed_blocks.update(plan.dst_pages[done:])
                    log.info("kvtier worker rank %d: %d of %d pages not loaded (%s); vLLM recomputes them", self.tp_rank,
                             plan.num_pages - done, plan.num_pages, c.reason)
            elif plan.src is Tier.STORAGE:
                st.fetched_pages += done
            elif plan.src is Tier.DEVICE:
                st.offloaded_pages += done
                for run in plan.groups if whole else ():
                    st.group_objects_offloaded[run.group] = st.group_objects_offloaded.get(run.group, 0) + len(run.dst_pages)
            elif plan.dst is Tier.STORAGE:
                st.saved_pages += done - c.existing
                st.save_failures += type(c) is not Done

    def take_results(self) -> KVTierWorkerMeta | None:
        self._collect(self._poll())
        done, self._done = self._done, {}
        return KVTierWorkerMeta({op: RankResult(c, frozenset({self.tp_rank})) for op, c in done.items()}) if done else None

    def drained_stats(self, timeout_s: float = 30.0) -> WorkerStats:
        """The stats once the L3 writes in flight finished (bounded by ``timeout_s``); their completions
        are still reported to the scheduler at the next step."""
        if self.executor is not None:
            self.wait_copies(list(self._copying))  # their L3 saves start when they complete
        if self.storage is not None:
            self.storage.drain(timeout_s)
        if self.executor is not None:
            self._collect(self.executor.poll())
        return self.stats

    def take_stats(self) -> KVTierConnectorStats | None:
        """This interval's numbers (then a new interval starts); None when nothing moved."""
        if self.interval.is_empty():
            return None
        out, self.interval = self.interval, KVTierConnectorStats()
        return out

    def take_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the L3 writes in flight (bounded), then release the executor."""
        if self.executor is None:
            return
        self.wait_copies(list(self._copying))  # their L3 saves start when they complete
        drained = self.storage is None or self.storage.drain(timeout_s)
        if not drained:
            log.warning("kvtier worker rank %d: L3 writes still running after %.0f s at shutdown; the rest are dropped",
                        self.tp_rank, timeout_s)
        self.executor.close()
        self.executor = None
        if self._writer is not None and drained:  # no copy of this rank writes into the session's pages any more (else its
            self._writer.close()                  # process's end says so)
            self._writer = None


def _span(part: tuple[int, int]) -> tuple[int, int]:
    start, size = part
    return start, start + size
