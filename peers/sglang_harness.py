"""SGLang's own classes on CPU, for the HiCache storage backend's tests and ``kvtier bench sglang``.

Everything is SGLang 0.5.23's code, imported from its wheel (peers.sglang_wheel):
the host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``, ``DSAIndexerPoolHost``),
``HiCacheStorageConfig``, ``StorageBackendFactory`` and the ``HiCacheController``'s storage
methods (``_page_backup``, ``_page_transfer``, ``_page_get_zero_copy`` / ``_page_set_zero_copy``,
``_generic_page_get`` / ``_generic_page_set``). Replaced, because they need a GPU or a whole server:

* the device KV buffers the host pools mirror: plain CPU tensors with their pointer tables
  (SGLang builds them on the GPU); the DSA indexer's device pool is a namespace with the
  attributes the host pool reads (its index buffers, layer range, format);
* ``pin_memory=False`` (pinning needs CUDA);
* the controller is made without its ``__init__`` (which starts threads and torch.distributed
  groups); the attributes its storage methods read are set as ``attach_storage_backend`` sets them.
"""

from __future__ import annotations

import hashlib
from queue import Queue
from types import SimpleNamespace

import torch

from peers.sglang_wheel import import_sglang
from kvtier.integrations.sglang import extra_config

import_sglang()

from sglang.srt.managers import cache_controller as cc  # noqa: E402
from sglang.srt.mem_cache import device_pool_info as dpi  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.pool_host import dsa, mha, mla  # noqa: E402
from sglang.srt.mem_cache.pool_host.host_pool_decl import HostPoolDecl, HostPoolStorageInfo  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

CPU = torch.device("cpu")


def _ptrs(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(layout: str = "page_first", *, layers: int = 2, heads: int = 2, head_dim: int = 8, page_size: int = 4,
             device_tokens: int = 64, ratio: float = 2.0, dtype=torch.bfloat16):
    k = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    bufs = dpi.KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=dpi.KVBufferLayout.NHD)
    info = dpi.MHABufferInfo(buffers=bufs, page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
                             dtype=dtype, device=CPU)
    pool = mha.MHATokenToKVPoolHost(info, ratio, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers)
    pool._device_keepalive = (k, v)
    return pool


def mla_pool(layout: str = "page_first", *, layers: int = 2, kv_lora_rank: int = 16, rope_dim: int = 8, page_size: int = 4,
             device_tokens: int = 64, ratio: float = 2.0, dtype=torch.bfloat16):
    dim = kv_lora_rank + rope_dim
    c = tuple(torch.zeros(device_tokens, 1, dim, dtype=dtype) for _ in range(layers))
    info = dpi.MLABufferInfo(buffers=c, data_ptrs=_ptrs(c), layer_indices=tuple(range(layers)), device_layer_num=layers,
                             page_size=page_size, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim, kv_cache_dim=dim,
                             dtype=dtype, device=CPU)
    pool = mla.MLATokenToKVPoolHost(info, ratio, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers, target_layer_num=layers)
    pool._device_keepalive = c
    return pool


def dsa_indexer_pool(anchor, *, index_head_dim: int = 16, quant_block: int = 16):
    """SGLang's DSA indexer host pool riding on ``anchor`` (an MLA host pool): FP8 keys + fp32 scales per token."""
    per_token = dsa.dsa_indexer_bytes_per_token_per_layer(index_head_dim=index_head_dim, quant_block_size=quant_block)
    layers, page = anchor.layer_num, anchor.page_size
    device = SimpleNamespace(  # the GPU-side DSATokenToKVPool: only what the host pool reads
        store_dtype=torch.uint8, start_layer=0, end_layer=layers, layer_num=layers, device="cpu", layer_shard_enabled=False,
        index_k_with_scale_buffer=[torch.zeros(64, page * per_token, dtype=torch.uint8) for _ in range(layers)],
        skip_topk_layers=[False] * layers, index_head_dim=index_head_dim, quant_block_size=quant_block,
        page_size=page, index_page_size=page)
    decl = HostPoolDecl(pool_name=PoolName.INDEXER, device_pool=device, indices_from_pool=PoolName.KV, layout_source=PoolName.KV,
                        storage_info=HostPoolStorageInfo(bytes_per_token_per_layer=per_token, dtype=torch.uint8),
                        host_pool_builder=dsa.DSAIndexerHostPoolBuilder())
    return dsa.DSAIndexerPoolHost(decl, anchor, pin_memory=False, device="cpu")


