"""The hybrid match (kvtier.core.hybrid_match) against a brute-force oracle.

Hand-made cases where each kind of group is the one that limits the prefix --
a missing window page, a missing snapshot, a missing full page -- then random
presence patterns over windows smaller and larger than a page run."""

from __future__ import annotations

import random

import pytest

from kvtier.core.hybrid_match import usable_prefix, window_pages
from kvtier.groups import KVGroup, StateTensor
from kvtier.spec import KVSpec

P = 4  # tokens per page


def _window(name: str, window: int) -> KVGroup:
    return KVGroup(name, "sliding_window", (1,), attention=KVSpec.mha(name, 1, kv_heads=1, head_dim=8, page_size=P), window=window)


def _state(name: str) -> KVGroup:
    return KVGroup(name, "state", (2,), state=(StateTensor("s", (4,), "float32"),))


def oracle(full: int, groups, present: dict[str, set[int]]):
    """Try every boundary from ``full`` down, spelling out each group's rule; the reason is the first
    group in spec order that rules out boundary ``full``."""
    def ok(g, d):
        if g.kind == "state":
            return d == 0 or d in present[g.name]
        first = max(0, d * P - g.window) // P
        return all(i in present[g.name] for i in range(first, d))

    reason = next((g.name for g in groups if g.kind != "full" and full > 0 and not ok(g, full)), None)
    for d in range(full, -1, -1):
        if all(ok(g, d) for g in groups if g.kind != "full"):
            return d, reason
    raise AssertionError("boundary 0 is always usable")


def run(full, groups, present):
    got = usable_prefix(full, groups, P, {name: s.__contains__ for name, s in present.items()})
    assert (got.pages, got.limited_by) == oracle(full, groups, present)
    return got


def test_window_pages_cover_exactly_the_last_window_tokens():
    g = _window("w", 6)  # 6 tokens: 1.5 pages
    assert window_pages(g, 0, P) == range(0, 0)
    assert window_pages(g, 1, P) == range(0, 1)
    assert window_pages(g, 3, P) == range(1, 3)  # tokens 6..11 live in pages 1 and 2
    assert window_pages(_window("w8", 8), 3, P) == range(1, 3)
    assert window_pages(_window("big", 400), 3, P) == range(0, 3)


def test_a_missing_full_page_limits_the_prefix():
    g = _window("w", 8)
    got = run(3, [g], {"w": {0, 1, 2, 3, 4}})
    assert got.pages == 3 and got.limited_by is None  # the full groups' 3 pages are the limit


def test_a_missing_window_page_limits_the_prefix():
    g = _window("w", 8)  # two pages
    got = run(6, [g], {"w": {0, 1, 2, 3, 5}})  # page 4 is gone: boundaries 5 and 6 read it
    assert got.pages == 4 and got.limited_by == "w"
    got = run(6, [g], {"w": {4, 5}})  # pages before the window may go: boundary 6 still usable
    assert got.pages == 6 and got.limited_by is None


def test_a_missing_snapshot_limits_the_prefix():
    s = _state("ssm")
    got = run(6, [s], {"ssm": {3}})
    assert got.pages == 3 and got.limited_by == "ssm"
    got = run(6, [s], {"ssm": set()})
    assert got.pages == 0 and got.limited_by == "ssm"


def test_window_and_state_together_need_a_boundary_both_allow():
    w, s = _window("w", 4), _state("ssm")
    # snapshots at 2, 4 and 6; window page 5 missing: 6 fails on w, 4 is the answer
    got = run(6, [w, s], {"w": {0, 1, 2, 3, 4}, "ssm": {2, 4, 6}})
    assert got.pages == 4 and got.limited_by == "w"
    got = run(6, [s, w], {"w": {0, 1, 2, 3, 4}, "ssm": {2, 4}})
    assert got.pages == 4 and got.limited_by == "ssm"  # the first group, in spec order, that rules out 6


@pytest.mark.parametrize("seed", range(4))
def test_random_presence_matches_the_oracle(seed):
    rnd = random.Random(seed)
    for _ in range(2000):
        groups = []
        for k in range(rnd.randint(1, 3)):
            groups.append(_state(f"s{k}") if rnd.random() < 0.4 else _window(f"w{k}", rnd.choice([1, 3, 4, 6, 8, 13, 40])))
        full = rnd.randint(0, 12)
        density = rnd.random()
        present = {g.name: {i for i in range(13) if rnd.random() < density} for g in groups}
        run(full, groups, present)
