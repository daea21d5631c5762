"""Bytes verified across every restart (issue 54, items 5 and 6): each region page carries a checksum the
service takes when its write completes; a hit is verified before it is offered (``--verify-sample``: all
of them here), and a page whose bytes changed since is never handed out. A service SIGKILLed and started
again on its socket adopts the region it left: every page it offers again verified, pages being written
at the crash parked, never offered; a region of another version or size is removed, never misread.
Real service subprocesses on a temp socket, real engine processes, bytes checked bit-exact."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from contextlib import contextmanager

import pytest

from support.cache_helpers import expected_page
from support.service import peer_report, query_status_of, remove_regions, start_peer, start_service, stop, wait_until
from support.service_peer import NAMESPACE, PROMPT, PUBLISHED, SPEC, UNPUBLISHED, fill

from kvtier.pools.host import HostPool
from kvtier.service.client import ServiceClient
from kvtier.service.region import FORMAT_FILE, RegionFormat, map_region

pytestmark = pytest.mark.timeout(300)

PAGES = len(PROMPT) // SPEC.page_size
FMT = RegionFormat.of(SPEC, "page_first")


class Node:
    """``kvtier serve`` on ``tmp_path``'s socket, which a test kills and starts again (``args``: its options); every
    region it made is removed at the end (:func:`node`)."""

    def __init__(self, tmp_path, *args: str):
        self.sock = str(tmp_path / "run" / "node.sock")
        self.status = query_status_of(self.sock)
        self.regions: list[str] = []
        self.svc = start_service(self.sock, 0.01, *args)

    def region(self) -> str:
        """The region now (made at the first attach), remembered for removal."""
        region = self.status()["region"]
        self.regions.append(region)
        return region

    def kill(self) -> None:
        os.kill(self.svc.proc.pid, signal.SIGKILL)
        self.svc.proc.wait(30)

    def start(self, *args: str, host_gb: float = 0.01) -> str:
        """A new service on the socket; its banner."""
        self.svc = start_service(self.sock, host_gb, *args)
        return self.svc.banner

    def restart(self, *args: str, host_gb: float = 0.01) -> str:
        """SIGKILL the service, start another on its socket; its banner."""
        self.kill()
        return self.start(*args, host_gb=host_gb)

    def stop(self) -> int:
        return stop(self.svc.proc)


@contextmanager
def node(tmp_path, *args: str):
    n = Node(tmp_path, *args)
    try:
        yield n
    finally:
        n.stop()
        remove_regions(n.regions)


def _ended(proc) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(30)


def _pool(client: ServiceClient) -> HostPool:
    return _pool_at(client.region, client.region_size, client.num_pages)


def _pool_at(region: str, size: int, num_pages: int) -> HostPool:
    return HostPool(SPEC, num_pages, "page_first", memory=map_region(region, size, pin=False))


def _flip(pool: HostPool, page: int) -> None:
    """One bit of ``page``'s indexer bytes changed in the region, as a stray write or a bit flip would."""
    pool.buffers["indexer"][page].view(-1)[7] ^= 0x10


def _computed_then_loaded(sock: str, tmp_path, name: str) -> dict:
    """An engine process loads :data:`PROMPT` through the service at ``sock``; its report, its cached bytes checked."""
    out = tmp_path / f"{name}.bin"
    peer = start_peer("load", sock, str(out))
    rep = peer_report(peer)
    assert peer.wait(60) == 0, peer.stderr.read()[-3000:]
    assert out.read_bytes() == b"".join(expected_page(SPEC, PROMPT, i) for i in range(rep["cached"])), "a cached page's bytes are wrong"
    return rep


