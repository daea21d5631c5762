"""The policy core with a hybrid model's KV groups, case by case.

Hand-made prefixes where each group is the one that limits a match (a missing
window page, a missing snapshot, a missing full page), checked against the
brute-force rule; loads back that move only what the boundary reads; misuse
of the group arguments that must be a typed error changing nothing; and what
the core refuses at construction."""

from __future__ import annotations

import pytest

from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import CacheCore, Tier
from kvtier.errors import ConfigError, KVTierError, PageOwnershipError, UnknownNameError
from kvtier.executors.accounting import AccountingExecutor
from kvtier.groups import ModelSpec
from support.hybrid_core import commit_all, make
from support.hybrid_models import PAGE, hybrid_model
from support.hybrid_rules import read_places

TOKENS = list(range(8 * PAGE))


def drop_object(core: CacheCore, name: str, place: int, tokens: list[int] = TOKENS) -> None:
    """Take one object off the device, as its pool's pressure would."""
    node = core.tree.nodes[core.page_keys(tokens)[place]]
    c = core.component(name)
    c.alloc[Tier.DEVICE].free([c.at[Tier.DEVICE].pop(node)])


def brute_force(model: ModelSpec, full: int, present: dict[str, set[int]]) -> int:
    for d in range(full, -1, -1):
        ok = True
        for g in model.groups:
            if g.kind != "full":
                ok &= all(i in present[g.name] for i in read_places(g, d, PAGE))
        if ok:
            return d
    raise AssertionError


def present(core: CacheCore, tokens: list[int] = TOKENS) -> dict[str, set[int]]:
    keys = core.page_keys(tokens)
    return {c.name: {i for i, k in enumerate(keys) if core.tree.nodes.get(k) in c.at[Tier.DEVICE]} for c in core.components}


def test_a_missing_window_page_limits_the_match():
    core, model, _ = make(6, False)  # a page and a half: boundary d reads tokens 4d-6 .. 4d-1, pages d-2 and d-1
    commit_all(core, TOKENS)
    drop_object(core, "swa", 6)  # read by boundaries 7 and 8
    m = core.match(TOKENS)
    assert m.limited_by == "swa" and m.num_device_pages == 6 == brute_force(model, 8, present(core))
    drop_object(core, "swa", 1)  # outside the window of boundary 6: nothing changes
    assert core.match(TOKENS).num_device_pages == 6


def test_a_missing_snapshot_limits_the_match_to_the_last_one_kept():
    core, model, _ = make(None, True, every=3)
    req = commit_all(core, TOKENS)
    assert req.state.value == "committed"
    assert core.snapshot_boundaries(0, 8) == [3, 6, 8]
    m = core.match(TOKENS)
    assert m.num_device_pages == 8 and m.limited_by is None
    drop_object(core, "ssm", 7)  # the snapshot at boundary 8
    m = core.match(TOKENS)
    assert m.limited_by == "ssm" and m.num_device_pages == 6 == brute_force(model, 8, present(core))
    assert core.match(TOKENS[: 5 * PAGE]).num_device_pages == 3  # a shorter prompt stops at the snapshot before it


def test_a_missing_full_page_limits_the_match_whatever_the_groups_hold():
    core, model, _ = make(6, True)
    commit_all(core, TOKENS[: 4 * PAGE])
    m = core.match(TOKENS)
    assert m.num_device_pages == 4 and m.limited_by is None  # the full groups' pages end at 4


def test_window_and_state_together_stop_where_both_allow():
    core, model, _ = make(6, True, every=2)
    commit_all(core, TOKENS)
    drop_object(core, "swa", 6)  # boundaries 7 and 8 read page 6
    m = core.match(TOKENS)
    assert m.num_device_pages == 6 == brute_force(model, 8, present(core)) and m.limited_by == "swa"


def test_a_load_back_moves_only_the_window_and_the_snapshot_it_needs():
    core, model, port = make(6, True, every=2)
    commit_all(core, TOKENS)
    core.evict_device(8)  # write_back: every page (and every object it holds) is backed up, then dropped
    assert core.dev_alloc.num_used == 0 and all(not c.at[Tier.DEVICE] for c in core.components)
    assert all(len(c.at[Tier.HOST]) == len(present_places) for c, present_places in
               zip(core.components, (range(8), [1, 3, 5, 7])))
    port.plans.clear()
    req = core.begin(TOKENS)
    assert req.num_cached == 8 and req.served(8) == (0, 8, 0)
    (load,) = port.plans
    assert load.src is Tier.HOST and load.dst is Tier.DEVICE and load.num_pages == 8
    runs = {g.group: g.at for g in load.groups}
    assert runs == {"swa": (6, 7), "ssm": (7,)}  # the window of boundary 8, the snapshot at 8: nothing else
    assert {name: sorted(objs) for name, objs in req.groups.items()} == {"swa": [6, 7], "ssm": [7]}
    req.wait()
    req.commit(req.cached_pages, {})
    core.check_integrity(idle=True)


