"""Any start order: kvtier's SGLang storage backend and the node service (``kvtier serve``) start in either
order, and a service that crashes and comes back is attached again while SGLang is idle (the heartbeat
of :mod:`kvtier.integrations.sglang.service`); a start kvtier refuses is one ERROR line naming the fix.

Driven by SGLang 0.5.23's own backend factory and host pools on CPU against a real ``kvtier serve``
subprocess, as in tests/test_sglang_service.py. "Without a call" means no SGLang call: only the
heartbeat runs between the service's start and its status listing this process's engine.
"""

from __future__ import annotations

import logging
import os
import signal

import pytest

from support.service import start_service, stop, wait_until
from support.sglang_helpers import (PoolName, StorageBackendFactory, _mamba_pool, attach, fill, mha_pool, mla_pool, page_bytes, page_keys,
                                    storage_config)
from kvtier.errors import ConfigError, ServiceError
from kvtier.service.client import query_status

pytestmark = pytest.mark.timeout(300)

P = 4  # tokens per page
#: a bound on the wait for the heartbeat (a beat a second, attempts at most 2 s apart): never a timing asserted
LISTED_WITHIN_S = 15.0


def service_config(sock: str, **kw):
    # a lookup deadline that a loaded machine meets: the calls below are asserted to succeed at once
    return storage_config(None, service=f"unix://{sock}", service_lookup_timeout_s=5.0, **kw)


def engine_listed(sock: str) -> bool:
    """The service at ``sock`` lists an engine of this process as attached."""
    return any(e["pid"] == os.getpid() for e in query_status(sock).get("engines", []))


def round_trip_is_bit_exact(backend, src, keys) -> bool:
    """``keys``' pages of ``src`` backed up through ``backend`` and read back into other slots, bit-exact."""
    idx, again = src.alloc(len(keys) * P), src.alloc(len(keys) * P)
    assert backend.batch_set_v1(keys, idx) == [True] * len(keys)
    assert backend.batch_get_v1(keys, again) == [True] * len(keys)
    return all(page_bytes(src, i) == page_bytes(src, j) for i, j in zip(idx[::P].tolist(), again[::P].tolist()))


def kvtier_records(caplog, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("kvtier") and r.levelno == level]