def test_a_service_sigkilled_and_started_again_adopts_its_region_and_engines_get_the_pages_bit_exact(tmp_path):
    computer = None
    with node(tmp_path, "--verify-sample", "1") as n:
        try:
            computer = start_peer("compute", n.sock)
            assert peer_report(computer)["backed_up"] == PAGES
            wait_until(lambda: n.status()["published_pages"] == PAGES, 30)  # (its publish is a note: applied by now)
            region = n.region()
            # (the engine that wrote the pages lives on: they are published, its lease is gone with the service)
            assert f"its region adopted: {PAGES} pages verified" in n.restart("--verify-sample", "1", "--keep-region")
            st = n.status()
            assert st["region"] == region and st["adopted"]["pages"] == PAGES and st["adopted"]["dropped_pages"] == 0, st
            rep = _computed_then_loaded(n.sock, tmp_path, "after-kill")
            assert (rep["host_hit"], rep["cached"]) == (PAGES, PAGES), rep  # host hits kept across the restart
            assert n.status()["verify"]["verified_pages"] >= PAGES and n.status()["verify"]["failed_pages"] == 0
            computer.stdin.close()
            computer.wait(60)
            # an upgrade: SIGTERM with --keep-region leaves the region; the next service adopts it again
            assert n.stop() == 0 and os.path.exists(region)
            n.start("--verify-sample", "1")
            assert n.status()["adopted"]["pages"] == PAGES
            assert _computed_then_loaded(n.sock, tmp_path, "after-upgrade")["host_hit"] == PAGES
            assert n.stop() == 0 and not os.path.exists(region)  # (without --keep-region, SIGTERM removes it)
        finally:
            _ended(computer)


def test_a_page_whose_bytes_change_after_its_write_completed_is_never_handed_out(tmp_path):
    with node(tmp_path, "--verify-sample", "1") as n:
        writer = ServiceClient(n.sock, NAMESPACE, FMT)
        pool = _pool(writer)
        pages = writer.reserve(3)
        keys = [bytes([i]) * 16 for i in (7, 8, 9)]
        fill(pool, pages, 0xAB)
        writer.publish(pages, keys)
        writer.status()  # (a round trip on the same connection: the publish, a note, is applied and its checksums taken)
        _flip(pool, pages[1])  # after its write completed: its checksum is of the bytes before
        reader = ServiceClient(n.sock, NAMESPACE, FMT)
        assert reader.lookup(keys) == pages[:1]  # the run ends before the changed page: a miss from there
        assert reader.lookup(keys[1:]) == []  # dropped: never offered again
        st = n.status()
        assert (st["corrupt_pages"], st["verify"]["failed_pages"]) == (1, 1), st
        writer.release(pages)  # its writer held it: freed now, not evicted later
        writer.status()  # (the release is a note: applied once this call on its connection is answered)
        assert n.status()["free"] == st["free"] + 1
        # an engine: every page of a prompt changed after its backup -> no host hit, the prompt computed, right bytes
        computer = start_peer("compute", n.sock)
        try:
            assert peer_report(computer)["backed_up"] == PAGES
            # (its publish is a note: applied, and the pages' checksums taken, once the service counts them)
            wait_until(lambda: n.status()["published_pages"] == 3 + PAGES, 30)
            for p in range(writer.num_pages):  # (the engine's pages among them)
                _flip(pool, p)
            rep = _computed_then_loaded(n.sock, tmp_path, "flipped")
            assert (rep["host_hit"], rep["cached"]) == (0, 0), rep
            assert n.status()["corrupt_pages"] >= 2, n.status()  # (the first page of the engine's run refused: the run ended there)
            computer.stdin.close()
            assert computer.wait(60) == 0, computer.stderr.read()[-3000:]
        finally:
            _ended(computer)
        writer.close()
        reader.close()


def test_a_restarted_service_never_offers_a_half_written_page_nor_one_changed_while_it_was_down(tmp_path):
    hanger = None
    with node(tmp_path) as n:
        try:
            hanger = start_peer("write-and-hang", n.sock)  # 4 pages written, 2 published, 2 mid-write
            pages = peer_report(hanger)["pages"]
            region = n.region()
            n.restart("--verify-sample", "0")  # (what is adopted is verified whatever the sample)
            st = n.status()
            assert (st["adopted"]["pages"], st["adopted"]["parked_pages"], st["parked_pages"]) == (2, 2, 2), st
            reader = ServiceClient(n.sock, NAMESPACE, FMT)
            assert reader.lookup(PUBLISHED + UNPUBLISHED) == pages[:2]  # the published ones; the half-written ones never
            assert all(bool((t[pages[:2]] == 0xEE).all()) for t in _pool(reader).buffers.values())
            # the parked pages stay out of circulation: a reservation of every free page never gets one
            got = reader.reserve(reader.num_pages)
            assert not set(got) & set(pages) and len(got) == reader.num_pages - 4
            reader.release(got)
            reader.close()
            # a page changed while no service ran is dropped when the next one adopts the region
            n.kill()
            _ended(hanger)
            _flip(_pool_at(region, os.stat(region).st_size, st["num_pages"]), pages[0])
            n.start()
            st = n.status()
            assert (st["adopted"]["pages"], st["adopted"]["dropped_pages"]) == (1, 1), st
            reader = ServiceClient(n.sock, NAMESPACE, FMT)
            assert reader.lookup(PUBLISHED) == []  # the first key's page was the changed one
            assert reader.lookup(PUBLISHED[1:]) == pages[1:2]
            reader.close()
        finally:
            _ended(hanger)


