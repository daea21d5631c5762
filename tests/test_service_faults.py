"""``kvtier serve``'s faults that outlive a connection (issue 46): a client the service drops while its
process lives keeps its pages out of circulation -- it may still read them, or have a copy writing into
them -- until it reattaches quiesced or exits; the service SIGKILLed under load leaves every engine
serving right bytes (misses, recompute, no exception), and engines attach again on their own to the
restarted service (which adopts the region the killed one left), whose host hits resume; a
SIGSTOPped service holds no request past a short bound and is attached to again once it resumes. Real
service subprocesses on a temp socket, every wait bounded, bytes checked bit-exact."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time

import pytest

from support.cache_helpers import expected_page
from support.service import peer_report, query_status_of, remove_regions, running_service, start_peer, start_service, stop, tell, wait_until
from support.service_peer import NAMESPACE, PUBLISHED, SPEC, Serving, fill, prompt

from kvtier.errors import ServiceError
from kvtier.pools.host import HostPool
from kvtier.service.client import ServiceClient, query_status
from kvtier.service.region import OWNER_FILE, REGION_PREFIX, SHM_DIR, Owner, RegionFormat, map_region

pytestmark = pytest.mark.timeout(600)

#: how soon what a dropped client's exited process kept must be freed
EXIT_BOUND_S = 2.0
PAGES = len(prompt(0)) // SPEC.page_size


def _all(pool: HostPool, pages: list[int], byte: int) -> bool:
    return all(bool((t[pages] == byte).all()) for t in pool.buffers.values())


def test_a_client_dropped_while_its_process_lives_keeps_its_pages_until_it_reattaches_quiesced_or_exits(tmp_path):
    with running_service(tmp_path) as svc:
        status = query_status_of(svc.socket)
        x = start_peer("violate", svc.socket)
        try:
            rep = peer_report(x)
            assert rep["error"] == "ServiceProtocolError"  # dropped, typed
            mine = rep["pages"]  # 2 published (it holds them), 2 it was still writing
            st = status()
            assert (st["clients"], st["orphaned"], st["writing"], st["ready"], st["held"]) == (0, 1, 2, 2, 2)
            y = ServiceClient(svc.socket, NAMESPACE, RegionFormat.of(SPEC, "page_first"))
            pool = HostPool(SPEC, y.num_pages, "page_first", memory=map_region(y.region, y.region_size))
            try:
                got = y.reserve(y.num_pages)  # every page the service can give: none of the dropped client's
                assert len(got) == y.num_pages - 4 and not set(got) & set(mine)
                fill(pool, got, 0x77)
                y.publish(got, [p.to_bytes(16, "big") for p in got])
                assert y.lookup(PUBLISHED) == mine[:2]  # its finished pages are offered: written once, never again
                tell(x, "write")  # its copy still in flight writes on after the drop
                assert peer_report(x)["wrote"] == mine[2:]
                assert _all(pool, got, 0x77) and _all(pool, mine[:2], 0xEE)  # nobody's page changed under them
                # it attaches again, naming its dropped session (quiesced): what the service kept is freed
                tell(x, "reattach")
                assert peer_report(x)["session"]
                st = status()
                assert (st["orphaned"], st["writing"], st["dropped_writes"], st["free"]) == (0, 0, 2, 2)
                assert sorted(y.reserve(4)) == sorted(mine[2:])  # the pages it wrote unpublished, now free
            finally:
                y.close()
        finally:
            tell(x, "exit")
            x.wait(60)
        # dropped, then its process exits: what it kept is freed within the bound
        x2 = start_peer("violate", svc.socket)
        try:
            assert peer_report(x2)["error"] == "ServiceProtocolError"
            st = status()
            assert (st["orphaned"], st["writing"], st["held"]) == (1, 2, 2)
        finally:
            tell(x2, "exit")
            x2.wait(60)
        st, took = wait_until(lambda: (s := status())["orphaned"] == 0 and s, EXIT_BOUND_S)
        assert (st["writing"], st["held"]) == (0, 0)


def test_the_service_sigkilled_under_load_engines_serve_right_bytes_and_reattach_when_it_is_back(tmp_path):
    sock = str(tmp_path / "run" / "node.sock")
    status = query_status_of(sock)
    regions: list[str] = []
    svc = start_service(sock)
    engines = []
    try:
        engines = [start_peer("serve", sock) for _ in range(2)]
        a, b = engines
        # under load: both serve requests over 12 prompts they share (more than a 16-page device and a 32-page share hold:
        # host hits, their own and the other's, through the service)
        for e in engines:
            tell(e, json.dumps({"loop": 12}))
        for e in engines:
            assert "warm" in peer_report(e)  # each has its host tier in the service's region now
        regions.append(status()["region"])
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(30)
        time.sleep(1.0)  # they go on without it
        for e in engines:
            tell(e, "stop")
        for rep in [peer_report(e) for e in engines]:
            assert rep["bad"] == 0 and rep["requests"] > 0, rep  # every cached page right
            assert rep["lost"] == 1 and not rep["attached"] and rep["lost_pages"] > 0, rep  # its region pages forgotten
        # the service back (a new process, adopting the region: what verifies is offered again): they attach again on
        # their own, while serving
        svc = start_service(sock, 0.01, "--verify-sample", "1")
        for e in engines:
            tell(e, json.dumps({"loop": 12}))
        for e in engines:
            assert "warm" in peer_report(e)  # host hits again: it attached to the new service
        regions.append(status()["region"])
        assert regions[1] == regions[0] and status()["clients"] == 2 and status()["adopted"]["pages"] > 0, status()
        assert status()["verify"]["failed_pages"] == 0
        for e in engines:
            tell(e, "stop")
        for rep in [peer_report(e) for e in engines]:
            assert rep["bad"] == 0 and rep["reattaches"] == 1 and rep["attached"], rep
        # a prefix A computes now is a host hit for B, and for an engine started now (bit-exact)
        tell(a, json.dumps({"compute": 99}))
        assert peer_report(a)["bad"] == 0
        tell(b, json.dumps({"load": 99}))
        rep = peer_report(b)
        assert (rep["host_hit"], rep["cached"], rep["bad"]) == (PAGES, PAGES, 0), rep
        c = start_peer("load", sock, str(tmp_path / "c.bin"), "99")
        assert peer_report(c)["host_hit"] == PAGES
        assert c.wait(60) == 0, c.stderr.read()
        assert (tmp_path / "c.bin").read_bytes() == b"".join(expected_page(SPEC, prompt(99), i) for i in range(PAGES))
        for e in engines:
            tell(e, json.dumps({"exit": True}))
        for e in engines:
            assert e.wait(60) == 0, e.stderr.read()[-3000:]  # no exception reached the engine, its books check out
    finally:
        for e in engines:
            if e.poll() is None:
                e.kill()
                e.wait(30)
        stop(svc.proc)
        remove_regions(regions)  # (a SIGKILLed service leaves its region behind)


def test_after_the_service_restarts_with_a_new_region_no_page_id_of_the_old_one_is_read(tmp_path):
    sock = str(tmp_path / "run" / "node.sock")
    status = query_status_of(sock)
    svc = start_service(sock)
    regions: list[str] = []
    engine = None
    try:
        engine = Serving(sock)  # this process's engine
        engine.request(prompt(1))
        engine.cache.wait_idle()  # its pages backed up into the region
        regions.append(status()["region"])
        cache = engine.cache
        cache.evict_device(16)  # prompt 1 on host only now: page ids of this region in the engine's tree
        assert len(cache.tree.hosted) == PAGES and cache.stats.device_evicted_pages == PAGES
        held = cache.match(prompt(1), count=False).nodes
        cache.lock(held[-1])  # as a request open across the fault holds them
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(30)
        svc = start_service(sock, 0.01, "--fresh-region")  # a new region, empty
        # (matches alone: a request's commit would find no host room and evict those pages itself)
        leased = cache.host.allocator
        assert cache.match(prompt(2)).nodes == [] and leased.losses == 1  # its lookup finds the service gone
        time.sleep(0.2)  # (past the first retry's wait)
        cache.match(prompt(2))  # the pages held stay in the tree, unreadable: no match offers them, and it does not attach yet
        assert cache.match(prompt(1)).nodes == [] and len(cache.tree.hosted) == PAGES and leased.reattaches == 0
        wait_until(lambda: status()["clients"] == 1, 20.0)  # its heartbeat attached beside the old pages (they hold it back)
        cache.unlock(held[-1])
        cache.match(prompt(2))  # it forgets them, then attaches again
        assert (leased.losses, leased.reattaches, cache.stats.shared_host_lost_pages, len(cache.tree.hosted)) == (1, 1, PAGES, 0)
        regions.append(status()["region"])
        engine.request(prompt(1))  # a miss, recomputed: never a host hit on an old page id in the new region
        assert (engine.bad, engine.host_hit, engine.cached) == (0, 0, 0)
        engine.cache.wait_idle()
        engine.cache.check_integrity(idle=True)
    finally:
        if engine is not None:
            engine.cache.close()
        stop(svc.proc)
        remove_regions(regions)


#: the longest a request may take while the service is stalled: its lookups and reservations miss their short
#: deadline once, the tier is lost, and the next requests go on without it (misses) instead of waiting on it
STALL_BOUND_S = 2.0
#: ServeConfig.send_deadline_s's default (kvtier serve's): a client that leaves its answers unread this long is dropped
SEND_DEADLINE_S = 5.0
#: how far past it the drop may come: the kernel's socket buffer must fill first, then a turn of the service's loop
DROP_SLACK_S = 15.0


def _serve(engine: Serving, until, limit_s: float) -> float:
    """Requests over 12 prompts (each followed by the one 4 back: off the device, on the host share) until
    ``until()`` or ``limit_s`` passed; the longest one took (s)."""
    prompts = [prompt(i) for i in range(12)]
    start, worst, i = time.monotonic(), 0.0, 0
    while not until() and time.monotonic() - start < limit_s:
        for toks in (prompts[i % 12], prompts[(i - 4) % 12]):
            t = time.monotonic()
            engine.request(toks)
            worst = max(worst, time.monotonic() - t)
        i += 1
    return worst


def test_a_stalled_service_holds_no_request_past_the_bound_and_the_engine_attaches_again_when_it_resumes(tmp_path):
    sock = str(tmp_path / "run" / "node.sock")
    status = query_status_of(sock)
    svc = start_service(sock)
    engine, stalled = None, False
    try:
        engine = Serving(sock)  # this process's engine
        leased = engine.cache.host.allocator
        _serve(engine, lambda: engine.host_hit >= PAGES, 120.0)
        assert engine.host_hit >= PAGES and leased.losses == 0  # warm: it reads its host tier in the service's region
        os.kill(svc.proc.pid, signal.SIGSTOP)  # the service stalls: it reads nothing, answers nothing
        stalled = True
        engine.requests = engine.bad = 0
        worst = _serve(engine, lambda: False, 3.0)
        assert worst < STALL_BOUND_S, worst  # no request waited on the stalled service past the bound
        assert engine.requests > 2 and engine.bad == 0  # requests kept being served, every cached page right
        assert leased.lost and (leased.losses, leased.reattaches) == (1, 0)  # lost at the first stall, never attached to it again
        os.kill(svc.proc.pid, signal.SIGCONT)
        stalled = False
        engine.requests = engine.bad = engine.host_hit = 0
        worst = _serve(engine, lambda: engine.host_hit >= PAGES, 120.0)
        assert engine.host_hit >= PAGES and engine.bad == 0  # host hits again: it attached to the service again
        assert worst < STALL_BOUND_S and not leased.lost and leased.reattaches >= 1, (worst, leased.reattaches)
        # the old session (its pages kept while this process lives) ended when the engine attached again naming it
        wait_until(lambda: (s := status())["clients"] == 1 and s["orphaned"] == 0, EXIT_BOUND_S)
        engine.cache.wait_idle()
        engine.cache.check_integrity(idle=True)
    finally:
        if stalled:
            os.kill(svc.proc.pid, signal.SIGCONT)
        if engine is not None:
            engine.cache.close()
        stop(svc.proc)


def test_a_note_to_a_stalled_service_whose_socket_buffer_is_full_fails_within_the_bound(tmp_path):
    with running_service(tmp_path) as svc:
        client = ServiceClient(svc.socket, NAMESPACE, RegionFormat.of(SPEC, "page_first"))
        os.kill(svc.proc.pid, signal.SIGSTOP)
        try:
            worst, error = 0.0, None
            for _ in range(20):  # notes of ~600 KB each: the kernel's buffer (~200 KB) fills at the first
                t = time.monotonic()
                try:
                    client.release(list(range(100_000)))
                except ServiceError as e:
                    error = e
                worst = max(worst, time.monotonic() - t)
                if error is not None:
                    break
            assert isinstance(error, ServiceError) and worst < STALL_BOUND_S, (error, worst)
            t = time.monotonic()
            with pytest.raises(ServiceError, match="unusable"):  # broken from then on: a half-sent frame is never followed by another
                client.lookup(PUBLISHED)
            assert time.monotonic() - t < STALL_BOUND_S
        finally:
            os.kill(svc.proc.pid, signal.SIGCONT)
            client.close()


def test_a_client_that_stops_reading_is_dropped_within_the_bound_while_an_engine_is_served_and_its_leases_end_when_it_exits(tmp_path):
    with running_service(tmp_path) as svc:
        status = query_status_of(svc.socket)
        engine = Serving(svc.socket)  # this process's engine, warm: it reads its host tier in the region
        x = None
        try:
            _serve(engine, lambda: engine.host_hit >= PAGES, 120.0)
            x = start_peer("stop-reading", svc.socket)
            leased = peer_report(x)["pages"]
            assert len(leased) == 2 and status()["writing"] == 2
            tell(x, "flood")  # lookups, their answers never read
            flooding = time.monotonic()
            engine.requests = engine.bad = engine.host_hit = 0
            worst = _serve(engine, lambda: status()["unread_drops"] == 1, SEND_DEADLINE_S + DROP_SLACK_S)
            dropped_after = time.monotonic() - flooding
            st = status()
            assert st["unread_drops"] == 1, st  # dropped within the bound, for leaving its answers unread
            assert dropped_after >= SEND_DEADLINE_S  # (no sooner than the deadline: a slow reader is not dropped at once)
            # meanwhile the engine was served: every request bounded, its bytes right, host hits through the service
            assert worst < STALL_BOUND_S and engine.bad == 0 and engine.requests > 2 and engine.host_hit > 0, (worst, engine.report())
            assert peer_report(x)["frames"] > 0  # its next send found the connection closed
            # its process lives: its leases stay out of circulation, as an orphan
            assert (st["orphaned"], st["writing"], st["clients"]) == (1, 2, 1), st
            tell(x, "exit")
            assert x.wait(60) == 0, x.stderr.read()[-3000:]
            st, _ = wait_until(lambda: (s := status())["orphaned"] == 0 and s, EXIT_BOUND_S)
            assert (st["writing"], st["dropped_writes"], st["expired_leases"], st["clients"]) == (0, 2, 2, 1), st
            engine.cache.wait_idle()
            engine.cache.check_integrity(idle=True)
            assert not engine.cache.host.allocator.lost  # the engine never lost the service
        finally:
            if x is not None and x.poll() is None:
                x.kill()
                x.wait(30)
            engine.cache.close()


def test_a_starting_service_removes_the_regions_its_users_killed_services_left_and_nothing_else(tmp_path):
    fmt = RegionFormat.of(SPEC, "page_first")
    made: list[str] = []
    services = [start_service(str(tmp_path / "live" / "node.sock"))]
    try:
        services += [start_service(str(tmp_path / name / "node.sock")) for name in ("killed", "waiting")]
        live, killed, waiting = services
        for svc in services:
            client = ServiceClient(svc.socket, NAMESPACE, fmt)  # its region is made
            made.append(os.path.dirname(client.region))
            client.close()
        for svc in (killed, waiting):
            os.kill(svc.proc.pid, signal.SIGKILL)
            svc.proc.wait(30)
        os.unlink(killed.socket)  # (its service is gone for good; the waiting one's socket file says it comes back)
        live_region, killed_region, waiting_region = made  # (left behind: the next service its user starts removes it)
        # a region whose owner's pid now runs another process (this one: its start time differs)
        me = Owner.of(os.getpid())
        reused = _fake_region(made, Owner(me.pid, me.start - 1))
        theirs = _fake_region(made, Owner(killed.proc.pid, 1), uid=54321)  # another user's, its owner gone
        unnamed = _fake_region(made, None)  # names no owner (being made, or an older kvtier's)
        elsewhere = _fake_region(made, Owner(killed.proc.pid, 1), pidns=1)  # its owner ran in another pid namespace
        with running_service(tmp_path) as svc:
            assert ServiceClient(svc.socket, NAMESPACE, fmt).region  # (it works)
            assert not os.path.exists(killed_region) and not os.path.exists(reused)
            # (the waiting one is left for its socket's next service, which adopts it)
            assert all(os.path.isdir(d) for d in (live_region, waiting_region, theirs, unnamed, elsewhere))
            assert query_status(live.socket)["region"] == os.path.join(live_region, "region")  # the live service untouched
    finally:
        for svc in services:
            stop(svc.proc)
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


def _fake_region(made: list[str], owner: Owner | None, uid: int | None = None, pidns: int | None = None) -> str:
    folder = tempfile.mkdtemp(prefix=REGION_PREFIX, dir=SHM_DIR)
    made.append(folder)
    if owner is not None:
        with open(os.path.join(folder, OWNER_FILE), "w") as f:
            json.dump({"pid": owner.pid, "start": owner.start, **({"pidns": pidns} if pidns is not None else {})}, f)
    if uid is not None:
        os.chown(folder, uid, uid)
    return folder
