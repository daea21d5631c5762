"""``kvtier serve`` shared fairly (issue 53, item 4): one engine's legal traffic cannot starve another's. A
client flooding the largest lookups the wire takes leaves another engine's lookups well inside their
0.25 s deadline; a burst of small pipelined notes is applied, not refused; what one peer can make the
service hold is bounded -- unfinished frames (bytes, and a deadline), connections per process, orphaned
sessions per process, and the L3 tier's threads whatever the namespaces; a call longer than a frame goes
as several. Real service subprocesses on a temp socket, every wait bounded."""

from __future__ import annotations

import time

import pytest

from support.service import (closed_by_peer, frame, peer_report, proc_status, query_status_of, raw_connection, raw_frame, read_answer,
                             running_service, start_flood, start_peer, stop, tell, wait_until)
from support.service_peer import NAMESPACE, SPEC

from kvtier.errors import ServiceAccessError, ServiceError, ServiceProtocolError
from kvtier.service import client as client_module
from kvtier.service import connections
from kvtier.service.client import ServiceClient
from kvtier.service.messages import MAX_PAGES
from kvtier.service.region import RegionFormat
from kvtier.service.sessions import MAX_ORPHANS_PER_PROCESS
from kvtier.service.wire import HEADER, MAX_FRAME, FrameReader, encode

pytestmark = pytest.mark.timeout(300)

#: the engine's lookups beside the flood, each with the default deadline (0.25 s)
LOOKUPS = 30
#: ServeConfig.send_deadline_s's default (kvtier serve's): also how long a frame may take to arrive whole
SEND_DEADLINE_S = 5.0
#: connections each sending an unfinished frame of MAX_FRAME bytes, and what they may cost the service together
UNFINISHED = 20
UNFINISHED_RSS_BOUND = 64 << 20
#: namespaces attached one after another to a service with L3, and the threads it may have after them all
NAMESPACES = 150
THREAD_BOUND = 16
PAGES = 5


def _fmt() -> RegionFormat:
    return RegionFormat.of(SPEC, "page_first")


def _hello() -> dict:
    return {"op": "hello", "version": 1, "namespace": "raw", "format": _fmt().as_wire()}


def test_a_client_flooding_the_largest_lookups_never_makes_another_engine_miss_its_lookup_deadline(tmp_path):
    with running_service(tmp_path) as svc:
        owner = ServiceClient(svc.socket, NAMESPACE, _fmt())  # published the prompt's pages; stays attached
        keys = [bytes([7, i]) * 8 for i in range(PAGES)]
        pages = owner.reserve(PAGES)
        owner.publish(pages, keys)
        owner.release(pages)
        assert owner.status()["ready"] == PAGES
        engine = ServiceClient(svc.socket, NAMESPACE, _fmt())
        assert engine.lookup_deadline_s == 0.25  # (the default an engine attaches with)
        flood = start_flood(svc.socket, "flood", _fmt().as_wire(), 120)  # back-to-back lookups of MAX_FRAME bytes, pipelined
        misses, took = 0, []
        try:
            for _ in range(LOOKUPS):
                t = time.monotonic()
                try:
                    held = engine.lookup(keys)
                    assert held == pages
                    engine.release(held)
                except ServiceError:  # the deadline missed: an engine drops the service and attaches again (quiesced)
                    misses += 1
                    engine = ServiceClient(svc.socket, NAMESPACE, _fmt(), previous=engine.session)
                took.append(time.monotonic() - t)
                time.sleep(0.02)
            tell(flood, "stop")
            report = peer_report(flood)
        finally:
            stop(flood)
        slowest = [round(s, 3) for s in sorted(took)[-3:]]
        assert misses == 0, (misses, slowest, report)
        # it flooded all along, every frame valid and answered (a legal client, never dropped)
        assert report["error"] is None and report["answered"] == report["frames"] >= 5, report
        assert report["frame_bytes"] > MAX_FRAME * 0.9