@pytest.mark.parametrize("change", ["version", "host-gb", "fresh", "l3"])
def test_a_region_a_restarted_service_cannot_adopt_is_removed_never_misread(tmp_path, change):
    with node(tmp_path) as n:
        # ("l3": a page whose format names no spec -- SGLang's rows -- which a service with an L3 tier cannot store)
        fmt = dataclasses.replace(FMT, fingerprint="rows", spec=None) if change == "l3" else FMT
        client = ServiceClient(n.sock, NAMESPACE, fmt)
        client.publish(client.reserve(2), PUBLISHED)
        client.status()
        folder = os.path.dirname(n.region())
        n.kill()
        client.close()
        if change == "version":
            doc = json.loads(open(os.path.join(folder, FORMAT_FILE)).read())
            with open(os.path.join(folder, FORMAT_FILE), "w") as f:
                json.dump(doc | {"version": 999}, f)
        args = {"version": [], "host-gb": [], "fresh": ["--fresh-region"], "l3": ["--storage-url", f"file://{tmp_path / 'store'}"]}
        n.start(*args[change], host_gb=0.02 if change == "host-gb" else 0.01)
        assert not os.path.exists(folder)  # removed before anyone attached
        assert "adopted" not in n.status()
        client = ServiceClient(n.sock, NAMESPACE, FMT)  # a new region, empty
        assert n.region() != os.path.join(folder, "region") and client.lookup(PUBLISHED) == []
        client.close()


def test_an_adopted_region_the_first_engine_cannot_use_is_replaced_by_a_fresh_one(tmp_path):
    from support.pools import tiny_specs

    with node(tmp_path) as n:
        client = ServiceClient(n.sock, NAMESPACE, FMT)
        client.publish(client.reserve(1), PUBLISHED[:1])
        client.status()
        region = n.region()
        n.restart()
        client.close()
        other = RegionFormat.of(tiny_specs()["mha"], "page_first")
        client = ServiceClient(n.sock, "service-test-other", other)  # another model: the adopted region is no use to it
        assert n.region() != region and not os.path.exists(region)
        client.close()


def test_pages_parked_at_a_restart_are_freed_when_their_writer_attaches_again_naming_its_session_and_only_then(tmp_path):
    hanger = None
    with node(tmp_path) as n:
        try:
            hanger = start_peer("write-and-hang", n.sock)  # another process: 2 pages mid-write
            theirs = peer_report(hanger)["session"]
            mine = ServiceClient(n.sock, NAMESPACE, FMT)  # this process: 3 pages mid-write
            mine.reserve(3)
            n.region()
            n.restart()
            assert n.status()["parked_pages"] == 5
            ServiceClient(n.sock, NAMESPACE, FMT, previous=theirs).close()  # a session id alone frees nothing: not this process's
            assert n.status()["parked_pages"] == 5
            ServiceClient(n.sock, NAMESPACE, FMT, previous=mine.session).close()  # its own, quiesced: its 3 pages are free
            st = n.status()
            assert (st["parked_pages"], st["free"]) == (2, st["num_pages"] - 2 - 2), st  # (the hanger's 2 published pages adopted)
            mine.close()
        finally:
            _ended(hanger)


def test_pages_being_written_when_the_service_is_stopped_stay_parked_by_the_next_one_while_their_writer_lives(tmp_path):
    """The soak's find: a SIGTERMed service (--keep-region) ends its engines' sessions; a page one was writing must
    not look free to the next service (its copy may still land, and the engine may read it back as its own)."""
    with node(tmp_path, "--keep-region") as n:
        writer = ServiceClient(n.sock, NAMESPACE, FMT)  # this process, alive throughout
        pages = writer.reserve(3)
        n.region()
        assert n.stop() == 0
        n.start()
        st = n.status()
        assert (st["parked_pages"], st["free"]) == (3, st["num_pages"] - 3), st
        got = ServiceClient(n.sock, NAMESPACE, FMT).reserve(st["num_pages"])
        assert not set(got) & set(pages)
        writer.close()
