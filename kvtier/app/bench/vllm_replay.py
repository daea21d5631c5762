"""The same trace replay through vLLM's own prefix cache (``KVCacheManager``), for ``kvtier bench cache``.

Optional: needs the ``vllm`` extra. One request at a time, as in kvtier's replay:
``Request`` (vLLM hashes its full blocks with sha256 here, chained) ->
``get_computed_blocks`` -> ``allocate_slots`` -> ``free``. The pool is sized so
nothing is ever evicted, like kvtier's. vLLM recomputes the last prompt token,
so a prompt that is all cached full blocks hits one block less; on the shipped
trace that changes nothing at four decimals.
"""

from __future__ import annotations

import time
from kvtier.app.bench.peer_result import PeerReplayResult
from kvtier.app.workloads import trace_tokens


def vllm_available() -> bool:
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except Exception:  # not installed, or installed without a usable torch
        return False
    return True


def replay_vllm(requests, block_size: int = 64) -> PeerReplayResult:
    import torch
    import vllm
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    num_blocks = sum(r.input_length // block_size + 1 for r in requests) + 8
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    manager = KVCacheManager(
        config, max_model_len=1 << 22, scheduler_block_size=block_size, hash_block_size=block_size, enable_caching=True
    )
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    params = SamplingParams(max_tokens=1)
    t_hash = t_tree = 0.0
    hit_tokens = 0
    for i, r in enumerate(requests):
        tokens = trace_tokens(r).tolist()  # vLLM takes a list; building it is the workload's cost, not timed
        t0 = time.perf_counter()
        req = Request(str(i), tokens, params, None, block_hasher=hasher)  # hashes the prompt's full blocks
        t1 = time.perf_counter()
        blocks, n_cached, _ = manager.get_computed_blocks(req)
        if manager.allocate_slots(req, len(tokens) - n_cached, n_cached, blocks) is None:
            raise RuntimeError("vLLM replay ran out of blocks; the pool is sized to never evict")
        manager.free(req)
        t2 = time.perf_counter()
        t_hash += t1 - t0
        t_tree += t2 - t1
        hit_tokens += n_cached
    pages = sum(r.input_length // block_size for r in requests)
    return PeerReplayResult(
        version=vllm.__version__,
        hit_ratio=round(hit_tokens / sum(r.input_length for r in requests), 4),
        hash_seconds=round(t_hash, 3),
        tree_seconds=round(t_tree, 3),
        pages_per_s=round(pages / (t_hash + t_tree)),
        tree_pages_per_s=round(pages / t_tree),
    )
