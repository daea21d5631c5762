"""``kvtier serve`` (issue 46's first slice), as users run it: the service a subprocess on a temp socket,
engines separate processes attached to it. Two engines share a prefix bit-exact through the region; a
writer SIGKILLed mid-write never has its pages offered and its leases end within a bound; malformed
messages get a typed error and a closed connection while others are served; a peer of another uid is
refused; SIGTERM removes the socket and the region. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import socket
import stat
import threading
import time

import pytest
import torch

from support.cache_helpers import expected_page
from support.service import (closed_by_peer, frame, peer_report, raw_connection, raw_frame, read_answer, running_service, start_peer,
                             stop, wait_until)
from support.service_peer import NAMESPACE, PROMPT, PUBLISHED, SPEC, UNPUBLISHED

from kvtier.build import build_cache
from kvtier.config import TierConfig
from kvtier.errors import ConfigError, ServiceAccessError, ServiceError
from kvtier.service.client import ServiceClient, SessionWriter, query_status
from kvtier.service.peer import PeerCredentials, check_peer, supplementary_groups
from kvtier.service.region import RegionFormat
from kvtier.service.server import NodeService, ServeConfig
from kvtier.service.wire import MAX_FRAME

pytestmark = pytest.mark.timeout(300)

#: how soon a dropped connection's leases must be released (the issue's "within a bound, default seconds")
LEASE_BOUND_S = 2.0
PAGES = len(PROMPT) // SPEC.page_size


def _fmt() -> RegionFormat:
    return RegionFormat.of(SPEC, "page_first")


def test_a_prefix_one_engine_computed_is_a_host_hit_for_another_bit_exact(tmp_path):
    with running_service(tmp_path) as svc:
        # engine A computes the prompt; its backups are published, and it stays attached
        a = start_peer("compute", svc.socket)
        try:
            assert peer_report(a) == {"device_hit": 0, "host_hit": 0, "backed_up": PAGES}
            # engine B, another process, finds every page on host and loads it from the mapped region
            b = start_peer("load", svc.socket, str(tmp_path / "b.bin"))
            report = peer_report(b)
            assert b.wait(60) == 0, b.stderr.read()
            assert report == {"device_hit": 0, "host_hit": PAGES, "storage_hit": 0, "cached": PAGES, "shared_host_pages": PAGES}
            data = (tmp_path / "b.bin").read_bytes()
            want = b"".join(expected_page(SPEC, PROMPT, i) for i in range(PAGES))
            assert data == want  # bit-exact, every layer and buffer (MLA latent + DSA indexer)
            st = query_status(svc.socket)
            assert st["clients"] == 1 and st["ready"] == PAGES and st["hit_pages"] == PAGES
        finally:
            a.communicate("done\n", timeout=60)
        assert a.returncode == 0, a.stderr
        # A is gone (a restart): its pages stay in the service, and a third engine still gets them
        c = start_peer("load", svc.socket, str(tmp_path / "c.bin"))
        assert peer_report(c)["host_hit"] == PAGES
        assert c.wait(60) == 0, c.stderr.read()
        assert (tmp_path / "c.bin").read_bytes() == want
        assert query_status(svc.socket)["held"] == 0  # nobody attached holds anything


def test_a_writer_killed_mid_write_never_has_its_pages_offered_and_its_leases_end_within_the_bound(tmp_path):
    with running_service(tmp_path) as svc:
        writer = start_peer("write-and-hang", svc.socket)
        try:
            pages = peer_report(writer)["pages"]
            st = query_status(svc.socket)
            assert (st["writing"], st["ready"], st["held"]) == (2, 2, 2)
        finally:
            os.kill(writer.pid, signal.SIGKILL)  # in the middle of writing two of its four pages
            writer.wait(30)
        # its leases: the two pages it was writing are free again, its holds released, within the bound
        st, took = wait_until(lambda: (s := query_status(svc.socket))["writing"] == 0 and s["held"] == 0 and s, LEASE_BOUND_S)
        assert st["dropped_writes"] == 2 and st["free"] == st["num_pages"] - 2 and st["ready"] == 2
        # nothing it left unpublished is ever offered; what it published is (it finished those writes)
        reader = ServiceClient(svc.socket, NAMESPACE, _fmt())
        try:
            assert reader.lookup(UNPUBLISHED) == []
            assert reader.lookup(PUBLISHED) == pages[:2]
            assert reader.lookup([PUBLISHED[0], UNPUBLISHED[0]]) == []  # (held already by this reader: the run stops)
        finally:
            reader.close()


def test_a_killed_sessions_pages_stay_out_of_circulation_while_a_process_that_joined_it_as_a_writer_is_connected(tmp_path):
    """A vLLM engine core SIGKILLed while its workers (other processes) may still have copies landing in the
    pages its session reserved: the workers joined that session as writers, so the service frees nothing of
    it until the last of them is gone too -- then within the bound."""
    with running_service(tmp_path) as svc:
        owner = start_peer("write-and-hang", svc.socket)
        worker = None
        try:
            report = peer_report(owner)
            worker = start_peer("join", svc.socket, report["session"])
            assert peer_report(worker) == {"joined": report["session"]}
            assert query_status(svc.socket)["writers"] == 1
            os.kill(owner.pid, signal.SIGKILL)  # the engine core; its worker lives on
            owner.wait(30)
            wait_until(lambda: query_status(svc.socket)["orphaned"] == 1, LEASE_BOUND_S)
            time.sleep(0.5)  # (several turns of the service's loop: nothing of it is freed while its writer is connected)
            st = query_status(svc.socket)
            assert (st["writing"], st["held"], st["orphaned"], st["dropped_writes"]) == (2, 2, 1, 0)
        finally:
            owner.kill()
            if worker is not None:
                worker.kill()  # the last writer gone: the session ends
                worker.wait(30)
        st, _took = wait_until(lambda: (s := query_status(svc.socket))["orphaned"] == 0 and s, LEASE_BOUND_S)
        assert (st["writing"], st["held"], st["writers"], st["dropped_writes"]) == (0, 0, 0, 2)
        reader = ServiceClient(svc.socket, NAMESPACE, _fmt())
        try:
            assert reader.lookup(UNPUBLISHED) == [] and reader.lookup(PUBLISHED) == report["pages"][:2]
        finally:
            reader.close()


def test_join_names_an_attached_session_and_a_joined_connection_only_says_bye(tmp_path):
    with running_service(tmp_path) as svc:
        with pytest.raises(ServiceError, match="join: no attached session"):
            SessionWriter(svc.socket, "f" * 32, 5.0)
        owner = ServiceClient(svc.socket, NAMESPACE, _fmt())
        try:
            s = raw_connection(svc.socket)
            try:
                s.sendall(frame({"seq": 1, "ops": [{"op": "join", "session": owner.session}]}))
                assert read_answer(s)["results"] == [{"session": owner.session}]
                s.sendall(frame({"seq": 2, "ops": [{"op": "reserve", "n": 1}]}))
                assert "reserve before hello" in read_answer(s)["error"]["message"] and closed_by_peer(s)
            finally:
                s.close()
            assert query_status(svc.socket)["writers"] == 0  # (its connection's end took it off)
            writer = SessionWriter(svc.socket, owner.session)
            assert query_status(svc.socket)["writers"] == 1
        finally:
            owner.close()
        wait_until(lambda: query_status(svc.socket)["writers"] == 0, 5)  # a session that ended has no writers left
        writer.close()


def _refused(sock_path: str, data: bytes, *, hello: bool = True) -> dict:
    """Send ``data`` (after a hello, if ``hello``) on a fresh connection; the service's error, checked
    to close the connection after it."""
    s = raw_connection(sock_path)
    try:
        if hello:
            s.sendall(frame({"seq": 1, "ops": [{"op": "hello", "version": 1, "namespace": "raw", "format": _fmt().as_wire()}]}))
            assert "results" in read_answer(s)
        s.sendall(data)
        answer = read_answer(s)
        assert answer is not None and "error" in answer, answer
        assert closed_by_peer(s)
        return answer["error"]
    finally:
        s.close()


def test_malformed_and_hostile_messages_get_a_typed_error_and_the_connection_closed(tmp_path):
    with running_service(tmp_path) as svc:
        good = ServiceClient(svc.socket, NAMESPACE, _fmt())  # another client, attached throughout
        try:
            mine = good.reserve(2)
            n = good.num_pages
            cases = {
                "zero length": (raw_frame(b"", 0), "announces 0 bytes"),
                "huge length": (raw_frame(b"{}", MAX_FRAME + 1), f"announces {MAX_FRAME + 1} bytes"),
                "not json": (raw_frame(b"\xff\xfe not json"), "not UTF-8 JSON"),
                "not an object": (raw_frame(b"[1, 2]"), "not an object"),
                "unknown type": (frame({"seq": 2, "ops": [{"op": "format_disk"}]}), "unknown message type 'format_disk'"),
                "bad field": (frame({"seq": 2, "ops": [{"op": "reserve", "n": -5}]}), "reserve's n"),
                "page outside": (frame({"seq": 2, "ops": [{"op": "release", "pages": [n + 7]}]}), f"page {n + 7} is outside the region"),
                "negative page": (frame({"seq": 2, "ops": [{"op": "release", "pages": [-1]}]}), "page -1 is outside"),
                "another's page": (frame({"seq": 2, "ops": [{"op": "publish", "pages": [mine[0]], "keys": ["ab" * 16]}]}),
                                   f"page {mine[0]} is not this client's"),
                "bad key": (frame({"seq": 2, "ops": [{"op": "lookup", "keys": ["xyz"]}]}), "'xyz' is not a page key"),
            }
            for name, (data, text) in cases.items():
                err = _refused(svc.socket, data)
                assert err["type"] == "ServiceProtocolError" and text in err["message"], (name, err)
            err = _refused(svc.socket, frame({"seq": 1, "ops": [{"op": "lookup", "keys": []}]}), hello=False)
            assert err["type"] == "ServiceProtocolError" and "before hello" in err["message"]
            # the service still serves the client that behaved, and its lease is intact
            good.publish(mine, [b"\x07" * 16, b"\x08" * 16])
            assert good.status()["ready"] == 2
            assert query_status(svc.socket)["clients"] == 1
        finally:
            good.close()


def test_a_peer_of_another_uid_is_refused(tmp_path):
    # the check itself, on the kernel's answer for a peer of another uid
    with pytest.raises(ServiceAccessError, match="runs as uid 4242; this node service admits uid 1000 only"):
        check_peer(PeerCredentials(pid=7, uid=4242, gid=4242), 1000)
    check_peer(PeerCredentials(pid=7, uid=1000, gid=1000), 1000)
    # with a group allowed (--allow-group): admitted by its gid, or by a supplementary group of the live process
    check_peer(PeerCredentials(pid=7, uid=4242, gid=4343), 1000, 4343)
    me = os.getpid()
    assert supplementary_groups(me) == set(os.getgroups())
    for group in os.getgroups():
        check_peer(PeerCredentials(pid=me, uid=4242, gid=4242), 1000, group)
    with pytest.raises(ServiceAccessError, match="runs as uid 4242, gid 4242, groups .*; this node service admits uid 1000 and group 4343"):
        check_peer(PeerCredentials(pid=me, uid=4242, gid=4242), 1000, 4343)
    # (real processes of another uid, with and without --allow-group: tests/test_service_ops.py)
    # and the service applying it: one that admits another uid than ours refuses us, typed, before any op
    service = NodeService(ServeConfig(host_gb=0.01, socket=str(tmp_path / "run" / "node.sock")), uid=os.getuid() + 1)
    stopping = threading.Event()
    t = threading.Thread(target=service.serve, args=(stopping.is_set,))
    t.start()
    try:
        with pytest.raises(ServiceAccessError, match=f"runs as uid {os.getuid()}"):
            ServiceClient(service.config.socket, NAMESPACE, _fmt(), deadline_s=10)
        assert service.refused == 1 and service.region is None  # refused before its hello could make anything
    finally:
        stopping.set()
        t.join(30)
        service.close()


def test_sigterm_removes_the_socket_and_the_region_which_only_its_user_can_open(tmp_path):
    with running_service(tmp_path) as svc:
        client = ServiceClient(svc.socket, NAMESPACE, _fmt())
        region = client.region
        client.close()
        assert stat.S_IMODE(os.stat(region).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(region)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(os.path.dirname(svc.socket)).st_mode) == 0o700
        assert stop(svc.proc) == 0
        assert not os.path.exists(svc.socket) and not os.path.exists(os.path.dirname(region))
        with pytest.raises(ServiceError, match="no node service listens"):
            ServiceClient(svc.socket, NAMESPACE, _fmt())


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    from support.cli import kvtier

    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    a_file = tmp_path / "run2"
    a_file.mkdir(mode=0o700)
    (a_file / "node.sock").write_text("not a socket")
    busy = socket.create_server(("127.0.0.1", 0))  # a port in use
    cases = [
        (["serve", "--socket", str(tmp_path / "x" / "s.sock")], "needs --host-gb"),
        (["serve", "--host-gb", "-1", "--socket", str(tmp_path / "x" / "s.sock")], "ServeConfig.host_gb must be a number > 0"),
        (["serve", "--host-gb", "lots", "--socket", str(tmp_path / "x" / "s.sock")], "'lots'"),
        (["serve", "--host-gb", "100000", "--socket", str(tmp_path / "x" / "s.sock")], "lower --host-gb"),
        (["serve", "--host-gb", "0.01", "--socket", str(open_dir / "s.sock")], "mode 0700 (it is uid"),
        (["serve", "--host-gb", "0.01", "--socket", str(a_file / "node.sock")], "exists and is not a socket"),
        (["serve", "--status", "--socket", str(tmp_path / "x" / "none.sock")], "no node service listens"),
        (["serve", "--host-gb", "0.01", "--socket", str(tmp_path / "busy" / "s.sock"), "--metrics-port", str(busy.getsockname()[1])],
         f"--metrics-port {busy.getsockname()[1]} on --metrics-host 127.0.0.1: cannot serve metrics there (Address already in use)"),
    ]
    for argv, text in cases:
        r = kvtier(*argv, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and text in lines[0] and "Traceback" not in r.stderr, (argv, r.stderr)
    busy.close()
    assert not (open_dir / "s.sock").exists() and not (tmp_path / "busy").exists()  # (the port is tried before the socket is made)


@pytest.mark.parametrize("fields, message", [
    ({"service_lookup_timeout_s": 0}, "TierConfig.service_lookup_timeout_s must be a number > 0; got 0"),
    ({"service_timeout_s": -1.0}, "TierConfig.service_timeout_s must be a number > 0; got -1"),
    ({"service_lookup_timeout_s": "fast"}, "TierConfig.service_lookup_timeout_s must be a number > 0; got 'fast'"),
    ({"service_timeout_s": 1.0, "service_lookup_timeout_s": 2.0}, "longer than service_timeout_s=1 (a call's whole deadline); lower it"),
])
def test_the_service_deadlines_bad_values_are_a_config_error_naming_the_field(fields, message):
    with pytest.raises(ConfigError) as e:
        TierConfig(service="/run/kvtier/node.sock", **fields)
    assert message in str(e.value)


def test_the_deadlines_an_engine_attaches_with_are_its_tier_configs(tmp_path):
    """The lookup deadline defaults to the smaller of 0.25 s and the call deadline; attaching again keeps both."""
    with running_service(tmp_path) as svc:
        for fields, want in [({}, (10.0, 0.25)), ({"service_timeout_s": 0.1}, (0.1, 0.1)),
                             ({"service_timeout_s": 3.0, "service_lookup_timeout_s": 0.5}, (3.0, 0.5))]:
            cache = build_cache(SPEC, TierConfig(device_pages=16, host_pages=32, service=svc.socket, **fields))
            try:
                client = cache.host.allocator.client
                again = client.again()
                assert (client.deadline_s, client.lookup_deadline_s) == want == (again.deadline_s, again.lookup_deadline_s)
                again.close()
            finally:
                cache.close()


def test_kvtier_run_through_the_service_twice_the_second_engine_starts_with_the_first_ones_host_tier(tmp_path):
    import json

    from support.cli import SMALL, kvtier

    with running_service(tmp_path, host_gb=0.2) as svc:
        reports = []
        for _ in range(2):  # two engine processes one after the other: a restart
            r = kvtier("run", "--no-progress", "--json", "-", "--tiers-service", svc.socket, *SMALL, timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
            reports.append(json.loads(r.stdout))
        for rep in reports:
            assert rep["logits_bit_exact"] and rep["storage_url"] is None
        first, second = (rep["stats"] for rep in reports)
        # (the first takes pages back too: ones its own host LRU let go, which the service kept beyond its share)
        assert second["shared_host_pages"] > first["shared_host_pages"]
        assert second["host_hit_pages"] > first["host_hit_pages"]


def test_a_rank_maps_its_slice_of_the_region_alone_sharing_bytes_with_a_whole_mapping(tmp_path):
    """``map_region(offset=, length=)`` (a tensor-parallel rank's slice): the same bytes as the whole
    region's mapping at that offset, both ways; a slice off a 4 KiB boundary or past the end is refused;
    without CUDA nothing is registered (``pin`` asked or not) and nothing fails."""
    from kvtier.service.region import create_region, map_region, remove_region

    fmt = RegionFormat.of(SPEC, "page_first")
    region = create_region(fmt, 8 * fmt.page_bytes, parent=str(tmp_path))
    try:
        whole = map_region(region.path, region.size, pin=True)
        start, size = 4096, region.size - 8192
        part = map_region(region.path, region.size, offset=start, length=size, pin=True)
        assert not whole.is_pinned() and not part.is_pinned()
        part[:5] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
        whole[start + size - 1] = 9
        assert whole[start : start + 5].tolist() == [1, 2, 3, 4, 5] and part[-1].item() == 9
        for offset, length in ((100, 4096), (0, region.size + 1), (region.size, 4096)):
            with pytest.raises(ServiceError, match="not a mappable slice"):
                map_region(region.path, region.size, offset=offset, length=length)
    finally:
        remove_region(region)
