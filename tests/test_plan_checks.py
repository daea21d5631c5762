"""A plan is checked as a whole before any byte moves: a destination two of its runs would write --
the page run and a window run in the pools they share, or two runs of one KV group -- completes the
plan ``Failed(INVALID)`` with nothing moved, in this process and across a pipe. (Each group's
copies run on their own engine thread, so which copy landed last was a race.) The same holds where
a caller names the destinations itself: an engine's load into its own blocks and SGLang's
``batch_get_v2`` refuse two sources read into one destination."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import StorageConfig
from kvtier.core.plans import Done, Failed, GroupRun, Reason, Tier, copy_plan, fetch_plan, save_plan
from kvtier.errors import PageOwnershipError
from kvtier.executors.pipe import PipeExecutor, WorkerSpec
from kvtier.hashing import Namespace
from support.hybrid_models import GPT_LIKE, SPEC
from support.pools import fill_random

MODES = ("one process", "two processes")
DEV, HOST = 8, 8


# ---- next to the bytes (this process, or the worker) -------------------------------------------------
def _pools(executor) -> dict:
    """gpt-like's pools: the full pages' (its window group's too) and its state group's own."""
    ssm = executor.groups["ssm"]
    return {"device": executor.engine.device, "host": executor.engine.host, "ssm device": ssm.device, "ssm host": ssm.host}


def _fill(executor) -> None:
    for seed, pool in enumerate(_pools(executor).values()):
        fill_random(pool, seed)


def _pages(executor) -> dict:
    """Every page of every pool, by (pool, page id)."""
    return {(name, p): pool.page_bytes(p) for name, pool in _pools(executor).items() for p in range(pool.num_pages)}


def _jobs_left(executor) -> tuple[int, int, int]:
    """Plans the executor still tracks: its jobs, group parts and plans waiting on their group objects."""
    return len(executor._jobs), len(executor._parts), len(executor._main_done)


@pytest.fixture(params=MODES)
def executor(request, tmp_path):
    """gpt-like's executor (its window group in the full pages' pools: ``shared_groups``), built here or
    in a worker process, every page of every pool holding distinct random bytes."""
    worker = WorkerSpec(SPEC, DEV, HOST, storage=StorageConfig(url=f"file://{tmp_path}"),
                        namespace=Namespace("gpt-like", GPT_LIKE.fingerprint()), model=GPT_LIKE, group_pages={"ssm": (DEV, HOST)},
                        shared_groups=("swa",))
    ex = worker.build() if request.param == "one process" else PipeExecutor(worker)
    ex.run(_fill)
    yield ex
    ex.close()


def run(executor, plan):
    executor.submit(plan)
    (c,) = executor.wait([plan.op])
    return c


KEYS = [bytes([i]) * 16 for i in range(3)]

#: (plan, what its refusal names)
COLLIDING = {
    "a shared-pool window run writes the page run's own host page": (
        copy_plan(1, Tier.DEVICE, [0, 1], Tier.HOST, [4, 5], groups=(GroupRun("swa", (1,), (2,), (5,)),)),
        "plan 1: host id 5 of the full pages' host pool is written twice, by the plan's pages and by KV group 'swa' (run 0)"),
    "two runs of one group onto one destination id": (
        copy_plan(2, Tier.DEVICE, [0], Tier.HOST, [4], groups=(GroupRun("ssm", (0,), (0,), (3,)), GroupRun("ssm", (0,), (1,), (3,)))),
        "plan 2: host id 3 of KV group 'ssm''s host pool is written twice, by KV group 'ssm' (run 0) and by KV group 'ssm' (run 1)"),
    "a window run and the page run write one device page on a load": (
        copy_plan(3, Tier.HOST, [4, 5], Tier.DEVICE, [2, 3], groups=(GroupRun("swa", (1,), (6,), (2,)),)),
        "plan 3: device id 2 of the full pages' device pool is written twice, by the plan's pages and by KV group 'swa' (run 0)"),
    "a fetch's window object into the page run's own host page": (
        fetch_plan(4, KEYS[:2], [4, 5], groups=(GroupRun("swa", (1,), (), (4,), (KEYS[2],)),)),
        "plan 4: host id 4 of the full pages' host pool is written twice, by the plan's pages and by KV group 'swa' (run 0)"),
}


def check_valid_shared_plans(executor, op: int) -> None:
    """Pages 0, 1 with the window object in device page 2 (a different id than every page) out to host
    pages 4, 5 and 6, then back into device pages 6, 7 and 3: both complete Done, bit-exact, and write
    nothing else."""
    before = executor.run(_pages)
    out = copy_plan(op, Tier.DEVICE, [0, 1], Tier.HOST, [4, 5], groups=(GroupRun("swa", (1,), (2,), (6,)),))
    back = copy_plan(op + 1, Tier.HOST, [4, 5], Tier.DEVICE, [6, 7], groups=(GroupRun("swa", (1,), (6,), (3,)),))
    assert [run(executor, out), run(executor, back)] == [Done(op), Done(op + 1)]
    after = executor.run(_pages)
    moved = {("host", 4): ("device", 0), ("host", 5): ("device", 1), ("host", 6): ("device", 2),
             ("device", 6): ("device", 0), ("device", 7): ("device", 1), ("device", 3): ("device", 2)}
    assert {dst: after[dst] for dst in moved} == {dst: before[src] for dst, src in moved.items()}
    assert {k for k in after if after[k] != before[k]} == set(moved)


@pytest.mark.parametrize("case", list(COLLIDING))
def test_a_plan_writing_one_destination_twice_fails_invalid_and_moves_nothing(executor, case):
    plan, why = COLLIDING[case]
    if plan.src is Tier.STORAGE:  # what it fetches is stored (the pages from host pages 0, 1, the window object from 2)
        assert run(executor, save_plan(90, KEYS[:2], [0, 1], groups=(GroupRun("swa", (1,), (2,), (), (KEYS[2],)),))) == Done(90)
    before = executor.run(_pages)
    c = run(executor, plan)
    assert type(c) is Failed and c.reason is Reason.INVALID and c.op == plan.op, c
    assert c.detail.startswith(why), c.detail
    assert executor.run(_pages) == before  # not a byte moved
    assert executor.run(_jobs_left) == (0, 0, 0) and executor.poll() == []
    check_valid_shared_plans(executor, 10)  # and later plans run


def test_a_valid_shared_pool_plan_completes_bit_exact(executor):
    check_valid_shared_plans(executor, 1)
    # objects of the state group (its own pools) beside the pages: any id, the pages' ones included
    assert run(executor, copy_plan(3, Tier.DEVICE, [0], Tier.HOST, [4], groups=(GroupRun("ssm", (0,), (4,), (4,)),))) == Done(3)


# ---- callers that name the destinations themselves ----------------------------------------------------
def test_an_engine_load_naming_one_block_for_two_pages_is_refused_before_any_byte_moves():
    """The engine copy path (full attention): two pages loaded into one engine block."""
    from support.offload import engine_tensors, keys, make

    tensors = engine_tensors(seed=4)
    cache = make(tensors)
    k = keys(3)
    assert cache.save(k, [0, 1, 2]).saved == 3
    before = [t.clone() for t in tensors]
    used, stats = cache.num_host_pages_used, cache.core.stats.as_dict()
    with pytest.raises(PageOwnershipError, match=r"load: engine block 7 is named for two pages"):
        cache.load(k, [5, 7, 7])
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(before, tensors))  # not a byte moved
    assert (cache.num_host_pages_used, cache.core.stats.as_dict(), cache.stats.loaded_from_host) == (used, stats, 0)
    cache.core.check_integrity(idle=True)  # no host page left locked
    ld = cache.load(k, [5, 7, 8])
    cache.release(ld)
    assert (ld.loaded, ld.ok) == (3, True)
    assert all(torch.equal(t[d].view(torch.int16), t[s].view(torch.int16)) for t in tensors for s, d in ((0, 5), (1, 7), (2, 8)))
    cache.close()


@pytest.mark.parametrize("call", ["load_into", "plan_load"])
def test_an_engine_load_naming_one_id_for_two_objects_of_a_group_is_refused(call):
    """The engine copy path of a hybrid model: the engine names each group's ids itself; one id named for
    two window objects (or one block for two pages) is refused before the core changes anything."""
    from support.engine_device_hybrid import build, check_loaded, computed, keys_of, on_worker
    from support.hybrid_bytes import _garbage

    core = build("one process")
    try:
        k = keys_of(core, 6)
        blocks, groups = computed(core, k, 0)
        r = core.offload(k, blocks, wait=False, groups=groups)
        core.wait_for([r.copy_op])
        core.wait_idle()
        on_worker(core, _garbage)
        load = getattr(core, call)
        dst = list(range(10, 16))
        state = {"ssm": [None] * 5 + [15]}
        stats = core.stats.as_dict()
        with pytest.raises(PageOwnershipError, match=r"load, KV group 'swa': engine id 14 is named for two objects"):
            load(k, dst, groups={"swa": [None] * 4 + [14, 14], **state})
        with pytest.raises(PageOwnershipError, match=r"load: engine block 12 is named for two pages"):
            load(k, [10, 11, 12, 12, 14, 15], groups={"swa": [None] * 4 + [14, 15], **state})
        assert core.stats.as_dict() == stats
        core.check_integrity(idle=True)  # nothing locked or held
        assert core.component("swa").stats()["loaded"] == 0
        want = {"swa": [None] * 4 + [14, 15], **state}
        got = load(k, dst, groups=want)
        core.wait_for([got.op])
        assert got.ok and got.loaded == 6
        check_loaded(core, k, got, 0, dst, want)
        if call == "load_into":
            core.release(got)
        core.wait_idle()
        core.check_integrity(idle=True)
    finally:
        core.close()


def test_sglang_batch_get_v2_refuses_two_keys_read_into_one_mamba_slot(tmp_path):
    """Two sources into one destination in one request (SGLang's ``batch_get_v2`` into one Mamba slot):
    refused with a typed error before any byte moves, as the backend refuses every malformed transfer
    (SGLang's hybrid controller logs it and takes no hit from the call)."""
    from support.sglang_helpers import PoolName, PoolTransfer, _mamba_pool, attach, mha_pool, page_keys, storage_config

    url = f"file://{tmp_path / 'l3'}"
    src = _mamba_pool(seed=41)
    keys = page_keys(list(range(12)), 4)
    writer = attach(storage_config(url), mha_pool(), (PoolName.MAMBA, src))
    assert writer.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3, 7, 11]), keys=keys)]) == {
        PoolName.MAMBA: [True] * 3}
    dst = _mamba_pool()
    backend = attach(storage_config(url), mha_pool(), (PoolName.MAMBA, dst))
    one_slot = [PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0, 5, 5]), keys=keys)]
    across = [PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([5]), keys=keys[:1]),
              PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([5]), keys=keys[1:2])]
    for transfers in (one_slot, across):
        with pytest.raises(PageOwnershipError, match=r"batch_get_v2: host page 5 of SGLang host pool 'mamba' is the destination of two"):
            backend.batch_get_v2(transfers)
    assert all(not dst.get_data_page(i).any() for i in range(dst.size))  # not a byte moved
    assert backend.get_stats().pages_read == 0
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0, 5, 6]), keys=keys)])
    assert got == {PoolName.MAMBA: [True] * 3}
    assert all(torch.equal(dst.get_data_page(d), src.get_data_page(s)) for s, d in ((3, 0), (7, 5), (11, 6)))
