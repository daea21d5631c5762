"""SGLang's default cache stack on CPU with kvtier as its storage backend: what an SGLang server runs.

Built the way SGLang's scheduler builds it (SGLang 0.5.23's own code, imported from its wheel by
:mod:`peers.sglang_wheel`): its device KV pool (``MHATokenToKVPool``, ``MLATokenToKVPool``,
``DSATokenToKVPool`` with the indexer beside the latent, the hybrid ``SWAKVPool``: a sliding-window
layer beside a full one, or the hybrid ``HybridLinearKVPool`` with ``HybridReqToTokenPool``'s
``MambaPool``: a Mamba2-style state layer beside a full MHA or MLA one),
its paged token allocator and ``ReqToTokenPool``, then ``default_radix_cache_factory`` with the
hierarchical cache on. That builds SGLang's default prefix cache, ``UnifiedRadixCache`` with its
Rust tree core, its host pool, and its ``HybridCacheController`` with the controller's own threads,
and attaches kvtier through ``attach_storage_backend`` on the ``dynamic`` path. Requests are then
served through the cache's own calls, as the scheduler makes them: ``match_prefix``, ``insert``
(write-through to host, then the backup thread stores the pages), ``check_hicache_events`` (where
SGLang logs ``get_stats()`` into its own ``StorageMetricsCollector`` with metrics on),
``prefetch_from_storage`` / ``check_prefetch_progress`` and ``init_load_back``.

Replaced, each because this machine has no GPU and no server around the cache:

* **the server's published configuration**: the fields the stack reads (``memory``: the
  ``--hicache-*`` options; ``observability``, ``serving``, ``parallel``, ``exec.mamba``) are
  published into SGLang's own runtime context at SGLang's defaults, with
  ``--hicache-storage-backend dynamic`` and kvtier's extra config; of the server's args only the
  Mamba caching grid is read, pre-seeded through SGLang's own hook (64, FLA's chunk);
* **the process groups**: one gloo group over the ranks on 127.0.0.1, stated to SGLang's parallel
  context, and ``parallel_state.create_custom_parallel_group`` (SGLang's distributed state is a
  server's) as ``new_group`` over the ranks asked for: the controller's all-reduces run over them;
* **page-locking the host pool** (``cudaHostRegister``): nothing -- there is no CUDA;
* **the device <-> host copies** of ``sgl_kernel.kvcacheio`` the ``direct`` I/O backend calls
  (``transfer_kv_direct`` for layer_first host pools; ``transfer_kv_per_layer_direct_pf_lf`` and
  ``transfer_kv_all_layer_direct_lf_pf`` for page_first_direct ones, the only layout SGLang's Mamba
  host pool takes), which SGLang binds only on CUDA, ROCm and XPU: the same copies in torch.

Nothing on the storage path is replaced: SGLang's controller threads call kvtier's
``KvtierStorage`` as on a GPU server. Each stack lives in its own process (SGLang registers
Prometheus metrics and a process group once per process): ``python -m support.sglang_stack`` (from tests/)
runs one scenario and prints what it saw as JSON, for the tests. A storage URL of ``unix:///path``
attaches the stack to the node service on that socket (the extra config's ``service``) instead of
an L3 store. Every exception SGLang logs (its controller threads log what they catch) or a thread
dies of is reported (``errors``).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import threading
import time
from array import array
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import xxhash

from peers.sglang_wheel import FACTORY_DEFAULTS, import_sglang, publish_config
from kvtier.integrations.sglang import extra_config
from kvtier.service.peer import UNIX_SCHEME
from kvtier.service.backoff import RETRY_MAX_S


#: stacks with a Mamba2-style state layer beside their full-attention layer (MHA, or MLA)
MAMBA_KINDS = ("mamba", "mla-mamba")
#: stacks whose KV is MLA's latent (replicated on every TP rank)
MLA_KINDS = ("mla", "dsa", "mla-mamba")


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size: int) -> None:
    """``sgl_kernel.kvcacheio.transfer_kv_direct`` in torch: each layer's token slots from ``src`` to ``dst``."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)]


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id: int, page_size: int) -> None:
    """``sgl_kernel.kvcacheio``'s per-layer load from a ``page_first_direct`` host pool (``[pages, layers, page,
    ...]``) into a layer's device buffer, in torch."""
    host = src_indices.long()
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[dst_indices.long().to(dst.device)] = src[host // page_size, layer_id, host % page_size].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size: int) -> None:
    """``sgl_kernel.kvcacheio``'s backup of every layer (``src_ptrs``: each host buffer's layers in turn) into a
    ``page_first_direct`` host pool, in torch."""
    host = dst_indices.long()
    layers = len(src_ptrs) // len(dst_ptrs)
    for j, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            dst[host // page_size, layer, host % page_size] = src_ptrs[j * layers + layer][src_indices.long()].to(dst.device)


def create_custom_parallel_group(group_ranks, backend: str = "gloo"):
    """SGLang's ``parallel_state.create_custom_parallel_group`` where every rank asks for the same group (the
    controller's storage sync groups over one TP group): ``new_group`` over those ranks, on every rank."""
    import torch.distributed as dist

    return dist.new_group(ranks=sorted(set(group_ranks)), backend=backend)


def _memory_config(storage_url: str, write_policy: str, layout: str = "layer_first", **options) -> dict:
    where = {"service": storage_url} if storage_url.startswith(UNIX_SCHEME) else {"storage_url": storage_url}
    extra = {**extra_config(**where, **options), "prefetch_threshold": 1}
    return dict(FACTORY_DEFAULTS["memory"], hicache_host_memory_mode="cache", hicache_storage_backend="dynamic",
                hicache_storage_backend_extra_config=json.dumps(extra), hicache_ratio=2.0, hicache_size=0,
                hicache_mem_layout=layout, hicache_write_policy=write_policy, hicache_io_backend="direct",
                hicache_storage_prefetch_policy="wait_complete")


def _publish(memory: dict, rank: int, world: int, group) -> None:
    """What a server publishes before it builds its cache: SGLang's own config bags and parallel context."""
    from sglang.srt import runtime_context as rc

    publish_config({
        **FACTORY_DEFAULTS, "memory": memory, "observability": {"extra_metric_labels": None, "stat_loggers": None},
        "serving": {"served_model_name": None}, "model": {},
        "parallel": {"pp_size": 1, "tp_size": world, "dp_size": 1, "attn_cp_size": 1, "dcp_size": 1, "nnodes": 1},
        "exec": {"mamba": {"mamba_max_states_per_path": -1, "mamba_track_interval": 256, "enable_int8_mamba_checkpoint": False}}})
    rc._CONTEXT.parallel._config = rc._CONTEXT._config_bags["parallel"]
    # the server's args, where the stack reads a derived figure from them: the Mamba caching grid (SGLang's own
    # hook for a pre-seeded value, as its test fixtures use; 64 is FLA's chunk, what a model without its own gets)
    rc._CONTEXT._server_args = SimpleNamespace(_mamba_cache_chunk_size=64)
    rc.get_parallel().override_permanently(
        attn_tp_rank=rank, attn_dp_rank=0, attn_tp_size=world, tp_rank=rank, pp_rank=0, attn_cp_rank=0, dcp_enabled=False,
        dcp_rank=0, attn_dcp_rank=0, attn_dcp_size=1, attn_dp_enabled=False, num_dp_ranks=1, dp_rank=0, moe_ep_size=1,
        moe_tp_size=world, moe_ep_rank=0, moe_dp_rank=0, moe_tp_rank=rank, launch_world_rank=rank, launch_world_size=world,
        max_world_size=world, tp_group=group, attn_tp_group=group, pp_group=group, world_group=group, attn_cp_group=group,
        dcp_group=group)


@dataclass
class Stack:
    """One server's cache stack: SGLang's cache, its device pool and allocator, and kvtier's backend in it."""

    cache: object
    device: object
    allocator: object
    kind: str
    page_size: int
    #: the ranks' gloo group: the scheduler's steps (and so the controller's all-reduces) run in lockstep over it
    group: object = None
    rank: int = 0

    @property
    def has_state(self) -> bool:
        return self.kind in MAMBA_KINDS

    @property
    def storage(self):
        return self.cache.cache_controller.storage_backend

    def device_buffers(self) -> list[tuple[torch.Tensor, bool]]:
        """Every device buffer of a page, and whether it is indexed by page (the DSA indexer's) or by token slot."""
        if self.kind == "mha":
            return [(b, False) for b in list(self.device.k_buffer) + list(self.device.v_buffer)]
        if self.kind in ("swa", "mamba"):  # the full-attention layer's pages (the other layer's: window_/state_digest)
            full = self.device.full_kv_pool
            return [(b, False) for b in list(full.k_buffer) + list(full.v_buffer)]
        if self.kind == "mla-mamba":
            return [(b, False) for b in self.device.full_kv_pool.kv_buffer]
        latent = [(b, False) for b in self.device.kv_buffer]
        return latent + [(b, True) for b in self.device.index_k_with_scale_buffer] if self.kind == "dsa" else latent

    def window_buffers(self) -> list[tuple[torch.Tensor, bool]]:
        """The sliding-window layer's buffers (SWA stacks), indexed by its own slots."""
        swa = self.device.swa_kv_pool
        return [(b, False) for b in list(swa.k_buffer) + list(swa.v_buffer)]

    def rows(self, slots: torch.Tensor, by_page: bool) -> torch.Tensor:
        return slots[:: self.page_size] // self.page_size if by_page else slots


def build_stack(storage_url: str, *, kind: str = "mha", page_size: int = 4, layers: int = 2, tokens: int = 256,
                metrics: bool = True, write_policy: str = "write_through", rank: int = 0, world: int = 1, model: str = "tiny",
                **options) -> Stack:
    """SGLang's cache stack for one rank, built by SGLang's own factory (see the module docstring)."""
    import torch.distributed as dist

    import_sglang()
    from sglang.srt.mem_cache import memory_pool, registry
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.pool_host import common, dsa, mamba, mha, mla

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    # SGLang's Mamba host pool is page_first only; the direct copy's layer_first path serves the others
    layout = "page_first_direct" if kind in MAMBA_KINDS else "layer_first"
    _publish(_memory_config(storage_url, write_policy, layout, model_name=model, **options), rank, world, group)
    common._cuda_host_register = lambda buffer, granularity=None: None  # page-locking needs CUDA
    parallel_state = importlib.import_module("sglang.srt.distributed.parallel_state")  # a stand-in module (no server)
    parallel_state.create_custom_parallel_group = create_custom_parallel_group
    for module in (mha, mla, dsa, mamba):  # SGLang binds these on CUDA/ROCm/XPU only
        module.transfer_kv_direct = transfer_kv_direct
        module.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
        module.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf
    if kind == "mha":
        device = memory_pool.MHATokenToKVPool(size=tokens, page_size=page_size, dtype=torch.bfloat16, head_num=2, head_dim=8,
                                              layer_num=layers, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    elif kind == "mla":
        device = memory_pool.MLATokenToKVPool(size=tokens, page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=16,
                                              qk_rope_head_dim=8, layer_num=layers, device="cpu", enable_memory_saver=False)
    elif kind == "dsa":  # MLA latent + the DSA indexer's FP8 keys and fp32 scales beside it
        device = memory_pool.DSATokenToKVPool(size=tokens, page_size=page_size, kv_lora_rank=16, dtype=torch.bfloat16,
                                              qk_rope_head_dim=8, layer_num=layers, device="cpu", index_head_dim=128,
                                              enable_memory_saver=False, kv_cache_dim=24)
    elif kind == "swa":  # sliding-window layers beside full attention (Gemma / gpt-oss style), SGLang's SWA pools
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        device = SWAKVPool(size=tokens, size_swa=tokens, page_size=page_size, dtype=torch.bfloat16, head_num=2, head_dim=8,
                           swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu", enable_alt_stream=False)
    elif kind not in MAMBA_KINDS:
        raise ValueError(f"unknown stack kind {kind!r}: mha, mla, dsa, swa, mamba or mla-mamba")
    if kind in MAMBA_KINDS:  # a Mamba2-style state layer beside a full one: SGLang's hybrid linear pools
        requests = memory_pool.HybridReqToTokenPool(
            size=8, mamba_size=16, mamba_spec_state_size=8, max_context_len=4 * tokens, device="cpu", enable_memory_saver=False,
            cache_params=_mamba_params(), mamba_layer_ids=[0], enable_mamba_extra_buffer=False)
        mla_args = dict(use_mla=True, kv_lora_rank=16, qk_rope_head_dim=8) if kind == "mla-mamba" else {}
        device = memory_pool.HybridLinearKVPool(size=tokens, dtype=torch.bfloat16, page_size=page_size, head_num=2, head_dim=8,
                                                full_attention_layer_ids=[1], device="cpu", mamba_pool=requests.mamba_pool, **mla_args)
    else:
        requests = memory_pool.ReqToTokenPool(size=8, max_context_len=4 * tokens, device="cpu", enable_memory_saver=False)
    if kind == "swa":
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

        allocator = SWATokenToKVPoolAllocator(tokens, tokens, page_size, torch.bfloat16, "cpu", kvcache=device, need_sort=False,
                                              req_to_token_pool=requests)
    else:
        allocator = PagedTokenToKVPoolAllocator(size=tokens, page_size=page_size, dtype=torch.bfloat16, device="cpu", kvcache=device,
                                                need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=requests, token_to_kv_pool_allocator=allocator, page_size=page_size,
                             tp_cache_group=group, enable_metrics=metrics,
                             sliding_window_size=2 * page_size if kind == "swa" else None)
    ctx = registry.TreeCacheBuildContext(
        server_args=SimpleNamespace(file_storage_path=None), params=params, is_hybrid_swa=kind == "swa",
        is_hybrid_ssm=kind in MAMBA_KINDS,
        enable_hierarchical_cache=True, disable_radix_cache=False,
        tp_worker=SimpleNamespace(register_hicache_layer_transfer_counter=lambda counter: None),
        model_config=None, tp_size=world, tp_rank=rank, tp_group=group, is_dsa=kind == "dsa",
        full_tokens_per_layer=tokens if kind == "swa" else None)
    return Stack(registry.default_radix_cache_factory(ctx), device, allocator, kind, page_size, group, rank)


def _mamba_params():
    """A small Mamba2 state: one conv state of 16 channels x 3 and an SSM state of 2 heads x 8 x 4 (fp32)."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape

    shape = Mamba2StateShape(conv=[(16, 3)], temporal=(2, 8, 4), intermediate_size=8, conv_dim=16, ssm_state_size=4, num_heads=2,
                             head_dim=8, state_size=4, conv_kernel=4)
    return Mamba2CacheParams(shape=shape, layers=[0], dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))


def _key(tokens: list[int]):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


def _wait(what: str, done, stack: Stack, timeout: float = 30.0):
    """Poll ``done()`` between the scheduler's ``check_hicache_events`` calls, as its event loop does. Every
    rank takes the same steps (``check_hicache_events`` all-reduces over the ranks), so the ranks agree on
    when to stop: the step after which ``done()`` holds on all of them."""
    import torch.distributed as dist

    steps = max(1, int(timeout / 0.01))
    for _ in range(steps):
        stack.cache.check_hicache_events()
        got = done()
        everywhere = torch.tensor([1 if got else 0])
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=stack.group)
        if everywhere.item():
            return got
        time.sleep(0.01)
    raise TimeoutError(f"SGLang stack: {what} did not happen within {timeout} s")


def _alloc(stack: Stack, n: int) -> torch.Tensor:
    """Slots for a new request of ``n`` tokens, the way the scheduler asks for them (SWA: ``alloc_extend``)."""
    if stack.kind != "swa":
        return stack.allocator.alloc(n)
    zero, full = torch.tensor([0]), torch.tensor([n])
    return stack.allocator.alloc_extend(zero, zero, full, full, torch.tensor([-1]), n)


def serve_computed(stack: Stack, tokens: list[int], seed: int) -> list[str]:
    """A request whose KV was just computed: new slots get seeded bytes, the prompt is inserted (the
    write-through policy copies it to host, then the backup thread stores it). Returns each page's digest."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    slots = _alloc(stack, len(tokens))
    # MLA's latent KV is the same on every TP rank; an MHA rank holds its own heads, so bytes of its own
    g = torch.Generator().manual_seed(seed if stack.kind in MLA_KINDS else seed + 1000 * stack.rank)
    for buf, by_page in stack.device_buffers():
        _fill(buf, stack.rows(slots, by_page), g)
    if stack.kind == "swa":  # the window layer's pool, at the slots SGLang's allocator mapped the request to
        rows = stack.allocator.translate_loc_from_full_to_swa(slots)
        for buf, _ in stack.window_buffers():
            _fill(buf, rows, g)
    others = window_digests(stack, slots)  # before the insert: the tree owns the slots from then on
    state = None
    if stack.has_state:  # the request's recurrent state after its last token, in a slot of SGLang's Mamba pool: per
        state = stack.cache.req_to_token_pool.mamba_allocator.alloc(1)  # rank (sharded by heads), unlike MLA's KV
        g = torch.Generator().manual_seed(1000 * seed + stack.rank)
        for t in _state_tensors(stack):
            _fill(t, (slice(None), state), g)
        others = [state_digest(stack, int(state))]
    stack.cache.insert(InsertParams(key=_key(tokens), value=slots.clone(), mamba_value=state))
    return page_digests(stack, slots) + others


def _fill(buf: torch.Tensor, index, g: torch.Generator) -> None:
    """Seeded random bytes into ``buf[index]``, whatever its dtype."""
    raw = buf.view(torch.uint8)
    raw[index] = torch.randint(0, 256, raw[index].shape, generator=g, dtype=torch.uint8)


def page_digests(stack: Stack, slots: torch.Tensor, buffers=None) -> list[str]:
    """xxh3-128 of each page's device bytes, every layer and buffer (``buffers``: another set, e.g. the window's)."""
    out = []
    for start in range(0, slots.numel(), stack.page_size):
        page = slots[start : start + stack.page_size]
        h = xxhash.xxh3_128()
        for buf, by_page in buffers or stack.device_buffers():
            h.update(buf[stack.rows(page, by_page)].contiguous().view(torch.uint8).numpy().tobytes())
        out.append(h.hexdigest())
    return out


def _state_tensors(stack: Stack) -> list[torch.Tensor]:
    """SGLang's Mamba pool tensors, ``[layers, slots, ...]`` each: the conv states and the SSM state."""
    cache = stack.cache.req_to_token_pool.mamba_pool.mamba_cache
    return [*cache.conv, cache.temporal]


def state_digest(stack: Stack, slot: int) -> str:
    """xxh3-128 of one Mamba state slot, every layer and tensor."""
    h = xxhash.xxh3_128()
    for t in _state_tensors(stack):
        h.update(t[:, slot].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def window_digests(stack: Stack, slots: torch.Tensor) -> list[str]:
    """The sliding-window layer's last window of pages (SWA stacks; else nothing), digested like
    :func:`page_digests`: the window pool's slots are the full slots translated by SGLang's allocator."""
    if stack.kind != "swa":
        return []
    window = stack.cache.sliding_window_size
    tail = stack.allocator.translate_loc_from_full_to_swa(slots[-window:])
    return page_digests(stack, tail, stack.window_buffers())


def wait_stored(stack: Stack, tokens: list[int]) -> list[str]:
    """Wait until SGLang has no write-through or storage backup in flight and the store has every page of
    ``tokens`` (written by this rank, or by the rank that writes this shard); returns SGLang's storage keys
    for them (the tree's own page hashes)."""
    pages = len(tokens) // stack.page_size

    def stored() -> list[str] | None:
        keys = backed_up_keys(stack, tokens)
        return keys if keys is not None and stack.storage.batch_exists(keys) == pages else None

    return _wait(f"{pages} pages stored", stored, stack)


def backed_up_keys(stack: Stack, tokens: list[int]) -> list[str] | None:
    """SGLang's storage keys for ``tokens`` once no write-through or storage backup is in flight (the
    backup's outcome known, stored or not); None while one is."""
    cache = stack.cache
    if cache.ongoing_write_through or cache.ongoing_backup:  # SGLang's own in-flight copies (each holds its node):
        return None  # every group's objects (window pages, state) are acknowledged, not only the KV pages
    node, core = match(stack, tokens).last_device_node, cache.tree_core  # pages are hashed when backed up
    keys = list(core.get_prefix_hash_values(node)) + list(core.get_hash_values(node) or [])
    return keys if len(keys) == len(tokens) // stack.page_size else None


def match(stack: Stack, tokens: list[int]):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    return stack.cache.match_prefix(MatchPrefixParams(key=_key(tokens)))


def evict_everything(stack: Stack) -> None:
    """Device and host both emptied of unlocked pages, as memory pressure would."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
    stack.cache.evict_host(stack.allocator.size * 4)


def prefetch_and_load(stack: Stack, tokens: list[int], rid: str) -> tuple[int, int, list[str]]:
    """The scheduler's path for a request whose prefix is in storage only: prefetch into host, then load
    back to device. Returns (tokens prefetched, tokens on device after, the device pages' digests)."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, InitLoadBackParams

    m = match(stack, tokens)
    handle = CacheRequestHandle(rid=rid, attempt_id=0)
    have = m.device_prefix_len + m.host_hit_length
    stack.cache.prefetch_from_storage(handle, m.last_host_node, array("q", tokens[have:]), None, None,
                                      matched_prefix_tokens=array("q", tokens[:have]))
    _wait("the prefetch", lambda: stack.cache.check_prefetch_progress(handle), stack)
    prefetched, _start = stack.cache.pop_prefetch_loaded_span(handle)
    m = match(stack, tokens)
    # the request's own slots, as the scheduler's Req holds them (a Mamba load back copies the state into its slot)
    req = SimpleNamespace(rid=rid, last_node=m.last_device_node, swa_host_hit_length=0, mamba_host_hit_length=0,
                          kv=SimpleNamespace(mamba_pool_idx=None, holds_mamba=False))
    if m.host_hit_length:
        req.last_node = m.last_device_node
        stack.cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=req))
        stack.cache.ready_to_load_host_cache()
        m = _wait("the load back", lambda: (lambda r: r if r.device_prefix_len >= m.device_prefix_len + m.host_hit_length else None)(
            match(stack, tokens)), stack)
    slots = stack.cache.path_device_indices(m.last_device_node)
    other = window_digests(stack, slots)
    if stack.has_state:  # the state at the prefix's end, in the request's slot (where the load back put it)
        other = [] if req.kv.mamba_pool_idx is None else [state_digest(stack, int(req.kv.mamba_pool_idx))]
    return prefetched, m.device_prefix_len, page_digests(stack, slots) + other


def storage_metric_samples(name: str) -> float:
    """The sum of a Prometheus histogram SGLang's ``StorageMetricsCollector`` filled (e.g. ``sglang:backup_pgs``)."""
    from prometheus_client import REGISTRY

    return sum(s.value for metric in REGISTRY.collect() if metric.name == name for s in metric.samples if s.name == name + "_sum")


class _Errors(logging.Handler):
    """Every exception logged (SGLang's controller threads log what they catch with ``logger.exception``)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.seen.append(f"{record.name}: {record.getMessage()}: {record.exc_info[1]!r}")


def watch_errors() -> list[str]:
    """The exceptions logged, and those a thread died of, from now on (a list that fills as they happen)."""
    handler = _Errors()
    logging.getLogger().addHandler(handler)
    previous = threading.excepthook

    def died(args) -> None:
        handler.seen.append(f"thread {args.thread.name if args.thread else '?'} died: {args.exc_value!r}")
        previous(args)

    threading.excepthook = died
    return handler.seen


def say(facts: dict) -> None:
    """One JSON line to the test driving this server step by step."""
    print(json.dumps(facts), flush=True)


def outage(stack: Stack, tokens: list[int], report: dict) -> None:
    """The node service SIGKILLed under a serving stack, then restarted; the test says when, one stdin line each.
    While it is down: a prefetch and a backup (misses, no exception, bounded time); once it is back: ``tokens``
    computed, stored, evicted and prefetched back as in the ``write`` scenario."""
    early, later = ([base + i for i in range(len(tokens))] for base in (3000, 5000))
    serve_computed(stack, early, seed=3)
    wait_stored(stack, early)
    say({"stored": len(early) // stack.page_size})
    sys.stdin.readline()  # the service was SIGKILLed
    start, written_before = time.monotonic(), stack.storage.get_stats().pages_written
    evict_everything(stack)
    report["down_prefetched"], report["down_on_device"], _ = prefetch_and_load(stack, early, "down")
    serve_computed(stack, later, seed=5)
    _wait("the backup's outcome", lambda: backed_up_keys(stack, later), stack)
    stats = stack.storage.get_stats()
    report.update(down_s=time.monotonic() - start, down_written=stats.pages_written - written_before, down_faults=stats.faults)
    say({"down": True})
    sys.stdin.readline()  # a new service listens on the socket
    time.sleep(RETRY_MAX_S)  # (past every SGLang thread's backoff: its next call attempts to attach)
    report["written"] = serve_computed(stack, tokens, seed=7)
    report["keys"] = wait_stored(stack, tokens)
    evict_everything(stack)
    report["prefetched"], report["on_device"], report["reloaded"] = prefetch_and_load(stack, tokens, "back")
    report["reattaches"] = stack.storage.service.reattaches


def run_scenario(name: str, storage_url: str, rank: int = 0, world: int = 1, kind: str = "mha") -> dict:
    """One server's part of a test, reported as JSON-able facts (digests, counts, the classes that ran)."""
    errors = watch_errors()
    # SGLang's DSA pools take 64-token pages only, its Mamba tree component 1-token pages (without its extra buffer)
    page_size = {"dsa": 64, "mamba": 1, "mla-mamba": 1}.get(kind, 4)
    stack = build_stack(storage_url, kind=kind, rank=rank, world=world, page_size=page_size, tokens=max(64 * page_size, 256))
    cache = stack.cache
    report = {"cache": type(cache).__name__, "tree_core": type(cache.tree_core).__name__,
              "controller": type(cache.cache_controller).__name__, "storage": type(stack.storage).__name__,
              "storage_metrics_on": bool(cache.enable_storage_metrics and cache.storage_metrics_collector is not None)}
    tokens = list(range(1000, 1000 + max(8 * stack.page_size, 32)))  # 8 pages, or 32 one-token pages
    if name == "write":  # compute, store, evict everything, and bring it back from storage in the same server
        report["written"] = serve_computed(stack, tokens, seed=7)
        report["keys"] = wait_stored(stack, tokens)
        evict_everything(stack)
        m = match(stack, tokens)
        report["after_evict"] = [m.device_prefix_len, m.host_hit_length]
        report["prefetched"], report["on_device"], report["reloaded"] = prefetch_and_load(stack, tokens, "again")
    elif name == "read":  # a fresh server: the prefix is in storage only
        report["prefetched"], report["on_device"], report["reloaded"] = prefetch_and_load(stack, tokens, "fresh")
    elif name == "read-when-told":  # a server already up (attached) when another stores the prefix; a stdin line says when
        say({"ready": True})
        sys.stdin.readline()
        report["prefetched"], report["on_device"], report["reloaded"] = prefetch_and_load(stack, tokens, "told")
    elif name == "outage":
        outage(stack, tokens, report)
    else:
        raise ValueError(f"unknown scenario {name!r}")
    cache.check_hicache_events()
    stats = stack.storage.get_stats()
    report.update(pages_written=stats.pages_written, pages_read=stats.pages_read, corrupt=stats.corrupt,
                  stats_class=[c.__module__ + "." + c.__name__ for c in type(stats).__mro__[1:2]],
                  backup_pgs_logged=storage_metric_samples("sglang:backup_pgs"),
                  prefetch_pgs_logged=storage_metric_samples("sglang:prefetch_pgs"), faults=stats.faults, errors=errors)
    return report


def main(argv: list[str]) -> None:
    name, url, *rest = argv
    rank, world, kind = (int(rest[0]), int(rest[1]), rest[2]) if rest else (0, 1, "mha")
    import torch.distributed as dist

    report = run_scenario(name, url, rank, world, kind)
    dist.barrier()  # no rank leaves while another is still in a collective
    print(json.dumps(report), flush=True)
    os._exit(0)  # SGLang's controller threads and atexit hooks are not ours to wait for


if __name__ == "__main__":
    main(sys.argv[1:])
