"""The connector on vLLM's scheduler: the policy core, and nothing that holds a byte.

It owns kvtier's index for the engine -- the prefix tree, the host page ids
every rank's host shard shares, host LRU, L3 save state -- as an
:class:`~kvtier.core.engine_device.EngineDeviceCore` on a
:class:`~kvtier.integrations.vllm.scheduler_port.SchedulerPort`: every decision
leaves as plans in the next step's connector metadata, and outcomes come back
from the workers, joined over ranks, before the scheduler looks again.

* ``get_num_new_matched_tokens``: the request's full blocks become page keys
  (chained over the token ids; the last prompt token is always computed, so at
  most ``(len - 1) // block_size`` blocks are offered); the core answers how
  many leading pages host memory holds, then the store (every rank's object).
  Attached to the node service, a request whose pages the engine does not hold
  whole is answered "not yet" (None: vLLM skips it this step and asks again
  next step); when the step ends, the service is asked about all of them in one
  round trip, and what it holds is in the tree for their next lookup
  (``service_lookups="request"``: a round trip per request, answered at once).
* ``build_connector_meta``: for a request scheduled with a hit, the core plans
  the L3 fetch and the copy into the blocks vLLM allocated (``plan_load``); for
  every request whose blocks became full this step -- prompt and decoded
  tokens alike, so the next turn of a chat finds its previous answer -- the core
  plans the copy out of those blocks and its write-through save
  (``offload(wait=False)``).
* ``update_connector_output``: the workers' completions reach the core.
* ``request_finished``: what kvtier offered the request goes back to the caller
  as ``kv_transfer_params["kvtier"]`` (vLLM's per-request channel to the client);
  while a copy out of its blocks may still be running, or full blocks of it
  are not planned yet (the copy of the blocks before them was still running),
  vLLM keeps the blocks: the next steps plan what is left, and every worker
  reports the request in ``get_finished`` once its copies are done.

Hybrid models (vLLM's hybrid KV cache manager, :mod:`.groups`): a request has a
block list per KV cache group; the full group's pages are the tree's, each
sliding-window group's blocks go out and come back as that group's objects
(only the window a boundary reads comes back). vLLM takes block-level load
failures from single-group models only, so a hybrid model's loads are
asynchronous (``load_kv_async``): the request waits while its load runs and is
reported finished -- or failed, and then recomputed -- by every worker. A
sliding-window block vLLM frees mid-request (it left the window) may be handed
out again at once: a copy out of it still running is waited for
(``handle_preemptions``) before a step that allocated it runs.

A page whose load failed on any rank is recomputed by vLLM, and for
``load_retry_s`` no lookup offers it (or anything after it) again
(:class:`RecentFailures`), so a page that keeps failing -- a store that
answers ``exists`` but cannot serve the bytes, a rank that cannot copy --
costs one failed load, not a lookup -> load -> fail loop.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvtier.alloc import PageAllocator
from kvtier.core.engine_device import EngineDeviceCore
from kvtier.core.plans import completed_pages
from kvtier.core.shared_host import NO_SHARED_HOST
from kvtier.errors import ConfigError
from kvtier.hashing import Namespace, PageHash, hasher, page_keys, request_scope, scoped_root
from kvtier.shared_prefixes import SharedPrefixes
from kvtier.integrations.vllm.events import TierEvents
from kvtier.integrations.vllm.groups import VllmGroup, hybrid_fingerprint, model_spec
from kvtier.integrations.vllm.messages import KVTierConnectorMetadata, KVTierHandshake, KVTierWorkerMeta
from kvtier.integrations.vllm.options import ConnectorOptions
from kvtier.integrations.vllm.scheduler_port import SchedulerPort, StoreProbe
from kvtier.service.attach import attach_pages
from kvtier.service.leased import LeasedPages
from kvtier.service.region import ObjectPool, region_format_of
from kvtier.spec import KVSpec

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: the most steps' batches a request is asked about in while the last one is fresh (each costs it a step: _step_ask)
MAX_BATCHES = 3
#: scheduler steps a batch's answer stays fresh for a request vLLM has not scheduled (then it is asked about again)
FRESH_STEPS = 16
#: steps a finished request's blocks may wait for the copies of other requests' blocks before them
#: (a shared prefix still arriving) before kvtier gives up on copying them out
FINISH_STEPS = 8


@dataclass
class HitRecord:
    """What the scheduler side offered one request."""

    req_id: str
    prompt_tokens: int
    local_tokens: int
    external_tokens: int
    host_pages: int
    storage_pages: int
    #: pages whose copy out of vLLM's blocks was planned for this request (prompt and decode)
    offloaded_pages: int = 0
    #: of ``host_pages``, those this lookup took from the node service (other engines', or an earlier
    #: run's, published pages); 0 without a service
    shared_host_pages: int = 0


class RecentFailures:
    """Page keys whose load failed recently: not offered again until ``ttl_s`` passed (bounded LRU)."""

    def __init__(self, ttl_s: float, max_entries: int = 100_000):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._until: OrderedDict[PageHash, float] = OrderedDict()

    def add(self, keys: list[PageHash]) -> None:
        until = time.monotonic() + self.ttl_s
        for k in keys:
            self._until[k] = until
            self._until.move_to_end(k)
        while len(self._until) > self.max_entries:
            self._until.popitem(last=False)

    def usable(self, keys: list[PageHash]) -> int:
        """Leading ``keys`` none of which failed within the last ``ttl_s``."""
        if not self._until:
            return len(keys)
        now = time.monotonic()
        for i, k in enumerate(keys):
            until = self._until.get(k)
            if until is not None:
                if until > now:
                    return i
                del self._until[k]
        return len(keys)

    def __len__(self) -> int:
        return len(self._until)


@dataclass
class _RequestState:
    request: Any
    root: PageHash
    #: its scope (``cache_salt`` and LoRA adapter, :func:`request_scope`): whose pages it makes, for the tenants' ledger
    scope: bytes = b""
    keys: list[PageHash] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    #: leading pages the core holds or has planned to copy
    saved: int = 0
    load_start: int = 0
    load_end: int = 0
    load_pending: bool = False
    hit: HitRecord | None = None
    #: copies out of this request's blocks that may still be running (vLLM must keep those blocks)
    copy_ops: list[int] = field(default_factory=list)
    #: leading blocks computed (full) as of the latest step
    full: int = 0
    #: steps a finished request's remaining blocks have waited to be planned (see request_finished)
    finish_steps: int = 0
    #: a hybrid model: each other group's block list (vLLM's null block 0 where it dropped one)
    group_blocks: dict[str, list[int]] = field(default_factory=dict)
    #: tokens vLLM had computed when it last allocated this request's blocks -- and freed the window (and state) blocks it
    #: no longer needs, handing them to other requests without a word in the scheduler output (:meth:`_live_group_ids`)
    processed: int = 0
    #: a hybrid model's asynchronous load still running into this request's blocks
    async_op: int | None = None
    #: the steps' batches the node service was asked about this request in (:meth:`ConnectorScheduler._ask_service`)
    batches: int = 0
    #: the pages the latest batch adopted for it (until an answer counts them), the tree's run of its keys right after,
    #: how many keys it asked about, and the step it ran in (None: none since the request was last preempted)
    prefetched: int = 0
    covered: int = 0
    asked_pages: int = 0
    batch_step: int | None = None


class ConnectorScheduler:
    def __init__(self, options: ConnectorOptions, block_size: int, world_size: int, model_name: str,
                 groups: list[VllmGroup] | None = None):
        if options.storage.url and options.storage.write_policy != "write_through":
            raise ConfigError("kvtier connector: storage_write_policy must be write_through (a write_back save would make the "
                              "scheduler wait for a worker when host memory evicts)")
        self.options = options
        self.block_size = block_size
        self.world_size = world_size
        self.model_name = model_name
        self.core: EngineDeviceCore | None = None
        #: attached to the node service: the host allocator leasing its region's pages (the core's shared host tier)
        self.leased: LeasedPages | None = None
        self.port: SchedulerPort | None = None
        self._requests: dict[str, _RequestState] = {}
        self._unavailable: list[int] = []
        #: finished requests whose blocks vLLM keeps until their copies out completed (next step's metadata)
        self._delayed: dict[str, list[int]] = {}
        #: finished requests (blocks kept by vLLM) with full blocks still to copy out
        self._finishing: dict[str, _RequestState] = {}
        self.recent_failures = RecentFailures(options.load_retry_s)
        #: loads planned and not yet answered: (load, the keys it copies)
        self._loads: list[tuple[Any, list[PageHash]]] = []
        self._hash = hasher(options.cache.hash_algo)
        #: kvtier's tiers as vLLM KV events (take_events)
        self.events = TierEvents(block_size, groups=groups if groups is not None and len(groups) > 1 else None)
        #: the latest lookups (bounded: a server runs for weeks)
        self.hits: deque[HitRecord] = deque(maxlen=1024)
        #: vLLM's KV cache groups (None or one: a model of full attention only)
        self.groups = groups if groups is not None and len(groups) > 1 else None
        self._full_index = next(g.index for g in groups if g.kind == "full") if self.groups else 0
        #: the groups beside full attention (sliding window, state)
        self._others = [g for g in self.groups if g.kind != "full"] if self.groups else []
        #: hybrid: asynchronous loads planned since the last metadata (op -> (request, whether it brings all
        #: that was offered)), requests whose load
        #: could not be planned, and block ids vLLM allocated this step (a copy out of them must finish first)
        self._async_loads: dict[int, tuple[str, bool]] = {}
        self._async_failed: list[str] = []
        self._allocated: set[int] = set()
        #: hybrid: window and state blocks copies out are reading -> those copies' ops
        self._sources: dict[int, set[int]] = {}
        #: with the node service (``service_lookups="step"``): the requests this step asked about whose pages the
        #: service may hold, asked in one round trip when the step ends (:meth:`_ask_service`)
        self._batch: list[_RequestState] = []
        #: scheduler steps so far (build_meta calls)
        self._steps = 0
        #: steps whose requests were asked of the service together, and the requests they asked about
        self.lookup_batches = 0
        self.batched_requests = 0

    # ---- start-up: what the workers built ------------------------------------------------------
    def handshake(self, metas: dict[int, KVTierHandshake]) -> None:
        ranks = sorted(metas)
        if ranks != list(range(self.world_size)):
            raise ConfigError(f"kvtier connector: handshakes from ranks {ranks}, expected 0..{self.world_size - 1}")
        first = metas[0]
        for r in ranks:
            m = metas[r]
            if m.spec.page_bytes != first.spec.page_bytes or m.spec.num_layers != first.spec.num_layers:
                raise ConfigError(f"kvtier connector: rank {r}'s pages ({m.spec.page_bytes} bytes, {m.spec.num_layers} layers) differ "
                                  f"from rank 0's ({first.spec.page_bytes}, {first.spec.num_layers}); every rank must hold an equal shard")
        prefixes = [metas[r].storage_prefix for r in ranks]
        probe = StoreProbe(self.options.storage, prefixes) if self.options.storage.url and all(prefixes) else None
        self.port = SchedulerPort(self.world_size, probe, self.options.rank_timeout_s)
        cache = replace(self.options.cache, preallocate_nodes=False)
        if self.groups:
            missing = [r for r in ranks if set(metas[r].group_pages) != {g.name for g in self._others}]
            if missing:
                raise ConfigError(f"kvtier connector: rank {missing[0]} registered KV groups {sorted(metas[missing[0]].group_pages)}, the "
                                  f"scheduler has {[g.name for g in self._others]}")
        if self.options.tiers.service:
            objects = {g.name: first.group_pages[g.name][0] for g in self._others} if self.groups else {}
            host = self.leased = self._attach_service(first.spec, objects)
        else:
            host = PageAllocator(min(metas[r].host_pages for r in ranks), "host pages (every rank's shard)")
        host_pages = host.capacity
        fingerprint = first.spec.fingerprint()
        if self.groups:
            model = model_spec(self.model_name, self.groups, {"full": first.spec, **{n: sp for n, (sp, _) in first.group_pages.items()}})
            if self.leased is not None:  # (each group's objects in an object pool of the region: the service's too)
                group_hosts = {g.name: self.leased.objects(k, g.name) for k, g in enumerate(self._others, start=1)}
            else:
                group_hosts = {g.name: PageAllocator(min(metas[r].group_pages[g.name][1] for r in ranks), f"{g.name} host objects")
                               for g in self._others}
            self.core = EngineDeviceCore(first.spec, host, self.port, cache, self.options.storage, model=model, group_hosts=group_hosts,
                                         shared_host=self.leased if self.leased is not None else NO_SHARED_HOST)
            fingerprint = hybrid_fingerprint(first.spec, [(g.name, first.group_pages[g.name][0]) for g in self._others],
                                             self.options.tiers.host_layout, self.world_size)
        else:
            shared = self.leased if self.leased is not None else NO_SHARED_HOST
            self.core = EngineDeviceCore(first.spec, host, self.port, cache, self.options.storage, shared_host=shared)
        self.core.on_host_evicted = self.events.evicted
        # page keys are the same on every rank (rank 0's namespace); L3 keys add each rank's prefix
        self._root = Namespace(self.model_name, fingerprint, 0, self.options.salt).root(self.options.cache.hash_algo)
        self._shared: SharedPrefixes | None = None
        if self.options.shared_prefixes:  # (declared before the first request: every request's keys follow them)
            self._shared = SharedPrefixes(self._root, self.block_size, self.options.cache.hash_algo)
            for tokens in self.options.shared_prefixes:
                pages = self._shared.declare(list(tokens))
                self.core.own_shared(self._shared.keys(list(tokens), b"")[:pages])
        log.info("kvtier scheduler: %d ranks, %d host pages each, L3 %s%s", self.world_size, host_pages, "on" if probe else "off",
                 f", node service {self.options.tiers.service} ({self._region_said()})" if self.leased else "")

    def _region_said(self) -> str:
        region = self.leased.region
        return f"region {region.path}" if region is not None else "not attached yet: host misses until it answers"

    def _attach_service(self, spec: KVSpec, objects: dict[str, KVSpec]) -> LeasedPages:
        """Attach to the node service: its region's pages hold every rank's shard of a page
        (:meth:`~kvtier.service.region.RegionFormat.of_shards`) -- or, for MLA's latent, which every rank
        holds whole, the one shard rank 0 writes and every rank reads
        (:meth:`~kvtier.service.region.RegionFormat.of_ranks`; not beside a hybrid model's objects, each rank's own:
        :func:`~kvtier.service.region.region_format_of`) -- in a namespace of the model, the shards'
        fingerprint with the tensor-parallel size, and the salt. ``host_pages`` / ``host_gb`` size this
        engine's share of the region (pages of every rank's shards); given neither, the share is the region.
        ``objects``: a hybrid model's other groups (name -> the spec of one object): an object pool each in the region
        (:meth:`~kvtier.service.region.RegionFormat.with_objects`), in the order the scheduler lists them."""
        tiers = self.options.tiers
        fmt, shards = region_format_of(spec, tiers.host_layout, self.world_size, hybrid=bool(objects))
        # (each object pool holds every rank's shard of an object, as the page does: RegionFormat.object_shard)
        fmt = fmt.with_objects([ObjectPool(name, ospec) for name, ospec in objects.items()])
        # (a replicated latent's page is one rank's: the namespace still names the split, whose numerics it is)
        fingerprint = fmt.fingerprint if shards == self.world_size else f"{fmt.fingerprint}-tp{self.world_size}"
        namespace = Namespace(self.model_name, fingerprint, 0, self.options.salt)
        share = None if self.options.service_share_from_region else tiers.host_pages_for(fmt.page_bytes)
        return attach_pages(tiers.service, fmt, namespace, share, deadline_s=tiers.service_timeout_s,
                            lookup_deadline_s=tiers.service_lookup_timeout_s, service_uid=tiers.service_uid,
                            required=tiers.service_required)

    # ---- keys --------------------------------------------------------------------------------
    def _request_root(self, request: Request) -> PageHash | None:
        """The root of the request's page keys: the engine's, scoped by its ``cache_salt`` and LoRA adapter
        (:func:`request_scope`); None where tokens alone do not determine the KV."""
        if request.mm_features or getattr(request, "prompt_embeds", None) is not None:
            return None
        return scoped_root(self._root, self._request_scope(request), self._hash)

    @staticmethod
    def _request_scope(request: Request) -> bytes:
        lora = request.lora_request.lora_name if request.lora_request else None
        return request_scope(getattr(request, "cache_salt", None), lora)

    def _extend_keys(self, state: _RequestState, pages: int) -> None:
        """Keys of the request's first ``pages`` full blocks (prompt, then decoded tokens), chained."""
        have = len(state.keys)
        if pages <= have:
            return
        tokens = state.request.all_token_ids
        bs = self.block_size
        start = have * bs
        prev = state.keys[-1] if state.keys else state.root
        state.keys += page_keys(tokens[start : pages * bs], bs, prev, self.options.cache.hash_algo)

    # ---- vLLM's scheduler calls ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.core is None:
            return 0, False
        root = self._request_root(request)
        if root is None:
            return 0, False
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request, root, self._request_scope(request))
            if self._shared is not None:  # a declared shared prefix: its pages' keys the shared scope's, the rest this salt's
                state.keys = self._shared.keys(request.prompt_token_ids, state.scope) or []
        bs = self.block_size
        usable = (request.num_prompt_tokens - 1) // bs
        self._extend_keys(state, usable)
        start = num_computed_tokens // bs
        asked = state.keys[: self.recent_failures.usable(state.keys[:usable])]
        shared = True
        if self._per_step:
            batch, shared = self._step_ask(state, asked, start, request)
            if batch:  # "not yet": vLLM skips it this step and asks again in the next
                state.batches, state.asked_pages = state.batches + 1, len(asked)
                self._batch.append(state)
                return None, False
        shared_before = self.core.stats.shared_host_pages
        self.core.act_for(state.scope)  # (its tenant's ledger: hits counted, pages it makes owned, TTLs swept)
        found = self.core.lookup(asked, shared=shared)
        if found.probed and found.pages < len(asked):
            self.events.missing_from_storage(asked[found.pages])
        state.load_start, state.load_end, state.load_pending = start, max(start, found.pages), False
        external = (state.load_end - start) * bs
        state.hit = HitRecord(
            request.request_id, request.num_prompt_tokens, num_computed_tokens, external, found.host_pages, found.storage_pages,
            shared_host_pages=min(found.host_pages, self.core.stats.shared_host_pages - shared_before + state.prefetched),
        )
        state.prefetched = 0  # (counted once: a later answer took nothing more from the service)
        self.hits.append(state.hit)
        return external, bool(self.groups) and external > 0

    def update_state_after_alloc(self, request: Request, num_external_tokens: int, block_ids: tuple[list[int], ...] = ()) -> None:
        """``block_ids``: every block of the request, per KV cache group (vLLM's ``get_blocks``)."""
        if self.groups:
            for ids in block_ids:
                self._allocated.update(ids)
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if num_external_tokens > 0:
            state.load_end = state.load_start + num_external_tokens // self.block_size
            state.load_pending = True
            if self.groups:  # asynchronous: planned now, into the blocks vLLM just allocated
                self._set_blocks(state, block_ids)
                self._plan_async_load(state)

    def _per_group(self, block_ids, state: _RequestState):
        """vLLM's block ids of a request, one list per KV cache group, or a :class:`ConfigError` naming both counts."""
        want = len(self.groups) if self.groups else 1
        if not isinstance(block_ids, (tuple, list)) or len(block_ids) != want:
            got = f"{len(block_ids)} block-id lists" if isinstance(block_ids, (tuple, list)) else f"block ids as {type(block_ids).__name__}"
            raise ConfigError(f"kvtier connector: vLLM passed {got} for request {state.request.request_id!r}, and the connector serves "
                              f"{want} KV cache group(s): one list per group, in vLLM's group order (the connector and the engine "
                              "disagree on the model's KV cache groups)")
        return block_ids

    def _set_blocks(self, state: _RequestState, block_ids) -> None:
        block_ids = self._per_group(block_ids, state)
        state.block_ids = list(block_ids[self._full_index])
        state.group_blocks = {g.name: list(block_ids[g.index]) for g in self._others}

    def _group_ids(self, state: _RequestState, pages: int) -> dict[str, list[int | None]]:
        """Each other group's block of the first ``pages`` pages, None where vLLM has none (its null block 0)."""
        out = {}
        for name, ids in state.group_blocks.items():
            ids = ids[:pages]
            out[name] = [b or None for b in ids] + [None] * (pages - len(ids))
        return out

    def _live_group_ids(self, state: _RequestState, pages: int) -> dict[str, list[int | None]]:
        """:meth:`_group_ids` less the blocks vLLM may have freed (and given to another request) since they were written:
        a window group's below the window of the tokens it had computed when it last allocated (its
        ``remove_skipped_blocks``: ``processed - window`` tokens skipped), a state group's before the last two pages'
        (its align mode frees the state block of two steps back). A copy out reads a block only while it holds its page."""
        out = self._group_ids(state, pages)
        bs = self.block_size
        for g in self._others:
            if g.kind == "sliding_window":
                cut = max(0, state.processed - g.window) // bs
            elif g.kind == "state":
                cut = max(0, -(-state.processed // bs) - 1)
            else:
                continue
            ids = out[g.name]
            ids[: min(cut, len(ids))] = [None] * min(cut, len(ids))
        return out

    def _plan_async_load(self, state: _RequestState) -> None:
        """A hybrid model's load, whole or nothing: what every group reads at the offered boundary, into
        the request's blocks; every worker reports the request when it is done, or failed."""
        self._extend_keys(state, state.load_end)
        e, first = state.load_end, state.load_start
        self.core.act_for(state.scope)  # (a prefetch from L3 makes its tenant's pages)
        load = self.core.plan_load(state.keys[:e], state.block_ids[:e], first=first, groups=self._group_ids(state, e))
        state.load_pending = False
        req_id = state.request.request_id
        if load.op is None:  # nothing left to copy (gone since the lookup): every worker reports it failed at once
            self._async_failed.append(req_id)
            return
        # a load short of the offered boundary still runs (its plans are out), and is reported failed when it ends
        self._async_loads[load.op] = (req_id, load.loaded >= e)
        state.async_op = load.op
        self._loads.append((load, state.keys[first:e]))

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVTierConnectorMetadata:
        self._steps += 1
        scheduled = scheduler_output.num_scheduled_tokens
        fence = self._fenced(scheduler_output) if self.groups else []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            self._set_blocks(state, new.block_ids)
            state.processed = new.num_computed_tokens
            self._plan(state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after preemption the block table is replaced
                self._set_blocks(state, new_blocks or tuple([] for _ in range(len(self.groups or [0]))))
                state.saved = 0
            elif new_blocks:
                new_blocks = self._per_group(new_blocks, state)
                state.block_ids.extend(new_blocks[self._full_index])
                for g in self._others:
                    state.group_blocks[g.name].extend(new_blocks[g.index])
            state.processed = cached.num_computed_tokens[i]
            self._plan(state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        for req_id, state in list(self._finishing.items()):
            self._offload(state)
            state.finish_steps += 1
            if state.saved >= state.full or (state.finish_steps >= FINISH_STEPS and not self._copies_running(state)):
                del self._finishing[req_id]  # everything planned, or what is left cannot be: report when copied
                self._delayed[req_id] = list(self._copies_running(state))
        unavailable, self._unavailable = self._unavailable, []
        delayed, self._delayed = self._delayed, {}
        preempted = []
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            state = self._requests.get(req_id)
            if state is not None:
                preempted += self._copies_running(state)
                state.batch_step = None  # back in the waiting queue: the next ask starts afresh
        if self._batch:
            self._ask_service()
        async_loads, self._async_loads = self._async_loads, {}
        async_failed, self._async_failed = self._async_failed, []
        region, session = self.leased.attachment() if self.leased else (None, None)
        return KVTierConnectorMetadata(self.port.take_plans() if self.port is not None else [], unavailable, delayed,
                                       preempted + fence, async_loads, async_failed, region, session)

    def _step_ask(self, state: _RequestState, asked: list[PageHash], start: int, request: Request) -> tuple[bool, bool]:
        """With ``service_lookups="step"``: (whether to answer "not yet" and ask the service in this step's batch,
        whether the answer now may ask the service itself). The service may hold what the engine's tree does not:
        it is asked with the rest of the step's requests when the step ends, and vLLM's next ask finds the answer
        in the tree. Not when the tree holds every page asked, vLLM's own cache covers them (``start``) or the
        request skips prefix caches. Asked again when the last batch is stale (the request was preempted, or
        waited :data:`FRESH_STEPS` steps) or the tree lost some of what it left there (its LRU made room) --
        after :data:`MAX_BATCHES` of those, the service is asked for this request alone."""
        run = self.core.shared_ask_from(asked)
        if run is None:  # the tree holds them all, or the service is lost (the lookup forgets its pages)
            return False, True
        if len(asked) <= start or getattr(request, "skip_reading_prefix_cache", False):
            return False, False
        if state.batch_step is None or self._steps - state.batch_step > FRESH_STEPS:
            state.batches = 0
            return True, False
        if run >= state.covered:
            return False, False
        return state.batches < MAX_BATCHES, state.batches >= MAX_BATCHES

    @property
    def _per_step(self) -> bool:
        return self.leased is not None and self.options.service_lookups == "step"

    def _ask_service(self) -> None:
        """The node service asked, in one round trip, about every request of this step that vLLM was told
        to ask again: what it holds after the engine's own pages is in the tree for their next lookup."""
        batch, self._batch = self._batch, []
        live = [s for s in batch if self._requests.get(s.request.request_id) is s]  # (not finished since)
        if not live:
            return
        for state, (adopted, covered) in zip(live, self.core.prefetch_shared([s.keys[: s.asked_pages] for s in live],
                                                                                   [s.scope for s in live])):
            state.prefetched, state.covered, state.batch_step = adopted, covered, self._steps
        self.lookup_batches += 1
        self.batched_requests += len(live)

    def _fenced(self, scheduler_output: SchedulerOutput) -> list[int]:
        """Copies out of window blocks that vLLM freed (they left the window) and allocated again this
        step: each worker finishes them before the step may write those blocks."""
        allocated = self._allocated
        self._allocated = set()
        for new in scheduler_output.scheduled_new_reqs:
            for ids in new.block_ids:
                allocated.update(ids)
        for new_blocks in scheduler_output.scheduled_cached_reqs.new_block_ids:
            for ids in new_blocks or ():
                allocated.update(ids)
        sources = self._sources
        if not sources:
            return []
        for bid in [b for b, ops in sources.items() if not any(self.core.in_flight(op) for op in ops)]:
            del sources[bid]  # those copies are done
        return sorted({op for bid in allocated & sources.keys() for op in sources[bid] if self.core.in_flight(op)})

    def _copies_running(self, state: _RequestState) -> list[int]:
        """The request's copies out of its blocks whose completion has not come back from every rank."""
        if self.core is None:
            return []
        state.copy_ops = [op for op in state.copy_ops if self.core.in_flight(op)]
        return state.copy_ops

    def _plan(self, state: _RequestState, computed_after: int) -> None:
        core = self.core
        if core is None:
            return
        if state.load_pending:  # vLLM computed the first blocks itself: kvtier fills blocks load_start:load_end
            self._extend_keys(state, state.load_end)
            e = state.load_end
            core.act_for(state.scope)
            load = core.plan_load(state.keys[:e], state.block_ids[:e], first=state.load_start)
            if load.loaded < e:  # evicted or gone from the store since the lookup: vLLM recomputes these
                self._unavailable += state.block_ids[max(load.loaded, state.load_start) : e]
            if load.op is not None:
                self._loads.append((load, state.keys[state.load_start : load.loaded]))
            state.load_pending = False
        state.full = min(computed_after // self.block_size, len(state.block_ids))
        self._offload(state)

    def _offload(self, state: _RequestState) -> None:
        """Plan the copy out of the request's full blocks not planned yet. The core hangs new pages only
        below readable ones, so while the copy of the blocks before them is still running this plans
        nothing, and the next step offers them again."""
        full, core = state.full, self.core
        if full > state.saved:
            self._extend_keys(state, full)
            groups = self._live_group_ids(state, full) if self.groups else None
            core.act_for(state.scope)
            result = core.offload(state.keys[:full], state.block_ids[:full], wait=False, groups=groups)
            have, end = result.already_held, result.already_held + result.saved
            # (the copy of the new pages, and of objects beside pages kvtier held without them: vLLM may free a
            # window or state block mid-request and hand it out again before the copy out of it ends)
            for op, first, last in ((result.copy_op, have, end), (result.objects_op, 0, have)):
                if op is None:
                    continue
                self._copies_running(state).append(op)
                for ids in (groups or {}).values():
                    for b in ids[first:last]:
                        if b is not None:
                            self._sources.setdefault(b, set()).add(op)
            if result.saved:
                objects = {name: [b is not None for b in ids[have:end]] for name, ids in groups.items()} if groups else None
                self.events.planned(state.request, have, state.keys[have:end], result.copy_op, result.l3_save_op, objects)
            state.saved = result.already_held + result.saved  # pages not planned now are offered again next step
            if state.hit is not None:
                state.hit.offloaded_pages += result.saved

    def update_connector_output(self, meta: KVTierWorkerMeta | None) -> None:
        if self.core is None:
            return
        if meta is not None:
            self.port.deliver(meta.results)
        self.core.poll()
        self.events.update(self.core)
        pending = []
        for load, keys in self._loads:
            if load.outcome is None:
                pending.append((load, keys))
                continue
            done = completed_pages(load.outcome, len(keys))
            if done < len(keys):
                self.recent_failures.add(keys[done:])
                log.info(
                    "kvtier: %d pages failed to load (%s); not offered again for %.0f s",
                    len(keys) - done,
                    load.outcome.reason,
                    self.recent_failures.ttl_s,
                )
        self._loads = pending

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """(whether vLLM must keep the request's blocks until the workers report it in ``get_finished``,
        what kvtier offered it). Blocks are kept while a copy out of them may still be running."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        params = {"kvtier": asdict(state.hit)} if state.hit is not None else None
        state.processed = request.num_computed_tokens  # (vLLM frees the blocks out of the window before it hands the table over)
        if state.async_op is not None and self.core is not None and self.core.in_flight(state.async_op):
            # aborted while its load runs into its blocks: vLLM frees them when the workers report the load ended
            return True, params
        if self.core is not None and state.saved < state.full:  # blocks not planned yet (a copy before them ran)
            self._finishing[request.request_id] = state
            return True, params
        running = self._copies_running(state)
        if running:
            self._delayed[request.request_id] = list(running)
        return bool(running), params

    def shutdown(self) -> None:
        if self.port is not None:
            self.port.close()
        if self.leased is not None:
            # quiesced only when no copy in flight touches its pages; else the service keeps them until this process exits
            self.leased.close(quiesced=self.core is None or not self.core.plans_in_flight)