def test_a_request_that_uses_fewer_pages_stops_where_its_objects_allow():
    core, _, _ = make(6, True, every=2)
    commit_all(core, TOKENS)
    req = core.begin(TOKENS)
    assert req.num_cached == 8
    assert req.usable(7) == 0  # it holds the snapshot at 8 only: no shorter prefix is usable with what it was given
    req.abort()


def test_group_misuse_is_a_typed_error_and_changes_nothing():
    core, _, _ = make(6, True)
    commit_all(core, TOKENS[: 2 * PAGE])
    req = core.begin(TOKENS[: 4 * PAGE])
    new = req.alloc(2)
    mine = req.alloc_group("swa", 2)
    foreign = core.alloc_group("swa", 1)  # the caller's, not this request's
    given = req.groups["swa"]
    before = (sorted(core.component("swa").at[Tier.DEVICE].values()), core.component("swa").alloc[Tier.DEVICE].num_free)
    cases = {
        "unknown group": ({"nope": [None] * 4}, UnknownNameError),
        "wrong length": ({"swa": [None] * 3}, PageOwnershipError),
        "not the request's": ({"swa": [None, None, foreign[0], None]}, PageOwnershipError),
        "listed twice": ({"swa": [None, None, mine[0], mine[0]]}, PageOwnershipError),
        "given id at another place": ({"swa": [given[1], None, None, None]}, PageOwnershipError),
    }
    for what, (groups, error) in cases.items():
        with pytest.raises(error):
            req.commit(req.cached_pages + new.pages, groups)
        assert req.state.value == "open", what
        assert (sorted(core.component("swa").at[Tier.DEVICE].values()), core.component("swa").alloc[Tier.DEVICE].num_free) == before, what
    with pytest.raises(KVTierError):
        core.insert(TOKENS[: 2 * PAGE], core.alloc_device(2).pages, {"swa": [foreign[0], foreign[0]]})
    req.commit(req.cached_pages + new.pages, {"swa": [None, given[1], mine[0], mine[1]]})  # a given id at its place is fine
    core.free_group("swa", foreign)


def test_what_the_core_refuses_at_construction():
    model, full = hybrid_model(6, True)
    pools = {"swa": (PageAllocator(4), PageAllocator(4)), "ssm": (PageAllocator(4), PageAllocator(4))}

    def build(**kw):
        args = dict(model=model, group_pools=pools)
        args.update(kw)
        port = args.pop("port", AccountingExecutor())
        return CacheCore(args.pop("spec", full), PageAllocator(4), PageAllocator(4), port, CacheConfig(),
                         StorageConfig(url="memory://") if port.has_storage else StorageConfig(), **args)

    with pytest.raises(ConfigError, match="has no pools"):
        build(group_pools={"swa": pools["swa"]})
    with pytest.raises(ConfigError, match="not groups of"):
        build(group_pools={**pools, "extra": pools["swa"]})
    with pytest.raises(ConfigError, match="state_every"):
        build(state_every=0)
    with pytest.raises(ConfigError, match="pages of"):
        build(spec=full.with_(page_size=PAGE * 2))


def test_an_executor_with_one_specs_pools_refuses_group_plans_and_moves_no_byte():
    from kvtier.core import Failed, Reason
    from kvtier.core.plans import GroupRun, copy_plan
    from kvtier.executors.local import LocalExecutor
    from kvtier.pools import DevicePool, HostPool
    from kvtier.transfer.engine import TransferEngine
    from support.pools import fill_random

    _, full = hybrid_model(6, False)
    device, host = DevicePool(full, 4), HostPool(full, 4)
    fill_random(device, seed=1)
    fill_random(host, seed=2)
    before = host.page_bytes(1)
    ex = LocalExecutor(TransferEngine(host, device))
    try:
        ex.submit(copy_plan(3, Tier.DEVICE, [0], Tier.HOST, [1], 0, (GroupRun("swa", (0,), (0,), (1,)),)))
        (done,) = ex.wait([3])
        assert type(done) is Failed and done.reason is Reason.INVALID and "swa" in done.detail and "own pools" in done.detail
        assert host.page_bytes(1) == before
    finally:
        ex.close()


def test_a_full_attention_model_keeps_its_fingerprint_and_keys():
    _, full = hybrid_model(None, False)
    core = CacheCore(full, PageAllocator(4), PageAllocator(4), AccountingExecutor(), model=ModelSpec.of(full))
    plain = CacheCore(full, PageAllocator(4), PageAllocator(4), AccountingExecutor())
    assert core.page_keys(TOKENS) == plain.page_keys(TOKENS) and not core.components
