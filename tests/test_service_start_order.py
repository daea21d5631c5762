"""Any start order between engines and ``kvtier serve`` (issue 55): an engine whose service does not answer
starts anyway -- one warning line, host misses -- and its heartbeat attaches when the service appears, with
no request on the way; a service restarted (SIGKILL) while an idle engine holds pages of its region sees
that engine again within seconds, and the engine moves to the new region at its next request, resized to
it; ``service_required`` makes an absent service an error, and a service that answers and refuses is one
either way. Real service subprocesses on a temp socket, every wait bounded, bytes checked bit-exact."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from support.service import query_status_of, remove_regions, running_service, start_service, stop, wait_until
from support.service_peer import SPEC, Serving, prompt

from kvtier.build import build_cache
from kvtier.config import TierConfig
from kvtier.errors import ServiceError, ServiceUnavailableError
from kvtier.spec import KVSpec

pytestmark = pytest.mark.timeout(300)

PAGES = len(prompt(0)) // SPEC.page_size
#: how long a heartbeat may take to see a service appear or go (a beat a second, the backoff's longest wait
#: 2 s, a loaded machine's slack)
BEAT_BOUND_S = 20.0


def _heartbeats() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvtier-service-heartbeat"]


def test_an_engine_started_before_the_service_serves_with_misses_and_attaches_when_it_appears(tmp_path, caplog):
    sock = str(tmp_path / "run" / "node.sock")
    with caplog.at_level("WARNING", logger="kvtier"):
        a = Serving(sock)
    svc = b = None
    try:
        said = [r.getMessage() for r in caplog.records if "starts without the node service" in r.getMessage()]
        assert len(said) == 1 and f"no node service listens on {sock}" in said[0] and "\n" not in said[0], said
        leased = a.cache.host.allocator
        assert leased.lost and leased.region is None and a.cache.host.num_pages == 0
        a.request(prompt(1))  # misses: recomputed, never a host page
        a.cache.wait_idle()
        assert (a.bad, a.cached, a.cache.stats.backed_up_pages) == (0, 0, 0)
        svc = start_service(sock)
        wait_until(lambda: not leased.lost, BEAT_BOUND_S)  # its heartbeat attached: no request asked
        status = query_status_of(sock)()
        assert status["clients"] == 1 and [e["share_pages"] for e in status["engines"]] == [32]
        assert a.cache.host.num_pages == status["num_pages"] and leased.region.path == status["region"]
        a.request(prompt(2))
        a.cache.wait_idle()  # its pages backed up into the region, published
        b = Serving(sock)  # another engine: the prefix from host, bit-exact
        b.request(prompt(2))
        assert (b.host_hit, b.cached, b.bad) == (PAGES, PAGES, 0)  # (each cached page's bytes checked against the prompt's)
        a.cache.check_integrity(idle=True)
    finally:
        for engine in (a, b):
            if engine is not None:
                engine.cache.close()
        if svc is not None:
            stop(svc.proc)
    assert not _heartbeats()  # closing the cache stopped its beat


def test_a_service_restarted_under_an_idle_engine_sees_it_within_seconds_and_its_next_request_uses_the_new_region(tmp_path):
    """SIGKILL and restart with a larger region while an engine holds pages of the old one and makes no request:
    the new service lists it within the bound (attached beside the old pages, holding none); its next request
    forgets the old pages, takes the new region resized to its page count, and serves right bytes."""
    sock = str(tmp_path / "run" / "node.sock")
    status = query_status_of(sock)
    svc = start_service(sock, 0.01)
    regions: list[str] = []
    engine = None
    try:
        engine = Serving(sock)
        regions.append(status()["region"])  # (made at the first hello)
        engine.request(prompt(1))
        engine.cache.wait_idle()
        engine.cache.evict_device(16)  # prompt 1 on host only: pages of this region in the engine's tree
        leased, old_pages = engine.cache.host.allocator, engine.cache.host.num_pages
        assert leased.num_used == PAGES
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(30)
        svc = start_service(sock, 0.02)  # another region, twice the pages
        wait_until(lambda: status()["clients"] == 1, BEAT_BOUND_S)  # seen again, with no request from the engine
        regions.append(status()["region"])
        assert leased.lost and leased.losses == 1 and leased.num_used == PAGES  # (still the old region's pages in its books)
        assert status()["engines"][0]["held"] == 0
        engine.request(prompt(1))  # the old pages forgotten, the new region taken: a miss, recomputed
        assert not leased.lost and leased.reattaches == 1 and leased.region.path == regions[1]
        assert engine.cache.host.num_pages == leased.num_pages == status()["num_pages"] > old_pages
        assert (engine.bad, engine.host_hit, engine.cache.stats.shared_host_lost_pages) == (0, 0, PAGES)
        engine.cache.wait_idle()
        engine.cache.evict_device(16)
        engine.request(prompt(1))  # now a host hit in the new region, bit-exact
        assert (engine.bad, engine.host_hit) == (0, PAGES)
        assert status()["clients"] == 1  # the standby became the client: one session, not two
        engine.cache.wait_idle()
        engine.cache.check_integrity(idle=True)
    finally:
        if engine is not None:
            engine.cache.close()
        stop(svc.proc)
        remove_regions(regions)


def test_with_service_required_an_absent_service_is_an_error_at_build_naming_the_socket(tmp_path):
    sock = str(tmp_path / "run" / "node.sock")
    with pytest.raises(ServiceUnavailableError, match=f"no node service listens on {sock}"):
        build_cache(SPEC, TierConfig(device_pages=16, host_pages=32, service=sock, service_required=True))
    assert not _heartbeats()
    with pytest.raises(Exception, match="service_required must be true or false"):
        TierConfig(service=sock, service_required="yes")


def test_a_service_that_answers_and_refuses_is_an_error_at_build_even_when_not_required(tmp_path):
    """Starting without the service is for one that does not answer; one that refuses this engine (another page
    format than its engines') would refuse it at every attempt: the engine does not start, and nothing is left running."""
    other = KVSpec.mha("other", num_layers=2, kv_heads=1, head_dim=8, page_size=SPEC.page_size)
    with running_service(tmp_path) as svc:
        first = Serving(svc.socket)
        try:
            with pytest.raises(ServiceError, match="one page format per service") as refused:
                build_cache(other, TierConfig(device_pages=16, host_pages=32, service=svc.socket))
            assert not isinstance(refused.value, ServiceUnavailableError)
            assert len(_heartbeats()) == 1  # the first engine's only
        finally:
            first.cache.close()