def test_a_burst_of_small_pipelined_notes_is_applied_and_the_connection_goes_on(tmp_path):
    with running_service(tmp_path) as svc:
        s = raw_connection(svc.socket)
        try:
            s.sendall(frame({"seq": 1, "ops": [_hello(), {"op": "reserve", "n": 64}]}))
            pages = read_answer(s)["results"][1]
            notes = [frame({"seq": 2 + i, "ops": [{"op": "release", "pages": [p]}], "note": True}) for i, p in enumerate(pages)]
            notes += [frame({"seq": 0, "ops": [{"op": "release", "pages": []}], "note": True})] * 3000
            try:  # ~190 KB of notes at once, no answer pending (nothing to refuse), then a call
                s.sendall(b"".join(notes) + frame({"seq": 9, "ops": [{"op": "status"}]}))
            except BrokenPipeError:  # (refused and closed: the refusal is what it reads next)
                pass
            answer = read_answer(s)
            assert answer is not None and answer.get("seq") == 9, answer
            st = answer["results"][0]
            assert (st["writing"], st["free"], st["protocol_errors"]) == (0, st["num_pages"], 0), st  # every release applied
        finally:
            s.close()


def test_unfinished_frames_cost_the_service_bounded_memory_and_are_dropped_past_the_deadline(tmp_path):
    with running_service(tmp_path) as svc:
        status = query_status_of(svc.socket)
        status()
        before = proc_status(svc.proc.pid, "VmRSS") << 10
        conns, start = [], time.monotonic()
        try:
            for _ in range(UNFINISHED):
                s = raw_connection(svc.socket, SEND_DEADLINE_S + 30)
                s.sendall(raw_frame(b"x" * (MAX_FRAME - 1), MAX_FRAME))  # the largest frame, its last byte never sent
                conns.append(s)
            time.sleep(0.5)  # (the service read what it was sent: each send above went through)
            grown = (proc_status(svc.proc.pid, "VmRSS") << 10) - before
            assert grown < UNFINISHED_RSS_BOUND, f"{UNFINISHED} unfinished frames grew the service by {grown >> 20} MiB"
            for s in conns:  # each refused, typed, and closed once its frame is overdue
                answer = read_answer(s)
                assert answer is not None and "not sent whole within" in answer["error"]["message"], answer
                assert closed_by_peer(s)
            took = time.monotonic() - start
        finally:
            for s in conns:
                s.close()
        assert SEND_DEADLINE_S <= took < SEND_DEADLINE_S + 15, took
        st = status()
        assert st["protocol_errors"] == UNFINISHED and st["clients"] == 0, st


def test_a_process_past_its_connections_bound_is_refused_and_the_service_serves_on(tmp_path):
    cap = connections.MAX_CONNECTIONS_PER_PROCESS
    with running_service(tmp_path) as svc:
        held = []
        try:
            for _ in range(cap):
                s = raw_connection(svc.socket)
                held.append(s)
                s.sendall(frame({"seq": 1, "ops": [{"op": "status"}]}))
                assert "results" in read_answer(s)  # admitted: answered
            with pytest.raises(ServiceAccessError, match=f"connections open \\(at most {cap}\\)"):
                ServiceClient(svc.socket, NAMESPACE, _fmt())
            other = start_peer("attach", svc.socket)  # another process is admitted meanwhile
            assert "session" in peer_report(other), other.stderr.read()
            other.wait(60)
            held.pop().close()  # one of its connections closed: it may open another
            again, _took = wait_until(lambda: _attached(svc.socket), 5)
            assert again.status()["refused"] >= 1
            again.close()
        finally:
            for s in held:
                s.close()


def _attached(sock: str) -> ServiceClient | None:
    try:
        return ServiceClient(sock, NAMESPACE, _fmt())
    except ServiceAccessError:
        return None


def test_a_process_past_its_orphans_bound_is_refused_and_the_service_serves_on(tmp_path):
    with running_service(tmp_path) as svc:
        status = query_status_of(svc.socket)
        sessions = []
        for _ in range(MAX_ORPHANS_PER_PROCESS):
            c = ServiceClient(svc.socket, NAMESPACE, _fmt())
            c.reserve(1)  # a lease: its session is kept as an orphan while this process lives
            sessions.append(c.session)
            c.close(quiesced=False)
        wait_until(lambda: status()["orphaned"] == MAX_ORPHANS_PER_PROCESS, 5)
        with pytest.raises(ServiceAccessError, match=f"orphaned sessions \\(at most {MAX_ORPHANS_PER_PROCESS}\\)"):
            ServiceClient(svc.socket, NAMESPACE, _fmt())
        other = start_peer("attach", svc.socket)  # the service serves on: another process attaches
        assert "session" in peer_report(other), other.stderr.read()
        other.wait(60)
        # and this one too, once it names one of its orphans as quiesced (which ends it)
        again = ServiceClient(svc.socket, NAMESPACE, _fmt(), previous=sessions[0])
        st = status()
        assert (st["orphaned"], st["clients"], st["writing"]) == (MAX_ORPHANS_PER_PROCESS - 1, 1, MAX_ORPHANS_PER_PROCESS - 1), st
        again.close()


