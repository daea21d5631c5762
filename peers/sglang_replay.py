"""The same trace replay through SGLang's own prefix caches, for ``kvtier bench cache``.

SGLang pins a CUDA build of torch, so it is never installed: its wheel
(``pip download --no-deps sglang==0.5.23``) is opened, the sources the radix
caches need are unpacked into the kvtier cache directory once and imported
from there (:mod:`peers.sglang_wheel`, which says which modules are
stand-ins). Three trees, all SGLang's own code:

* ``unified-rust``: SGLang's default prefix cache, ``UnifiedRadixCache`` built
  by SGLang's own ``default_radix_cache_factory``, with its default tree core,
  the Rust ``RustUnifiedTreeCore`` (the extension shipped in the wheel);
* ``unified-python``: the same cache with the Python ``UnifiedTreeCore``
  (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``, SGLang's own switch);
* ``radix``: the legacy ``RadixCache``.

The factory reads the server's published configuration (LMCache, FlexKV, an
external linker, PD retraction to host); outside a server nothing is published,
so the bench publishes those few fields at SGLang's defaults (all off). The
unified tree hands the slots of a prompt's already-cached part back to the
token allocator on insert (SGLang's scheduler passes the whole row); with no
device pool here, :class:`_SlotSink` takes them and only counts (a real
allocator's free costs more, so SGLang's side is, if anything, flattered).
Those two are the stand-ins on this path. The tree core that ran is reported by name
(SGLang falls back to Python when its Rust core cannot load: the report says so).

One request at a time, as in kvtier's replay: ``match_prefix`` ->
``inc_lock_ref`` -> ``insert`` (the page-aligned prompt, with slot values for
the new pages) -> ``dec_lock_ref`` (with the lock's receipt, for the unified
tree). SGLang compares token arrays and hashes nothing, so ``hash_seconds`` is
0 and every second is tree work. The workload's own work is not timed: each
request's ``array('q')`` of token ids, and the slot values of its new pages
(built between the match and the insert, outside the timed spans), as kvtier's
replay does not time building its token array.

Peer replays run with one torch intra-op thread: with two on a loaded 2-core VM,
OpenMP's spin-waiting intermittently slowed SGLang's replays 10-20x.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvtier.app.bench.peer_result import PeerReplayResult
from kvtier.app.bench.timing import one_torch_thread
from peers.sglang_wheel import _STAND_IN_PACKAGES, FACTORY_DEFAULTS, SGLANG_VERSION, find_sglang_wheel, import_sglang, publish_config
from kvtier.app.workloads import trace_tokens

__all__ = ["SGLANG_TREES", "SGLANG_VERSION", "find_sglang_wheel", "load_radix_cache", "replay_sglang"]

#: the SGLang trees ``bench cache`` replays, the default (SGLang's default cache and core) first
SGLANG_TREES = ("unified-rust", "unified-python", "radix")

def load_radix_cache(wheel: Path):
    """SGLang's ``RadixCache`` module and its params classes, imported from the wheel's sources."""
    import_sglang(wheel)
    from sglang.srt.mem_cache import base_prefix_cache, radix_cache

    return radix_cache, base_prefix_cache


class _SlotSink:
    """What the unified tree calls on its token allocator while replaying: frees of duplicate slots."""

    device = "cpu"

    def __init__(self):
        self.freed = 0

    def free_segment(self, indices, start_pos: int = 0) -> None:
        self.freed += len(indices) - start_pos

    free_full_segment = free_segment


def build_sglang_tree(tree: str, page_size: int, wheel: Path):
    """One of :data:`SGLANG_TREES`, empty, built the way SGLang builds it."""
    radix_cache, base = load_radix_cache(wheel)
    if tree == "radix":
        return radix_cache.RadixCache.create_simulated(page_size=page_size)
    if tree not in SGLANG_TREES:
        raise ValueError(f"unknown SGLang tree {tree!r}; one of {', '.join(SGLANG_TREES)}")
    from sglang.srt.mem_cache import registry
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    publish_config(FACTORY_DEFAULTS)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=_SlotSink(), page_size=page_size)
    ctx = registry.TreeCacheBuildContext(server_args=None, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
                                         enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None,
                                         model_config=None, tp_size=1, tp_rank=0, tp_group=None)
    switch = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
    before = os.environ.get(switch)
    os.environ[switch] = tree.removeprefix("unified-")
    try:
        return registry.default_radix_cache_factory(ctx)
    finally:
        if before is None:
            os.environ.pop(switch, None)
        else:
            os.environ[switch] = before


def tree_core_name(cache) -> str:
    """The class that did the tree work: the unified cache's tree core, else the cache itself."""
    core = getattr(cache, "tree_core", None)
    return type(core if core is not None else cache).__name__


def replay_sglang(requests, page_size: int, wheel: Path, tree: str = "unified-rust") -> PeerReplayResult:
    from array import array

    import torch

    radix_cache, base = load_radix_cache(wheel)
    cache = build_sglang_tree(tree, page_size, wheel)
    unified = hasattr(cache, "tree_core")
    t_tree = 0.0
    hit_tokens = next_slot = 0
    with one_torch_thread():
        for r in requests:
            toks = array("q", trace_tokens(r).tobytes())  # not timed: the workload's token array
            full = len(toks) // page_size * page_size
            t0 = time.perf_counter()
            m = cache.match_prefix(base.MatchPrefixParams(key=radix_cache.RadixKey(toks)))
            receipt = cache.inc_lock_ref(m.last_device_node)
            t1 = time.perf_counter()
            have = m.device_prefix_len
            value = torch.arange(next_slot - have, next_slot - have + full, dtype=torch.int64)  # not timed: new pages' slots
            t2 = time.perf_counter()
            cache.insert(base.InsertParams(key=radix_cache.RadixKey(toks[:full]), value=value))
            if unified:
                cache.dec_lock_ref(m.last_device_node, receipt.to_dec_params())
            else:
                cache.dec_lock_ref(m.last_device_node)
            t_tree += (t1 - t0) + (time.perf_counter() - t2)
            next_slot += full - have
            hit_tokens += have
    pages = sum(r.input_length // page_size for r in requests)
    return PeerReplayResult(
        version=SGLANG_VERSION, hit_ratio=round(hit_tokens / sum(r.input_length for r in requests), 4),
        hash_seconds=0.0, tree_seconds=round(t_tree, 3), pages_per_s=round(pages / t_tree), tree_pages_per_s=round(pages / t_tree),
        stand_ins=_STAND_IN_PACKAGES, tree=tree, tree_core=tree_core_name(cache),
    )
