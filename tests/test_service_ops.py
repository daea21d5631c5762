"""``kvtier serve``'s operations (issue 46, parts 6 and 7): its Prometheus metrics scraped over HTTP from a
real service with real engines attached, the values what happened, and an engine's own metrics counting
the service as its host tier; and ``--allow-group``: real processes
of another uid (forked children that drop root) admitted only as members of the group, the region
shared read-write with them, anyone else refused while the service goes on serving. Every wait bounded."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import signal
import stat
import tempfile
import urllib.request
from pathlib import Path

import pytest

from support.service import (OtherUser, as_other_user, frame, peer_report, raw_connection, read_answer, running_service,
                             scrape_metrics, start_peer, wait_until)
from support.cache_helpers import expected_page
from support.service_peer import NAMESPACE, PROMPT, PUBLISHED, SPEC, UNPUBLISHED, fill

from kvtier.build import build_cache
from kvtier.config import TierConfig
from kvtier.metrics import PrometheusCollector
from kvtier.pools.host import HostPool
from kvtier.service.client import ServiceClient, SessionWriter, query_status
from kvtier.service.region import RegionFormat, map_region

pytestmark = pytest.mark.timeout(300)

PAGES = len(PROMPT) // SPEC.page_size
FMT = RegionFormat.of(SPEC, "page_first")
#: ids nobody on this machine uses (the tests run as root and become them in forked children)
GROUP, MEMBER, PRIMARY_MEMBER, STRANGER = 54320, 54321, 54322, 54323
#: the service's uid (this process's), which another user's engine names to attach to it (TierConfig.service_uid)
SERVICE_UID = os.getuid()


def _pages(m: dict, ns: str) -> dict[str, float]:
    return {state: m[("kvtier_service_pages", (("namespace", ns), ("state", state)))] for state in ("published", "held", "leased")}


def _counter(m: dict, name: str, **labels) -> float:
    return m[(f"kvtier_service_{name}_total", tuple(sorted(labels.items())))]


def test_metrics_scraped_over_http_are_what_happened_with_real_engines_attached(tmp_path):
    with running_service(tmp_path, 0.01, "--metrics-port", "0") as svc:
        url = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", svc.banner).group(1)
        m = scrape_metrics(url)
        assert m[("kvtier_service_region_pages", ())] == 0 and m[("kvtier_service_clients", (("state", "attached"),))] == 0
        # engine A computes a prompt (its backups published, held while it stays attached); engine B loads it from host
        a = start_peer("compute", svc.socket)
        try:
            assert peer_report(a)["backed_up"] == PAGES
            b = start_peer("load", svc.socket, str(tmp_path / "b.bin"))
            assert peer_report(b)["shared_host_pages"] == PAGES
            assert b.wait(60) == 0, b.stderr.read()
            (engine_ns,) = query_status(svc.socket)["pages_per_namespace"]
            m = scrape_metrics(url)
            num_pages = query_status(svc.socket)["num_pages"]
            assert m[("kvtier_service_region_pages", ())] == num_pages
            assert m[("kvtier_service_region_bytes", ())] == num_pages * FMT.page_bytes
            assert _pages(m, engine_ns) == {"published": PAGES, "held": PAGES, "leased": 0}  # A holds its pages; B let go
            assert m[("kvtier_service_bytes", (("namespace", engine_ns), ("state", "published")))] == PAGES * FMT.page_bytes
            assert _counter(m, "lookup_hit_pages", namespace=engine_ns) == PAGES  # B's host hits, every page of the prompt
            assert _counter(m, "published_pages") == PAGES
            assert m[("kvtier_service_clients", (("state", "attached"),))] == 1  # A (B exited)
            # a writer killed mid-write: its 2 unpublished pages' leases expire
            writer = start_peer("write-and-hang", svc.socket)
            peer_report(writer)
            assert _pages(scrape_metrics(url), NAMESPACE) == {"published": 2, "held": 2, "leased": 2}
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(30)
            wait_until(lambda: query_status(svc.socket)["writing"] == 0, 2.0)
            # a raw client's lookup in that namespace: the 2 published pages hit, the unpublished key misses
            reader = ServiceClient(svc.socket, NAMESPACE, FMT)
            assert len(reader.lookup(PUBLISHED + UNPUBLISHED[:1])) == 2
            # a peer that breaks the protocol
            s = raw_connection(svc.socket)
            s.sendall(frame({"seq": 1, "ops": [{"op": "format_disk"}]}))
            assert "error" in read_answer(s)
            s.close()
            m = scrape_metrics(url)
            assert _pages(m, NAMESPACE) == {"published": 2, "held": 2, "leased": 0}  # held by the reader now
            assert (_counter(m, "lookup_hit_pages", namespace=NAMESPACE), _counter(m, "lookup_miss_pages", namespace=NAMESPACE)) == (2, 1)
            assert (_counter(m, "dropped_writes"), _counter(m, "expired_leases"), _counter(m, "published_pages")) == (2, 2, PAGES + 2)
            assert (_counter(m, "protocol_errors"), _counter(m, "refused_peers"), _counter(m, "unread_drops")) == (1, 0, 0)
            assert m[("kvtier_service_clients", (("state", "attached"),))] == 2
            writer = SessionWriter(svc.socket, reader.session)  # (a vLLM worker of the reader's engine)
            assert scrape_metrics(url)[("kvtier_service_clients", (("state", "writers"),))] == 1
            writer.close()
            # a salted namespace: its salt (a secret of its engines) never appears, a digest of it stands for it
            salted = ServiceClient(svc.socket, "model-fp-tp0-sEcReT%2Dsalt", FMT)
            assert salted.lookup(PUBLISHED) == []
            salted.close()
            with urllib.request.urlopen(url, timeout=10) as r:
                assert "sEcReT" not in r.read().decode()
            label = "model-fp-tp0-#" + hashlib.blake2b(b"sEcReT%2Dsalt", digest_size=4).hexdigest()
            assert _counter(scrape_metrics(url), "lookup_miss_pages", namespace=label) == 2
            # the reader detaches quiesced: its holds released, nothing expired; the pages stay published, held by nobody
            reader.close()
            wait_until(lambda: _pages(scrape_metrics(url), NAMESPACE)["held"] == 0, 2.0)
            m = scrape_metrics(url)
            assert _pages(m, NAMESPACE) == {"published": 2, "held": 0, "leased": 0} and _counter(m, "expired_leases") == 2
        finally:
            a.communicate("done\n", timeout=60)
        # a dropped client whose process lives is counted as orphaned, its leases apart; its exit expires them
        x = start_peer("violate", svc.socket)
        try:
            peer_report(x)
            m = scrape_metrics(url)
            assert m[("kvtier_service_clients", (("state", "orphaned"),))] == 1 and _pages(m, NAMESPACE)["leased"] == 2
            assert _counter(m, "protocol_errors") == 2
        finally:
            x.communicate("exit\n", timeout=60)
        m, _ = wait_until(lambda: (m := scrape_metrics(url))[("kvtier_service_clients", (("state", "orphaned"),))] == 0 and m, 2.0)
        assert _counter(m, "expired_leases") == 4 and _pages(m, NAMESPACE)["leased"] == 0


def test_an_engines_own_metrics_count_the_service_as_its_host_tier(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    with running_service(tmp_path, 0.01, "--metrics-port", "0") as svc:
        url = re.search(r"metrics on (http://\S+)", svc.banner).group(1)
        a = start_peer("compute", svc.socket)  # another engine computed the prompt and published it
        try:
            assert peer_report(a)["backed_up"] == PAGES
            cache = build_cache(SPEC, TierConfig(device_pages=16, host_pages=32, service=svc.socket))  # this process's engine
            try:
                registry = CollectorRegistry()
                registry.register(PrometheusCollector(lambda: cache.stats.snapshot(), labels={"engine": "b"}))
                req = cache.begin(PROMPT)
                req.wait()
                assert [cache.device.page_bytes(p) for p in req.cached_pages] == [expected_page(SPEC, PROMPT, i) for i in range(PAGES)]
                req.commit(req.cached_pages)
                cache.wait_idle()
                text = generate_latest(registry).decode()
                engine = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
            finally:
                cache.close()
            # the engine's own tiers: every page a host hit, all of them taken from the service; nothing from device or L3
            assert engine["kvtier_host_hit_pages_total"] == engine["kvtier_shared_host_pages_total"] == PAGES, engine
            assert engine["kvtier_device_hit_pages_total"] == engine["kvtier_storage_hit_pages_total"] == 0
            # and the service's view of the same lookups
            (ns,) = query_status(svc.socket)["pages_per_namespace"]
            assert _counter(scrape_metrics(url), "lookup_hit_pages", namespace=ns) == PAGES
        finally:
            a.communicate("done\n", timeout=60)


def test_the_metrics_server_goes_when_the_service_stops(tmp_path):
    with running_service(tmp_path, 0.01, "--metrics-port", "0") as svc:
        url = re.search(r"metrics on (http://\S+)", svc.banner).group(1)
        assert scrape_metrics(url)[("kvtier_service_free_pages", ())] == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)


# ---- --allow-group ------------------------------------------------------------------------------------
#: a child becomes another user only from root (the tests' own machine runs them as root)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user in a forked child needs root")


@pytest.fixture
def reachable_tmp():
    """A temp directory other users may pass through (pytest's own is its user's alone), removed after."""
    path = tempfile.mkdtemp(prefix="kvtier-allow-group-")
    os.chmod(path, 0o711)
    yield os.path.realpath(path)
    shutil.rmtree(path, ignore_errors=True)


def _attach_read_and_write(sock: str, byte: int) -> dict:
    """As the child: attach, look up PUBLISHED[0] (the parent filled it with ``byte``), check its bytes in
    the mapped region, then write and publish a page of its own (key UNPUBLISHED[0], bytes 0x5C)."""
    client = ServiceClient(sock, NAMESPACE, FMT, service_uid=SERVICE_UID)
    pool = HostPool(SPEC, client.num_pages, "page_first", memory=client.map_region())
    (page,) = client.lookup(PUBLISHED[:1])
    read_right = all(bool((t[page] == byte).all()) for t in pool.buffers.values())
    mine = client.reserve(1)
    fill(pool, mine, 0x5C)
    client.publish(mine, UNPUBLISHED[:1])
    client.status()  # (a round trip: applied)
    client.close()
    return {"read_right": read_right, "wrote": mine}


def _attach(sock: str) -> dict:
    client = ServiceClient(sock, NAMESPACE, FMT, service_uid=SERVICE_UID)
    client.close()
    return {"attached": True}


def _mode(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_gid


@needs_root
def test_another_users_processes_attach_only_as_members_of_the_allowed_group(reachable_tmp):
    with running_service(Path(reachable_tmp), 0.01, "--allow-group", str(GROUP)) as svc:
        owner = ServiceClient(svc.socket, NAMESPACE, FMT)  # the service's own user, attached throughout
        try:
            pool = HostPool(SPEC, owner.num_pages, "page_first", memory=map_region(owner.region, owner.region_size))
            page = owner.reserve(1)
            fill(pool, page, 0xAB)
            owner.publish(page, PUBLISHED[:1])
            # the kernel's gate opened to the group only: directory 0750, socket and region 0660, of the group
            assert _mode(os.path.dirname(svc.socket)) == (0o750, GROUP) and _mode(svc.socket) == (0o660, GROUP)
            assert _mode(owner.region) == (0o660, GROUP) and _mode(os.path.dirname(owner.region)) == (0o750, GROUP)
            # a member (a supplementary group) attaches, reads the owner's page and writes one the owner reads, bit-exact
            got = as_other_user(OtherUser(MEMBER, MEMBER, (GROUP,)), lambda: _attach_read_and_write(svc.socket, 0xAB))
            assert got.get("read_right") is True, got
            assert owner.lookup(UNPUBLISHED[:1]) == got["wrote"]
            assert all(bool((t[got["wrote"]] == 0x5C).all()) for t in pool.buffers.values())
            # a member by its primary gid
            assert as_other_user(OtherUser(PRIMARY_MEMBER, GROUP), lambda: _attach(svc.socket)) == {"attached": True}
            # not a member: the directory keeps it from the socket
            got = as_other_user(OtherUser(STRANGER, STRANGER), lambda: _attach(svc.socket))
            assert got["error"] == "ServiceAccessError" and "Permission denied" in got["message"], got
            # not a member, yet it reaches the socket (its filesystem gid is the group's): the service's own check refuses it
            got = as_other_user(OtherUser(STRANGER, STRANGER, fsgid=GROUP), lambda: _attach(svc.socket))
            assert got["error"] == "ServiceAccessError", got
            assert f"runs as uid {STRANGER}, gid {STRANGER}, groups []; this node service admits uid 0 and group {GROUP}" in got["message"]
            st = owner.status()  # the service went on serving its clients throughout
            assert (st["refused"], st["clients"], st["ready"]) == (1, 1, 2)
        finally:
            owner.close()


@needs_root
def test_without_allow_group_another_users_process_is_refused_and_the_service_goes_on(reachable_tmp):
    with running_service(Path(reachable_tmp)) as svc:
        owner = ServiceClient(svc.socket, NAMESPACE, FMT)
        try:
            assert _mode(os.path.dirname(svc.socket))[0] == 0o700 and _mode(svc.socket)[0] == 0o600
            assert _mode(owner.region)[0] == 0o600 and _mode(os.path.dirname(owner.region))[0] == 0o700
            got = as_other_user(OtherUser(MEMBER, MEMBER, (GROUP,)), lambda: _attach(svc.socket))
            assert got["error"] == "ServiceAccessError" and "Permission denied" in got["message"], got  # the directory's gate
            # one that reaches the socket all the same (its filesystem uid is the service's): refused by its effective uid
            got = as_other_user(OtherUser(MEMBER, MEMBER, saved_uid=0, fsuid=0), lambda: _attach(svc.socket))
            assert got["error"] == "ServiceAccessError", got
            assert f"runs as uid {MEMBER}; this node service admits uid 0 only" in got["message"]
            st = owner.status()
            assert (st["refused"], st["clients"]) == (1, 1)
            assert owner.reserve(1)  # still serving
        finally:
            owner.close()


def test_allow_group_refuses_a_socket_its_group_could_never_reach(tmp_path):
    """``--allow-group`` with the socket below a directory the group cannot pass through (the default
    ``$XDG_RUNTIME_DIR`` is one: 0700): a ConfigError naming that directory, nothing made below it."""
    from kvtier.errors import ConfigError
    from kvtier.service.peer import private_socket_dir

    walled = tmp_path / "walled"
    walled.mkdir(mode=0o700)
    os.chmod(walled, 0o700)
    sock = walled / "kvtier" / "node.sock"
    with pytest.raises(ConfigError, match=f"cannot pass through {walled} .*mode 700.*could never reach the socket"):
        private_socket_dir(str(sock), os.getuid(), 54321)
    assert not sock.parent.exists()
    open_to_all = tempfile.mkdtemp(prefix="kvtier-group-", dir="/tmp")  # (pytest's own tmp tree is 0700)
    try:
        os.chmod(open_to_all, 0o755)
        private_socket_dir(os.path.join(open_to_all, "kvtier", "node.sock"), os.getuid(), 54321)  # every directory above lets it through
        assert stat.S_IMODE(os.stat(os.path.join(open_to_all, "kvtier")).st_mode) == 0o750
    finally:
        shutil.rmtree(open_to_all)


def test_a_share_larger_than_the_region_is_warned_of_and_held_to_it_and_the_per_engine_view_shows_each_engine(tmp_path, caplog):
    from kvtier.service.attach import attach_pages

    with running_service(tmp_path, 0.01, "--metrics-port", "0") as svc:
        url = re.search(r"metrics on (http://\S+)", svc.banner).group(1)
        with caplog.at_level(logging.WARNING, logger="kvtier.service.leased"):
            big = attach_pages(svc.socket, FMT, NAMESPACE, 1_000_000)
        try:
            n = big.client.num_pages
            assert big.share == n < 1_000_000 and big.share_asked == 1_000_000
            assert f"holds {n} pages in its region, fewer than this engine's host share of 1000000" in caplog.text
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="kvtier.service.leased"):
                whole = attach_pages(svc.socket, FMT, NAMESPACE, None)  # (no share given: the region)
            assert whole.share == n and whole.share_asked is None and not caplog.records
            # the first engine writes 3 pages and publishes 2; the second is offered those 2
            got = big.alloc(3).pages
            big.publish(PUBLISHED[:2], got[:2])
            assert whole.lookup(PUBLISHED[:2]) == got[:2]
            # the per-engine view: each engine's process, namespace, share (and what of it the region lacks), pages, hits
            engines = {e["client"]: e for e in query_status(svc.socket)["engines"]}
            assert sorted((e["share_pages"], e["share_short_pages"], e["held"], e["leased"], e["hit_pages"]) for e in engines.values()) == [
                (n, 0, 2, 0, 2), (1_000_000, 1_000_000 - n, 2, 1, 0)]
            assert {(e["pid"], e["namespace"]) for e in engines.values()} == {(os.getpid(), NAMESPACE)}
            m = scrape_metrics(url)
            for e in engines.values():
                who = (("client", str(e["client"])), ("namespace", NAMESPACE), ("pid", str(os.getpid())))
                assert m[("kvtier_service_engine_share_short_pages", who)] == e["share_short_pages"]
                assert m[("kvtier_service_engine_hit_pages_total", who)] == e["hit_pages"]
                assert m[("kvtier_service_engine_pages", (*who, ("state", "leased")))] == e["leased"]
            whole.close(quiesced=True)
        finally:
            big.close(quiesced=True)
