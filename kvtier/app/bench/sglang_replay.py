"""The same trace replay through SGLang's own prefix cache (``RadixCache``), for ``kvtier bench cache``.

SGLang pins a CUDA build of torch, so it is never installed: its wheel
(``pip download --no-deps sglang==0.5.23``) is opened, the sources the radix
cache needs (``sglang/srt``'s top-level modules, ``mem_cache``, ``utils`` and
the few packages they import at module level) are unpacked into the kvtier
cache directory once, and ``sglang.srt.mem_cache.radix_cache`` is imported from
there (:mod:`kvtier.app.sglang_wheel`, which says which modules are stand-ins).
The tree code that runs -- ``RadixKey``, ``match_prefix``, ``insert``,
``inc_lock_ref``/``dec_lock_ref``, node splitting, LRU bookkeeping -- is
SGLang's own.

One request at a time, as in kvtier's replay: ``match_prefix`` ->
``inc_lock_ref`` -> ``insert`` (the page-aligned prompt, with slot values for
the new pages) -> ``dec_lock_ref``. SGLang compares token arrays and hashes
nothing, so ``hash_seconds`` is 0 and every second is tree work. Building each
request's ``array('q')`` of token ids is the workload's cost and is not timed
(kvtier's replay does not time building its token array either).
"""

from __future__ import annotations

import time
from pathlib import Path

from kvtier.app.bench.peer_result import PeerReplayResult
from kvtier.app.sglang_wheel import _STAND_IN_PACKAGES, SGLANG_VERSION, find_sglang_wheel, import_sglang
from kvtier.app.workloads import trace_tokens

__all__ = ["SGLANG_VERSION", "find_sglang_wheel", "load_radix_cache", "replay_sglang"]


def load_radix_cache(wheel: Path):
    """SGLang's ``RadixCache`` module and its params classes, imported from the wheel's sources."""
    import_sglang(wheel)
    from sglang.srt.mem_cache import base_prefix_cache, radix_cache

    return radix_cache, base_prefix_cache



def replay_sglang(requests, page_size: int, wheel: Path) -> PeerReplayResult:
    from array import array

    import torch

    radix_cache, base = load_radix_cache(wheel)
    tree = radix_cache.RadixCache.create_simulated(page_size=page_size)
    t_tree = 0.0
    hit_tokens = next_slot = 0
    for r in requests:
        toks = array("q", trace_tokens(r).tobytes())  # not timed: the workload's token array
        full = len(toks) // page_size * page_size
        t0 = time.perf_counter()
        key = radix_cache.RadixKey(toks)
        m = tree.match_prefix(base.MatchPrefixParams(key=key))
        tree.inc_lock_ref(m.last_device_node)
        have = m.device_prefix_len
        value = torch.arange(next_slot - have, next_slot - have + full, dtype=torch.int64)  # new pages' slots after the hit
        tree.insert(base.InsertParams(key=radix_cache.RadixKey(toks[:full]), value=value))
        tree.dec_lock_ref(m.last_device_node)
        t_tree += time.perf_counter() - t0
        next_slot += full - have
        hit_tokens += have
    pages = sum(r.input_length // page_size for r in requests)
    return PeerReplayResult(
        version=SGLANG_VERSION, hit_ratio=round(hit_tokens / sum(r.input_length for r in requests), 4),
        hash_seconds=0.0, tree_seconds=round(t_tree, 3), pages_per_s=round(pages / t_tree), tree_pages_per_s=round(pages / t_tree),
        stand_ins=_STAND_IN_PACKAGES,
    )