def fill(pool, seed: int) -> None:
    """Random bytes in every page of the pool's buffer(s)."""
    g = torch.Generator().manual_seed(seed)
    for buf in pool.get_hybrid_pool_buffer() if hasattr(pool, "index_k_with_scale_buffer") else [pool.kv_buffer]:
        raw = buf.view(torch.uint8) if buf.dtype != torch.uint8 else buf
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def page_bytes(pool, slot: int) -> bytes:
    """One page's bytes as SGLang's own file backend would store them (its flat data page)."""
    return pool.get_data_page(int(slot), flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def page_keys(tokens: list[int], page_size: int, salt: str = "") -> list[str]:
    """Chained per-page SHA-256 hex keys, as SGLang's storage hash makes them (its native extension needs a compiler)."""
    keys, prior = [], salt.encode()
    for i in range(0, len(tokens) // page_size * page_size, page_size):
        prior = hashlib.sha256(prior + str(tokens[i:i + page_size]).encode()).digest()
        keys.append(prior.hex())
    return keys


def storage_config(url: str, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, model: str = "tiny",
                   page_first: bool = True, metrics: bool = True, **options) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=page_first,
                                model_name=model, extra_config=extra_config(url, **options))


def attach(config: HiCacheStorageConfig, pool, *sidecars):
    """kvtier built by SGLang's own factory on the dynamic path, pools registered as the controller does."""
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    for name, side in sidecars:
        backend.register_mem_host_pool_v2(side, name)
    backend.on_host_pools_registered()
    return backend


def controller(backend, pool, *, zero_copy: bool = True):
    """SGLang's HiCacheController with the attributes its storage path reads (as attach_storage_backend sets them)."""
    c = object.__new__(cc.HiCacheController)
    c.storage_backend = backend
    c.mem_pool_host = c.storage_host_pool = pool
    c.page_size = pool.page_size
    c.prefetch_sync_queue = Queue()
    c.page_get_func = c._page_get_zero_copy if zero_copy else c._generic_page_get
    c.page_set_func = c._page_set_zero_copy if zero_copy else c._generic_page_set
    return c


def backup(ctrl, keys: list[str], host_indices: torch.Tensor, sidecars=()) -> int:
    """Host -> storage as SGLang does: sidecar pools first through ``batch_set_v2`` (the hybrid controller's
    ``_page_backup``), then the KV pages through the controller's own ``_page_backup``. Returns backed-up tokens."""
    if sidecars:
        ctrl.storage_backend.batch_set_v2([PoolTransfer(name=n, host_indices=host_indices, keys=keys) for n in sidecars])
    op = cc.StorageOperation(host_indices, [], hash_value=list(keys))
    ctrl._page_backup(op)
    return op.completed_tokens


def prefetch(ctrl, keys: list[str], host_indices: torch.Tensor, sidecars=()) -> int:
    """Storage -> host as SGLang does: ``batch_exists`` for the hit, then the controller's own ``_page_transfer``
    (KV through ``page_get_func``, KV-derived sidecars through ``batch_get_v2``). Returns loaded pages."""
    hit = ctrl.storage_backend.batch_exists(keys)
    op = cc.PrefetchOperation("req", [])
    op.hash_value = keys[:hit]
    op.host_indices = host_indices[: hit * ctrl.page_size]
    op.pool_transfers = [PoolTransfer(name=n, indices_from_pool=PoolName.KV) for n in sidecars]
    return ctrl._page_transfer(op)


def sglang_mooncake_store(config: HiCacheStorageConfig, pool, *, rpc_port: int, http_port: int):
    """SGLang's own Mooncake backend (``MooncakeStore``) on a local master, contributing no memory of its
    own (the storage node holds the pages, as for kvtier's Mooncake client). Replaced: SGLang's
    distributed state, which has no shared transfer engine outside a server (SGLang then makes its own)."""
    import dataclasses
    import importlib

    parallel_state = importlib.import_module("sglang.srt.distributed.parallel_state")

    def no_shared_engine():
        raise RuntimeError("no SGLang distributed state outside a server")

    parallel_state.get_mooncake_transfer_engine = no_shared_engine
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    extra = {"master_server_address": f"127.0.0.1:{rpc_port}", "metadata_server": f"http://127.0.0.1:{http_port}/metadata",
             "protocol": "tcp", "global_segment_size": 0, "check_server": False, "device_name": "", "local_hostname": "127.0.0.1"}
    store = MooncakeStore(dataclasses.replace(config, extra_config=extra), pool)
    store.register_mem_pool_host(pool)
    return store