def test_an_engine_started_before_its_service_attaches_when_it_appears(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvtier")
    sock = str(tmp_path / "run" / "node.sock")
    src = mha_pool()
    fill(src, seed=11)
    keys = page_keys(list(range(16)), P)
    # SGLang starts with no service there: one warning line naming the socket, the reason and what happens
    backend = attach(service_config(sock), src)
    svc = None
    try:
        assert backend.batch_exists(keys) == 0 and backend.batch_set_v1(keys, src.alloc(16)) == [False] * 4  # misses
        (warning,) = kvtier_records(caplog, logging.WARNING)
        line = warning.getMessage()
        assert "\n" not in line and sock in line and "no node service listens" in line and "service_required" in line
        # the service starts: the heartbeat attaches this idle engine, no SGLang call in between
        svc = start_service(sock)
        wait_until(lambda: engine_listed(sock), LISTED_WITHIN_S)
        assert backend.service.heartbeat.beats >= 1
        assert round_trip_is_bit_exact(backend, src, keys)
        # (said by the beat's thread once its attach is done: maybe after the service already lists it)
        wait_until(lambda: any("appeared; attached" in r.getMessage() for r in kvtier_records(caplog, logging.WARNING)), LISTED_WITHIN_S)
    finally:
        backend.close()
        if svc is not None:
            stop(svc.proc)


def test_a_killed_and_restarted_service_lists_the_idle_engine_again(tmp_path):
    sock = str(tmp_path / "run" / "node.sock")
    src = mha_pool()
    fill(src, seed=12)
    keys = page_keys(list(range(16)), P)
    svc = start_service(sock)
    backend = attach(service_config(sock), src)
    try:
        assert round_trip_is_bit_exact(backend, src, keys[:8])
        wait_until(lambda: backend.service.heartbeat.beats >= 1, LISTED_WITHIN_S)  # the heartbeat has its session
        # the service crashes and a new one starts at the same socket (it adopts the region: the old pages verified)
        ready = query_status(sock)["ready"]
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(30)
        svc = start_service(sock)
        # the heartbeat noticed the hang-up and attached again (counted by its thread once the attach is done)
        wait_until(lambda: engine_listed(sock) and backend.service.reattaches >= 1, LISTED_WITHIN_S)
        assert backend.service.losses >= 1
        # SGLang's thread finds its session hung up and attaches again within this very call
        assert round_trip_is_bit_exact(backend, src, keys[8:])
        assert backend.batch_exists(keys) == len(keys)  # (the pages kept across the restart)
        assert ready > 0 and query_status(sock)["adopted"]["pages"] == ready
        # close() detaches every session of this engine, the heartbeat's included
        backend.close()
        wait_until(lambda: not engine_listed(sock), LISTED_WITHIN_S)
        assert query_status(sock)["orphaned"] == 0
    finally:
        backend.close()
        stop(svc.proc)


def test_a_required_service_that_is_not_there_fails_the_start_in_one_error_line(tmp_path, caplog):
    sock = str(tmp_path / "run" / "node.sock")
    with pytest.raises(ServiceError, match="service_required") as e:
        attach(service_config(sock, service_required=True), mha_pool())
    assert sock in str(e.value) and "kvtier serve" in str(e.value)
    (error,) = kvtier_records(caplog, logging.ERROR)
    assert error.getMessage().startswith("kvtier HiCache storage refused to start: ") and sock in error.getMessage()


@pytest.mark.parametrize("bad, match", [(dict(servcie_timeout_s=1), "servcie_timeout_s"), (dict(service_required="yes"), "true or false")])
def test_a_bad_option_is_one_error_line_before_the_raise(tmp_path, caplog, bad, match):
    cfg = service_config(str(tmp_path / "node.sock"))
    cfg.extra_config = cfg.extra_config | bad
    with pytest.raises(ConfigError, match=match):
        StorageBackendFactory.create_backend("dynamic", cfg, mha_pool())
    (error,) = kvtier_records(caplog, logging.ERROR)
    assert error.getMessage().startswith("kvtier HiCache storage refused to start: ") and match in error.getMessage()


def test_service_required_without_a_service_names_the_fix(caplog):
    cfg = storage_config(None, service_required=True)
    with pytest.raises(ConfigError, match="service_required is set without service"):
        StorageBackendFactory.create_backend("dynamic", cfg, mha_pool())
    assert len(kvtier_records(caplog, logging.ERROR)) == 1


def test_a_pool_the_service_cannot_hold_is_one_error_line_before_the_raise(tmp_path, caplog):
    """(A ninth pool with page ids of its own: the region holds at most eight beside its pages.)"""
    backend = StorageBackendFactory.create_backend("dynamic", service_config(str(tmp_path / "node.sock")), mha_pool())
    backend.register_mem_pool_host(mha_pool())
    names = [PoolName.SWA, PoolName.MAMBA, PoolName.AUXILIARY_SWA, PoolName.DRAFT_SWA, PoolName.DEEPSEEK_V4_C4_STATE,
             PoolName.DEEPSEEK_V4_C128_STATE, PoolName.DEEPSEEK_V4_C4_INDEXER_STATE, PoolName.DEEPSEEK_V4_C128]
    for name in names:
        backend.register_mem_host_pool_v2(mha_pool(heads=1), name)
    with pytest.raises(ConfigError, match="L3 store"):
        backend.register_mem_host_pool_v2(_mamba_pool(), PoolName.DEEPSEEK_V4_C4)
    (error,) = kvtier_records(caplog, logging.ERROR)
    assert "deepseek_v4_c4" in error.getMessage().lower() and "kvtier HiCache storage: " not in error.getMessage()


def test_mla_with_a_draft_pool_and_mamba_above_one_rank_starts_each_pool_in_its_shards_namespace(tmp_path):
    """SGLang's draft KV host pool (an MLATokenToKVPoolHost: no ``decl``) is one of kvtier's own pools, sharded as the KV
    under MLA; Mamba state is sharded by the TP rank. On rank 1 the draft stays in the KV pool's namespace and the state
    goes in rank 1's (a review found a ValueError at start here)."""
    sock = str(tmp_path / "run" / "node.sock")  # (no service needed: the failure is before any hello)
    backend = StorageBackendFactory.create_backend("dynamic", service_config(sock, tp_rank=1, tp_size=2, mla=True), mla_pool())
    backend.register_mem_pool_host(mla_pool())
    backend.register_mem_host_pool_v2(mla_pool(), PoolName.DRAFT)  # (MTP draft KV: an MLA host pool, as SGLang builds it)
    backend.register_mem_host_pool_v2(_mamba_pool(), PoolName.MAMBA)
    try:
        backend.on_host_pools_registered()  # (no service there: a warning, misses until it appears)
        assert sorted(backend.own_services) == [1]
        assert backend._service_of(backend._pool(PoolName.DRAFT)) is backend.service
        assert backend._service_of(backend._pool(PoolName.MAMBA)) is backend.own_services[1]
    finally:
        backend.close()


def test_a_required_service_that_is_not_there_leaves_no_rank_pages_attaching_behind(tmp_path):
    """service_required and no service: the failed start closes the KV pool's pages and rank 1's own pool pages alike
    (SGLang's hybrid controller keeps a backend whose on_host_pools_registered raised: a heartbeat left running would
    attach an engine whose start failed once the service came up, as a review found)."""
    sock = str(tmp_path / "run" / "node.sock")
    backend = StorageBackendFactory.create_backend("dynamic", service_config(sock, tp_rank=1, tp_size=2, mla=True,
                                                                             service_required=True), mla_pool())
    backend.register_mem_pool_host(mla_pool())
    backend.register_mem_host_pool_v2(_mamba_pool(), PoolName.MAMBA)
    with pytest.raises(ServiceError, match="service_required"):
        backend.on_host_pools_registered()
    assert backend.service._closed and all(s._closed for s in backend.own_services.values()) and backend.own_services
    svc = start_service(sock, 0.01)
    try:
        try:
            wait_until(lambda: any(e["pid"] == os.getpid() for e in query_status(sock).get("engines", [])), 6.0)
        except AssertionError:
            return  # nothing attached: fine
        pytest.fail(f"a backend whose required start failed attached to the service: "
                    f"engines {[e.get('namespace', e) for e in query_status(sock)['engines']]}")
    finally:
        backend.close()
        stop(svc.proc)