def test_the_l3_tiers_threads_stay_a_fixed_few_however_many_namespaces_attach(tmp_path):
    with running_service(tmp_path, 0.01, "--storage-url", f"file://{tmp_path / 'l3'}") as svc:
        status = query_status_of(svc.socket)
        for i in range(NAMESPACES):
            c = ServiceClient(svc.socket, f"fairness-{i}", _fmt())
            pages = c.reserve(1)
            c.publish(pages, [bytes([1]) * 16])  # saved through, in this namespace
            assert c.lookup([bytes([2]) * 16]) == []  # a miss the store is asked about, in this namespace
            c.close()
        threads = proc_status(svc.proc.pid, "Threads")
        wait_until(lambda: status()["l3"]["saved_pages"] == NAMESPACES, 60)  # every namespace's page saved
        assert threads <= THREAD_BOUND, threads


def test_a_call_longer_than_a_frame_goes_as_several_and_a_lookup_asks_no_chunk_past_a_short_one(tmp_path, monkeypatch):
    monkeypatch.setattr(client_module, "SPLIT_BYTES", 40 * 35)  # 40 keys of 16 bytes a frame
    monkeypatch.setattr(client_module, "MAX_PAGES", 64)  # a reservation of at most 64 pages a call
    keys = [i.to_bytes(16, "big") for i in range(1, 201)]
    missing = bytes([0xEE]) * 16
    with running_service(tmp_path) as svc:
        status = query_status_of(svc.socket)
        writer, reader = (ServiceClient(svc.socket, NAMESPACE, _fmt()) for _ in range(2))
        pages = writer.reserve(200)  # four calls
        assert len(set(pages)) == 200
        writer.publish(pages, keys)  # five notes
        writer.release(pages)
        assert status()["ready"] == 200
        before = status()["lookups"]
        assert reader.lookup(keys + [missing] * 30) == pages  # the run over five whole chunks, and the sixth's misses
        assert status()["lookups"] - before == 6
        reader.release(pages)
        before = status()["lookups"]
        assert reader.lookup(keys[:50] + [missing] + keys[51:]) == pages[:50]  # a short second chunk: nothing asked after it
        st = status()
        assert (st["lookups"] - before, st["held"]) == (2, 50), st
        reader.close()
        writer.close()
        # a batch over the page bound is refused, typed, whatever its bytes
        s = raw_connection(svc.socket)
        try:
            s.sendall(frame({"seq": 1, "ops": [_hello()]}))
            assert "results" in read_answer(s)
            s.sendall(frame({"seq": 2, "ops": [{"op": "lookup", "keys": ["ab"] * (MAX_PAGES // 2 + 1)}] * 2}))  # each op under it
            err = read_answer(s)["error"]
            assert err["type"] == "ServiceProtocolError" and f"at most {MAX_PAGES} a batch" in err["message"], err
            assert closed_by_peer(s)
        finally:
            s.close()


def test_the_service_reads_frames_whole_one_at_a_time_and_refuses_a_bad_length_once_it_comes_to_the_head():
    good = encode({"seq": 1, "ops": []})
    r = FrameReader()
    r.feed(good[:6])
    assert r.pending and not r.whole and r.next() is None  # (part of a frame: nothing to hand out)
    r.feed(good[6:] + good + HEADER.pack(MAX_FRAME + 1))  # a whole frame, another, then a length over the bound
    assert r.next() == good[HEADER.size:] and r.next() == good[HEADER.size:]  # the frames before it, in order
    assert r.whole  # (the bad length: next says so)
    with pytest.raises(ServiceProtocolError, match=f"announces {MAX_FRAME + 1} bytes"):
        r.next()
    with pytest.raises(ServiceProtocolError, match="announces 0 bytes"):  # at the head when it arrives: at once
        FrameReader().feed(HEADER.pack(0))
