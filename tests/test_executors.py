"""Executors at their edges: a worker that dies or cannot start is a typed error, never a hang;
a plan that names a partial page cannot be built."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvtier.config import StorageConfig
from kvtier.core.plans import Tier, Transfer, copy_plan, fetch_plan
from kvtier.errors import ExecutorError, PageAlignmentError
from kvtier.executors.pipe import PipeExecutor, WorkerSpec
from conftest import tiny_specs


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
