"""Python calls per request on kvtier's own path: what one request costs the interpreter, not the clock.

``python -m kvtier.app.bench.calls`` serves the same request twice through ``HierarchicalCache`` as ``kvtier run``'s
engine drives it (begin, usable, alloc, wait, commit, served; no model: the request's pages are allocated and
committed as a prefill would), the second time after its pages left the device (a host hit: every page loaded
back), and counts, for the second request only:

* ``calls``: Python function calls in kvtier's library (files under ``kvtier/`` but not ``kvtier/app/``);
* ``file_switches``: consecutive calls in different files (a crossing between modules: what a native path saves);
* ``port_polls``: the executor port's ``poll`` calls (finished copies asked for);
* per file, the calls made there.

A count, not a timing: the same on any machine, so it is a figure a change can be judged by exactly. Prints JSON.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2]) + "/"  # (kvtier/: this file is kvtier/app/bench/calls.py)
APP = ROOT + "app/"


@dataclass
class CallCount:
    scenario: str
    calls: int
    file_switches: int
    port_polls: int
    per_file: dict[str, int] = field(default_factory=dict)


def _count(fn) -> CallCount:
    calls, switches, per_file = 0, 0, Counter()
    last = None

    def profile(frame, event, _arg):
        nonlocal calls, switches, last
        if event != "call":
            return
        name = frame.f_code.co_filename
        if not name.startswith(ROOT) or name.startswith(APP):
            return
        calls += 1
        per_file[name[len(ROOT):]] += 1
        if last is not None and name != last:
            switches += 1
        last = name

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    polls = sum(n for f, n in per_file.items() if f.startswith("executors/"))  # (the port's calls, its poll's trip)
    return CallCount("", calls, switches, polls, dict(per_file.most_common()))


def serve_request(cache, tokens: list[int], ps: int) -> tuple[int, int, int]:
    """One request as ``kvtier run``'s engine serves it, its prefill left out."""
    n = len(tokens)
    req = cache.begin(tokens, usable_pages=(n - 1) // ps)
    usable = req.usable((n - 1) // ps)
    new = req.alloc(-(-n // ps) - usable)
    req.wait()
    req.commit(req.cached_pages[:usable] + new.pages)
    return req.served(usable)


def host_hit(pages: int = 32) -> CallCount:
    """A full-attention request whose every usable page is a host hit (its pages evicted from the device first)."""
    from kvtier.build import build_cache
    from kvtier.config import TierConfig
    from kvtier.spec import KVSpec

    spec = KVSpec.mha("calls", num_layers=2, kv_heads=1, head_dim=16, page_size=16, dtype="float32")
    cache = build_cache(spec, TierConfig(device_pages=4 * pages, host_pages=4 * pages))  # (write-through: the default)
    tokens = list(range(1000, 1000 + pages * spec.page_size + 1))
    try:
        serve_request(cache, tokens, spec.page_size)
        cache.wait_idle()
        cache.evict_device(4 * pages)
        served = []
        count = _count(lambda: served.append(serve_request(cache, tokens, spec.page_size)))
        assert served[0][1] == pages, served  # (every usable page from host)
    finally:
        cache.close()
    count.scenario = f"full attention, {pages}-page host hit"
    return count


def hybrid_host_hit(pages: int = 16) -> CallCount:
    """A hybrid request (MLA+DSA beside sliding-window and linear-attention layers: ``kvtier run --model hybrid``'s
    reference model, small) whose every usable page, window page and snapshot is a host hit, served by
    :class:`~kvtier.app.engine.HybridEngine` -- its model's calls are the application's, not counted."""
    from kvtier.app.engine import HybridEngine
    from kvtier.app.model.hybrid import FULL, HybridReferenceModel
    from kvtier.build import build_hybrid_cache
    from kvtier.config import TierConfig
    from kvtier.app.bench.soak import SOAK_HYBRID

    model, spec = HybridReferenceModel(SOAK_HYBRID), SOAK_HYBRID.model_spec()
    ps = SOAK_HYBRID.base.page_size
    cache = build_hybrid_cache(spec, TierConfig(device_pages=4 * pages, host_pages=4 * pages), state_every=SOAK_HYBRID.state_every)
    engine = HybridEngine(model, cache, {FULL: cache.device, **{n: d for n, (d, _h) in cache.group_pools.items()}})
    tokens = [(7 * i + 3) % SOAK_HYBRID.base.vocab_size for i in range(pages * ps + 1)]
    try:
        engine.prefill(tokens)
        cache.wait_idle()
        cache.evict_device(4 * pages)
        served = []
        count = _count(lambda: served.append(engine.prefill(tokens)))
        assert served[0].host_hit_tokens == pages * ps, served[0]  # (every usable page from host)
    finally:
        cache.close()
    count.scenario = f"hybrid (window and state groups), {pages}-page host hit"
    return count


def bookkeeping(pages: int = 32) -> CallCount:
    """``kvtier bench cache``'s request: keys, match and lock, allocation, insert and unlock on the policy core with an
    executor that moves no bytes -- half the request's pages a device hit (a request before it had them)."""
    from kvtier.alloc import PageAllocator
    from kvtier.config import CacheConfig
    from kvtier.core import CacheCore
    from kvtier.executors.accounting import AccountingExecutor
    from kvtier.spec import KVSpec

    spec = KVSpec.preset("llama-3.1-8b")
    cache = CacheCore(spec, PageAllocator(4 * pages, "device"), PageAllocator(1, "host"), AccountingExecutor(),
                      CacheConfig(write_policy="write_back"))

    def serve(tokens: list[int]) -> None:
        keys = cache.page_keys(tokens)
        req = cache.begin(keys)
        new = req.alloc(len(keys) - req.num_cached)
        req.commit(req.cached_pages + new.pages)

    base = list(range(1000, 1000 + pages * spec.page_size))
    try:
        serve(base[: len(base) // 2])
        count = _count(lambda: serve(base))
    finally:
        cache.close()
    count.scenario = f"bookkeeping (bench cache), {pages} pages, half a device hit"
    return count


def main() -> None:
    print(json.dumps([asdict(host_hit()), asdict(bookkeeping()), asdict(hybrid_host_hit())], indent=1))


if __name__ == "__main__":
    main()
