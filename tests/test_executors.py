"""Executors at their edges: a worker that dies or cannot start is a typed error, never a hang (a
killed worker's plans fail and are counted, and the cache refuses further work); a message the
worker was not asked for, or a completion for an op the core never planned, never shifts an answer;
a plan that names a partial page cannot be built, and a malformed plan that reaches an executor
completes ``Failed(INVALID)`` with no byte moved."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvtier.config import StorageConfig
from kvtier.core.plans import Tier, Transfer, copy_plan, fetch_plan
from kvtier.errors import ExecutorError, PageAlignmentError
from kvtier.executors.pipe import PipeExecutor, WorkerSpec
from support.cache_helpers import MODES, make_cache, on_worker, serve, tokens
from support.pools import tiny_specs


def spec():
    return tiny_specs(page_size=4, num_layers=2)["mla"]


def test_a_killed_worker_is_an_executor_error_and_close_returns():
    port = PipeExecutor(WorkerSpec(spec(), 4, 4), deadline_s=5.0)
    assert port.poll() == []
    os.kill(port.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(ExecutorError, match=f"executor process {port.pid}"):
        port.stored_prefix([b"k" * 16])
    with pytest.raises(ExecutorError):
        port.submit(copy_plan(1, Tier.DEVICE, [0], Tier.HOST, [0]))
        port.wait([1])
    port.close()
    assert time.monotonic() - t0 < 15, "a dead worker must be noticed, not waited for"


def test_a_worker_that_cannot_start_says_why():
    with pytest.raises(ExecutorError, match="unknown-scheme|scheme"):
        PipeExecutor(WorkerSpec(spec(), 4, 4, storage=StorageConfig(url="unknown-scheme://x")))


def test_a_plan_the_worker_refuses_comes_back_failed_not_raised():
    port = PipeExecutor(WorkerSpec(spec(), 4, 4))
    try:
        port.submit(copy_plan(7, Tier.HOST, [0], Tier.DEVICE, [99]))  # no device page 99 in the worker's pool
        done = port.wait([7])
        assert [type(c).__name__ for c in done] == ["Failed"] and done[0].op == 7 and "99" in done[0].detail
    finally:
        port.close()


def test_plans_name_whole_pages_on_every_side():
    with pytest.raises(PageAlignmentError, match="names 1 host pages for 2 pages"):
        Transfer(1, Tier.DEVICE, Tier.HOST, (0, 1), (5,))
    with pytest.raises(PageAlignmentError):
        fetch_plan(2, [b"a" * 16, b"b" * 16], [3])


def _wedge(executor, seconds):
    time.sleep(seconds)


def test_a_wedged_worker_is_stopped_at_the_deadline_and_the_port_stays_broken():
    port = PipeExecutor(WorkerSpec(spec(), 4, 4), wait_deadline_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(ExecutorError, match="no answer to run within 1 s"):
        port.run(_wedge, 30)
    assert time.monotonic() - t0 < 10
    with pytest.raises(ExecutorError, match="broken"):  # never reads the wedged call's late answer as its own
        port.poll()
    port.close()
    assert not port._proc.is_alive()


def _local_with_store():
    from kvtier.executors.local import LocalExecutor
    from kvtier.hashing import Namespace
    from kvtier.l3 import open_backend
    from kvtier.l3.tier import StorageTier
    from kvtier.pools import DevicePool, HostPool
    from kvtier.transfer.engine import TransferEngine
    from support.pools import fill_random

    s = spec()
    device, host = DevicePool(s, 8), HostPool(s, 8)
    fill_random(device, seed=3)
    tier = StorageTier(open_backend("memory://"), host, Namespace("m", s.fingerprint()))
    return LocalExecutor(TransferEngine(host, device), tier), device, host


def test_a_copy_that_follows_a_fetch_takes_only_what_arrived():
    """Plans that follow plans (``Transfer.after``): the copy out of fetched host pages is cut at the first
    page the fetch did not deliver, and a save behind a failed copy never runs."""
    from kvtier.core.plans import CutShort, Done, Failed, Reason, save_plan
    from kvtier.executors.chain import ChainedExecutor
    from support.pools import device_page

    inner, device, host = _local_with_store()
    ex = ChainedExecutor(inner)
    keys = [bytes([i]) * 16 for i in range(3)]
    ex.submit(copy_plan(1, Tier.DEVICE, [0, 1, 2], Tier.HOST, [0, 1, 2]))
    ex.submit(save_plan(2, keys[:2], [0, 1], after=1))  # only two of the three pages go to the store
    assert {type(c) for c in ex.wait([1, 2])} == {Done}
    # fetch all three keys into host pages 5..7 (the third is missing), copy 5..7 into device pages 3..5
    ex.submit(fetch_plan(3, keys, [5, 6, 7]))
    ex.submit(copy_plan(4, Tier.HOST, [5, 6, 7], Tier.DEVICE, [3, 4, 5], after=3))
    ex.wait_layer(4, 0)  # waits for the fetch first, then for layer 0 of the (cut) copy
    got = {c.op: c for c in ex.wait([3, 4])}
    assert got[3] == CutShort(3, 2, Reason.MISS) and got[4] == CutShort(4, 2, Reason.MISS)
    assert [device_page(device, p) for p in (3, 4)] == [device_page(device, p) for p in (0, 1)]
    # a save behind a copy that failed is skipped, not run on bytes that never landed
    ex.submit(copy_plan(5, Tier.DEVICE, [0], Tier.HOST, [99]))  # host page 99 does not exist
    ex.submit(save_plan(6, [b"x" * 16], [99], after=5))
    got = {c.op: c for c in ex.wait([5, 6])}
    assert type(got[5]) is Failed and got[6] == Failed(6, Reason.SKIPPED, "plan 5 it follows did not complete")
    assert ex.poll() == []  # every completion came back once
    ex.close()


def _check_declared(ports: dict) -> None:
    """Each port carries every member :class:`ExecutorPort` declares, attributes typed."""
    from typing import get_type_hints

    from kvtier.core import ExecutorPort

    attributes = get_type_hints(ExecutorPort)
    methods = [m for m in vars(ExecutorPort) if not m.startswith("_") and callable(getattr(ExecutorPort, m))]
    assert set(attributes) == {"has_storage", "can_wait"} and "submit" in methods and "settle" in methods
    for name, port in ports.items():
        for attr in attributes:
            assert type(getattr(port, attr)) is bool, f"{name} port: {attr}"
        for m in methods:
            assert callable(getattr(port, m, None)), f"{name} port lacks {m}"


def test_every_port_declares_what_the_core_reads():
    """The core reads every member :class:`ExecutorPort` declares, attributes included (``can_wait``
    decides whether eviction may wait on L3 saves): each port kvtier ships must carry them all, typed,
    rather than be probed for them."""
    from kvtier.executors.accounting import AccountingExecutor, AccountingStore
    from kvtier.executors.chain import ChainedExecutor

    local, _, _ = _local_with_store()
    pipe = PipeExecutor(WorkerSpec(spec(), 4, 4))
    ports = {"accounting": AccountingExecutor(AccountingStore()), "local": local, "chained": ChainedExecutor(local), "pipe": pipe}
    try:
        _check_declared(ports)
        assert [p.can_wait for p in ports.values()] == [True, True, True, True]
    finally:
        pipe.close()


def test_the_vllm_scheduler_port_declares_what_the_core_reads_and_never_waits():
    """The vLLM scheduler's port (it imports vLLM's connector base classes: the vllm extra)."""
    pytest.importorskip("vllm", reason="the vLLM connector's port needs the vllm extra (pip install -e '.[vllm]')")
    from kvtier.integrations.vllm.scheduler_port import SchedulerPort

    port = SchedulerPort(1, None)
    _check_declared({"scheduler": port})
    assert port.can_wait is False


def test_settle_counts_a_fetch_whose_pages_arrived_before_its_group_objects():
    """A fetch's pages landed (and were polled) while its group objects were still arriving: settling it
    waits for the objects and counts every page that arrived with its objects -- it answered 0 before
    (the pages' job had left the table settle reads), and the core then gave the whole prefetch up (a
    restarted hybrid cache intermittently served no L3 hit under load)."""
    import threading

    from kvtier.core.plans import Done, GroupRun, fetch_plan, save_plan
    from kvtier.executors.local import LocalExecutor
    from kvtier.hashing import Namespace, group_object_key
    from kvtier.l3.memory import MemoryBackend
    from kvtier.l3.tier import StorageTier
    from kvtier.pools import DevicePool, HostPool
    from kvtier.transfer.engine import TransferEngine
    from support.pools import fill_random

    s = spec()
    host, whost = HostPool(s, 8), HostPool(s, 8)
    fill_random(host, seed=5)
    fill_random(whost, seed=6)
    store = MemoryBackend()
    gate = threading.Event()
    keys = (b"k" * 16, b"l" * 16)
    objects = tuple(group_object_key(k, "w") for k in keys)
    plain_get = store.get

    def get(names, outs):  # the group objects' reads wait for the gate
        if any(n.endswith(objects[0].hex()) for n in names):
            gate.wait(10)
        return plain_get(names, outs)

    ns = Namespace("m", s.fingerprint())
    ex = LocalExecutor(TransferEngine(host, DevicePool(s, 8)), StorageTier(store, host, ns),
                       groups={"w": TransferEngine(whost, DevicePool(s, 8))},
                       group_storage={"w": StorageTier(store, whost, ns, owns_backend=False)})
    try:
        ex.submit(save_plan(1, keys, (0, 1), groups=(GroupRun("w", (0, 1), (0, 1), (), objects),)))
        assert ex.wait([1]) == [Done(1)]
        store.get = get
        ex.submit(fetch_plan(2, keys, (2, 3), groups=(GroupRun("w", (0, 1), (), (2, 3), objects),)))
        for _ in range(500):  # the race's precondition: the pages' job finished and was polled, the objects' not
            assert ex.poll() == []
            if 2 in ex._main_done:
                break
            time.sleep(0.01)
        assert 2 in ex._main_done
        threading.Timer(0.2, gate.set).start()
        assert ex.settle(2, "wait_complete", 5.0) == 2
        assert ex.wait([2]) == [Done(2)]
        assert bytes(host.page_bytes(2)) == bytes(host.page_bytes(0)) and bytes(whost.page_bytes(3)) == bytes(whost.page_bytes(1))
    finally:
        gate.set()
        ex.close()


# ---- a completion for an op the core never planned -----------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_completion_for_an_unknown_op_is_ignored_and_the_rest_of_the_batch_applied(mode):
    from kvtier.core.plans import Done, Failed, Reason

    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    cache = make_cache(spec, dev_pages=8, host_pages=8, write_policy="write_through", mode=mode)
    port = cache.port
    real_poll, real_wait = port.poll, port.wait
    strays = [Done(10**6), Failed(10**6 + 1, Reason.ERROR, "never planned"), "not a completion"]

    def poll_with_strays():
        got = real_poll()
        return [strays.pop(0), *got] if strays else got

    def wait_with_strays(ops):
        got = real_wait(ops)
        return [strays.pop(0), *got] if strays else got

    port.poll, port.wait = poll_with_strays, wait_with_strays
    for i in range(3):
        serve(cache, tokens(100 * i, 8))  # write-through backups: completions arrive beside the strays
    cache.wait_idle()  # returns: before the fix a KeyError dropped the batch and this spun for ever
    assert not strays and cache.stats.unknown_completions == 3
    cache.check_integrity(idle=True)
    assert cache.stats.backed_up_pages == 6  # every real completion of those batches was applied
    cache.close()


# ---- every plan an executor receives is checked before any byte moves ----------------------------
def _host_snapshot(executor) -> list[bytes]:
    return [executor.engine.host.page_bytes(p) for p in range(executor.engine.host.num_pages)]


def _stored(executor, keys) -> int:
    return sum(executor.storage.stored_prefix([k]) for k in keys)


def _malformed_plans(keys):
    import dataclasses

    from kvtier.core.plans import GroupRun, Tier, Transfer, copy_plan, fetch_plan, save_plan

    def forged(**fields):  # what an unpickled plan can hold: __post_init__ never ran
        t = object.__new__(Transfer)
        base = dict(op=fields.pop("op", 90), src=Tier.HOST, dst=Tier.DEVICE, src_pages=(0,), dst_pages=(1,), keys=(), after=0, groups=(),
                    owners=())
        for f in dataclasses.fields(Transfer):
            object.__setattr__(t, f.name, fields.get(f.name, base[f.name]))
        return t

    return {
        "fetch into host page -2": fetch_plan(71, keys[:1], [-2]),
        "save from host page -3": save_plan(72, keys[1:2], [-3]),
        "save from host page 99 of 8": save_plan(73, keys[2:3], [99]),
        "copy to device page 8 of 8": copy_plan(74, Tier.HOST, [0], Tier.DEVICE, [8]),
        "float host page": forged(op=75, src_pages=(0.5,)),
        "bool device page": forged(op=76, dst_pages=(True,)),
        "two pages into one": copy_plan(77, Tier.HOST, [0, 1], Tier.DEVICE, [3, 3]),
        "sides of different lengths": forged(op=78, src_pages=(0, 1), dst_pages=(2,)),
        "key that is a str": forged(op=79, src=Tier.HOST, dst=Tier.STORAGE, src_pages=(0,), dst_pages=(), keys=("k",)),
        "pages as a list": forged(op=80, src_pages=[0]),
        "device to storage": forged(op=81, src=Tier.DEVICE, dst=Tier.STORAGE, dst_pages=(), keys=(keys[0],)),
        "groups that are not group runs": forged(op=82, groups=("swa",)),
        "another KV group's objects": copy_plan(83, Tier.HOST, [0], Tier.DEVICE, [1], 0, (GroupRun("swa", (0,), (0,), (1,)),)),
        "owners on a copy": forged(op=84, owners=(3,)),
        "owners one short": forged(op=85, src=Tier.HOST, dst=Tier.STORAGE, src_pages=(0, 1), dst_pages=(), keys=tuple(keys[:2]),
                                   owners=(3,)),
        "an owner past 32 bits": forged(op=86, src=Tier.HOST, dst=Tier.STORAGE, src_pages=(0,), dst_pages=(), keys=(keys[0],),
                                        owners=(1 << 32,)),
        "an owner that is a str": forged(op=87, src=Tier.HOST, dst=Tier.STORAGE, src_pages=(0,), dst_pages=(), keys=(keys[0],),
                                         owners=("3",)),
        **{f"owners {what}": forged(op=88 + i, src=Tier.HOST, dst=Tier.STORAGE, src_pages=(0,), dst_pages=(), keys=(keys[0],),
                                    owners=owners)
           for i, (what, owners) in enumerate([("an array", np.array([3])), ("None", None), ("an int", 3)])},
    }


def _refusals(executor, keys):
    """Submit every malformed plan next to the bytes; returns what came back and whether anything moved."""
    plans = _malformed_plans(keys)
    host_before, dev_before = _host_snapshot(executor), [executor.engine.device.page_bytes(p) for p in range(8)]
    for plan in plans.values():
        executor.submit(plan)
    done = executor.wait([p.op for p in plans.values()])
    moved = (_host_snapshot(executor) != host_before or [executor.engine.device.page_bytes(p) for p in range(8)] != dev_before
             or _stored(executor, keys) != 0)
    return [(c.op, type(c).__name__, c.reason.value, c.detail) for c in done], moved


@pytest.mark.parametrize("mode", MODES)
def test_malformed_plans_complete_failed_invalid_and_move_no_byte(tmp_path, mode):
    from kvtier.hashing import page_keys

    from support.cache_helpers import make_tiered_cache

    spec = tiny_specs(page_size=4, num_layers=2)["mla"]
    cache = make_tiered_cache(spec, 8, 8, f"file://{tmp_path}", mode=mode)
    on_worker(cache, _fill_pools)
    keys = page_keys(list(range(16)), 4, cache.root_key)
    answers, moved = on_worker(cache, _refusals, keys)
    assert not moved, "a malformed plan moved bytes"
    assert len(answers) == len(_malformed_plans(keys))
    for op, kind, reason, detail in answers:
        assert (kind, reason) == ("Failed", "invalid") and detail, (op, kind, reason, detail)
    details = {op: d for op, _, _, d in answers}
    assert "page -2 is outside its pool of 8" in details[71] and "page 99 is outside" in details[73] and "repeat" in details[77]
    cache.close()


def _fill_pools(executor) -> None:
    import torch

    gen = torch.Generator().manual_seed(3)
    for pool in (executor.engine.host, executor.engine.device):
        for name in pool.buffers:
            for layer in range(pool.spec.num_layers):
                rows = pool.rows(name, layer).view(torch.uint8)
                rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=gen))


# ---- a killed or misbehaving pipe worker ---------------------------------------------------------
def test_a_killed_worker_fails_and_counts_its_plans_and_the_cache_refuses_further_work():
    import os
    import signal
    import time

    from kvtier.errors import ExecutorError

    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    cache = make_cache(spec, dev_pages=16, host_pages=16, write_policy="write_through", mode="two processes")
    serve(cache, tokens(0, 16))
    serve(cache, tokens(100, 16))  # write-through backups in flight, as far as the core knows
    in_flight = len(cache._inflight)
    assert in_flight >= 1
    os.kill(cache.port.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(ExecutorError, match="plans in flight failed"):
        cache.begin(tokens(0, 16))
    assert time.monotonic() - t0 < 10  # noticed, not waited for
    assert cache.stats.lost_plans == in_flight and not cache._inflight
    cache.check_integrity(idle=True)  # every lock and page the lost plans held was released
    with pytest.raises(ExecutorError):  # and it stays refused
        cache.match(tokens(0, 16))
    cache.close()


def _send_extra_message(executor):
    """A worker that breaks the protocol: a message nobody asked for, sent beside its answer."""
    import gc
    from multiprocessing.connection import Connection

    conn = next(o for o in gc.get_objects() if isinstance(o, Connection) and not o.closed)
    conn.send(("stray", "message"))
    return "done"


def test_an_extra_message_from_the_worker_is_a_typed_error_never_an_answer_off_by_one():
    from kvtier.errors import ExecutorError
    from kvtier.executors.pipe import PipeExecutor, WorkerSpec

    port = PipeExecutor(WorkerSpec(tiny_specs(page_size=4, num_layers=1)["mla"], 4, 4))
    try:
        with pytest.raises(ExecutorError, match="out of protocol"):
            port.run(_send_extra_message)  # the stray message arrives first: never taken for run's answer
        for call in (port.poll, lambda: port.stored_prefix([b"k" * 16])):  # and nothing after it is read off by one
            with pytest.raises(ExecutorError, match="broken"):
                call()
        from kvtier.core.plans import Tier, copy_plan

        with pytest.raises(ExecutorError, match="broken"):
            port.submit(copy_plan(1, Tier.DEVICE, [0], Tier.HOST, [0]))
    finally:
        port.close()
