"""``KVTierConnector``: a vLLM v1 KV connector backed by kvtier's host and storage tiers.

vLLM's own GPU prefix cache is the device tier; kvtier adds host memory (L2)
and a storage tier (L3: file, Redis, Mooncake) below it, shared across engine
restarts and instances through L3.

Scheduler side (one call per request, in vLLM's scheduler):
  ``get_num_new_matched_tokens`` hashes the prompt's full blocks into kvtier page
  keys and asks the cache how many leading pages it holds (host, then L3). The
  last prompt token is always computed, so at most ``(len - 1) // block_size``
  blocks are offered. ``build_connector_meta`` turns the step into page runs:
  loads into the blocks vLLM just allocated, and saves of blocks that became
  full this step. Only full blocks ever get a key, so a partial tail block is
  recomputed and never stored.

Worker side (in the model runner):
  ``start_load_kv`` starts every load (L3 -> host first, then host -> vLLM's
  blocks on kvtier's transfer worker, one layer at a time);
  ``wait_for_layer_load(layer)`` waits for that layer only, so attention of
  layer ``i`` overlaps the copy of layer ``i + 1``. ``wait_for_save`` backs the
  step's full blocks up to host (all layers, one job) and writes them through
  to L3 in the background. Pages that could not be loaded are reported through
  ``get_block_ids_with_load_errors`` and vLLM recomputes them (set
  ``kv_load_failure_policy="recompute"``).

Both roles must share one process (vLLM's UniProc executor, tensor_parallel_size
1): the scheduler side looks pages up in the worker's cache through
:func:`cache_for`. Anything else fails at startup with a ConfigError.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from kvtier.build import open_storage_tier
from kvtier.errors import ConfigError
from kvtier.hashing import Namespace, PageHash, hasher, page_keys
from kvtier.integrations.vllm.layout import ModelShape, map_kv_caches
from kvtier.integrations.vllm.options import ConnectorOptions
from kvtier.l3.base import redact_url
from kvtier.offload import OffloadCache, OffloadLoad
from kvtier.pools import HostPool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: engine_id -> the worker's cache (scheduler and worker of one engine share a process)
_CACHES: dict[str, tuple[OffloadCache, Namespace, ConnectorOptions]] = {}


def cache_for(engine_id: str) -> OffloadCache | None:
    """The kvtier cache of a live engine in this process (for stats, tests and draining)."""
    entry = _CACHES.get(engine_id)
    return entry[0] if entry else None


def live_caches() -> dict[str, OffloadCache]:
    return {k: v[0] for k, v in _CACHES.items()}


@dataclass
class PageRun:
    """Whole pages of one request: keys and the vLLM block holding each."""

    req_id: str
    keys: list[PageHash]
    block_ids: list[int]


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    loads: list[PageRun] = field(default_factory=list)
    saves: list[PageRun] = field(default_factory=list)


@dataclass
class _RequestState:
    keys: list[PageHash]
    block_ids: list[int] = field(default_factory=list)
    #: leading pages already handed to a save (or known held)
    saved: int = 0
    #: pages [load_start, load_end) to load when the request is scheduled
    load_start: int = 0
    load_end: int = 0
    load_pending: bool = False


@dataclass
class HitRecord:
    """What the scheduler side offered one request (for reports and tests)."""

    req_id: str
    prompt_tokens: int
    local_tokens: int
    external_tokens: int
    host_pages: int
    storage_pages: int


def _model_shape(vllm_config: VllmConfig, name: str) -> ModelShape:
    mc = vllm_config.model_config
    hf = mc.hf_text_config
    use_mla = bool(getattr(mc, "use_mla", False))
    return ModelShape(
        name=name,
        block_size=vllm_config.cache_config.block_size,
        kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        head_size=mc.get_head_size(),
        use_mla=use_mla,
        kv_lora_rank=getattr(hf, "kv_lora_rank", 0) if use_mla else 0,
        qk_rope_dim=getattr(hf, "qk_rope_head_dim", 0) if use_mla else 0,
    )


class KVTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.options = ConnectorOptions.from_extra_config(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        self.engine_id = self._kv_transfer_config.engine_id or "default"
        self.block_size = vllm_config.cache_config.block_size
        self.tp_rank = vllm_config.parallel_config.rank
        model = vllm_config.model_config.model
        self.model_name = self.options.model_name or os.path.basename(str(model).rstrip("/")) or str(model)
        self._model_shape = _model_shape(vllm_config, self.model_name)
        # worker side
        self._cache: OffloadCache | None = None
        self._layer_index: dict[str, int] = {}
        self._loads: list[tuple[OffloadLoad, PageRun]] = []
        self._failed_blocks: set[int] = set()
        # scheduler side
        self._requests: dict[str, _RequestState] = {}
        #: the latest lookups (bounded: a server runs for weeks)
        self.hits: deque[HitRecord] = deque(maxlen=1024)
        if role == KVConnectorRole.SCHEDULER:
            if vllm_config.parallel_config.world_size != 1:
                raise ConfigError("kvtier connector: tensor/pipeline parallel size must be 1 (scheduler and worker share one kvtier cache in one process)")
            if self.engine_id not in _CACHES:
                raise ConfigError(
                    "kvtier connector: the scheduler found no kvtier cache for this engine; the worker must run in the "
                    "scheduler's process (UniProc executor, tensor_parallel_size=1)"
                )
            self._cache, self._namespace, _ = _CACHES[self.engine_id]
            self._root = self._namespace.root(self.options.cache.hash_algo)
            self._hash = hasher(self.options.cache.hash_algo)

    # ==== worker side ===================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        spec, device, self._layer_index = map_kv_caches(kv_caches, self._model_shape)
        host = HostPool(spec, self.options.tiers.host_pages_for(spec.page_bytes), self.options.tiers.host_layout)
        namespace = Namespace(self.model_name, spec.fingerprint(), self.tp_rank, self.options.salt)
        storage = open_storage_tier(self.options.storage, host, namespace)
        self._cache = OffloadCache(device, host, storage, self.options.storage, io_backend=self.options.cache.io_backend)
        _CACHES[self.engine_id] = (self._cache, namespace, self.options)
        log.info("kvtier connector: %s, %d host pages (%s), L3 %s", spec.name, host.num_pages, host.layout.kind, redact_url(self.options.storage.url) or "off")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        for run in meta.loads:
            ld = self._cache.load(run.keys, run.block_ids)
            if ld.loaded < len(run.keys):
                log.info("kvtier: request %s: %d of %d pages unavailable, recomputed", run.req_id, len(run.keys) - ld.loaded, len(run.keys))
                self._failed_blocks.update(run.block_ids[ld.loaded :])
            self._loads.append((ld, run))

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for ld, run in self._loads:
            try:
                ld.wait_layer(layer)
            except Exception as e:  # a failed copy: every block of this load is recomputed
                log.warning("kvtier: load for request %s failed: %s", run.req_id, e)
                self._failed_blocks.update(run.block_ids)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Nothing per layer: a page's layers are backed up together in :meth:`wait_for_save` (one job)."""

    def wait_for_save(self) -> None:
        for ld, _ in self._loads:
            self._cache.release(ld)
        self._loads.clear()
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        for run in meta.saves:
            self._cache.save(run.keys, run.block_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER and self._cache is not None:
            self._cache.close()
            _CACHES.pop(self.engine_id, None)

    # ==== scheduler side ================================================================
    def _keys(self, request: Request) -> list[PageHash] | None:
        if request.mm_features or getattr(request, "prompt_embeds", None) is not None:
            return None  # tokens alone do not determine the KV
        root = self._root
        extra = "|".join(x for x in (getattr(request, "cache_salt", None) or "", request.lora_request.lora_name if request.lora_request else "") if x)
        if extra:
            root = PageHash(self._hash(root + extra.encode()))
        return page_keys(request.prompt_token_ids or [], self.block_size, root, self.options.cache.hash_algo)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        keys = self._keys(request)
        if keys is None:
            return 0, False
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(keys)
        bs = self.block_size
        usable = min(len(keys), (request.num_prompt_tokens - 1) // bs)
        start = num_computed_tokens // bs
        found = self._cache.lookup(keys[:usable])
        state.load_start, state.load_end, state.load_pending = start, max(start, found.pages), False
        external = (state.load_end - start) * bs
        self.hits.append(HitRecord(request.request_id, request.num_prompt_tokens, num_computed_tokens, external, found.host_pages, found.storage_pages))
        return external, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if num_external_tokens > 0:
            state.load_end = state.load_start + num_external_tokens // self.block_size
            state.load_pending = True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVTierConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._plan(meta, new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after preemption the block table is replaced
                state.block_ids = list(new_blocks[0]) if new_blocks else []
                state.saved = 0
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            self._plan(meta, req_id, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan(self, meta: KVTierConnectorMetadata, req_id: str, state: _RequestState, computed_after: int) -> None:
        if state.load_pending:
            s, e = state.load_start, state.load_end
            meta.loads.append(PageRun(req_id, state.keys[s:e], state.block_ids[s:e]))
            state.load_pending = False
        full = min(len(state.keys), computed_after // self.block_size, len(state.block_ids))
        if full > state.saved:
            meta.saves.append(PageRun(req_id, state.keys[state.saved : full], state.block_ids[state.saved : full]))
            state.saved = full

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None
