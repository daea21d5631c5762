"""``kvtier serve --storage-url`` (issue 46): the service's L3 tier below its region. Pages engines publish
are saved (write-through; SIGTERM drains what is under way) as the objects an engine's own L3 writes; a
lookup whose run in the region ends early brings the rest in from the store, verified, as host hits; a
damaged object is never served; a stalled store holds none of the service's clients past the lookup's
bound; a bad URL is one line and exit 2. Real ``kvtier serve`` subprocesses on temp sockets, a file store
in tmp_path (and a real redis-server), bytes checked bit-exact, every wait bounded."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import closing, contextmanager

import pytest
from xxhash import xxh3_128_hexdigest

from support.cache_helpers import expected_page, write_page
from support.proxies import Injecting
from support.service import (ENV, ROOT, closed_by_peer, frame, peer_report, query_status_of, raw_connection, read_answer, remove_regions,
                             scrape_metrics, start_peer, start_service, stop, wait_until)
from support.service_peer import PATIENT_LOOKUP_S, PROMPT, SPEC, Serving, prompt

from kvtier.app.devservers import RedisServer
from kvtier.build import build_cache
from kvtier.config import StorageConfig, TierConfig
from kvtier.pools.host import HostPool
from kvtier.service.client import ServiceClient
from kvtier.service.messages import MAX_WAIT_S, Hello
from kvtier.service.region import RegionFormat, RowObject, map_region, rows_fingerprint
from kvtier.l3.page import HEADER_BYTES
from kvtier.l3.registry import open_backend
from kvtier.service.server import NodeService, ServeConfig

pytestmark = pytest.mark.timeout(600)

PAGES = len(PROMPT) // SPEC.page_size
WANT = b"".join(expected_page(SPEC, PROMPT, i) for i in range(PAGES))
#: the longest a request may take while the store stalls (the service answers a lookup within the wait it names)
STALL_BOUND_S = 2.0


def _start(sock: str, url: str, *args: str):
    return start_service(sock, 0.01, "--storage-url", url, "--drain-timeout-s", "30", *args)


def _load(role: str, target: str, out) -> dict:
    """A new engine process loads :data:`PROMPT`; its report, its bytes checked bit-exact."""
    peer = start_peer(role, target, str(out))
    report = peer_report(peer)
    assert peer.wait(60) == 0, peer.stderr.read()[-3000:]
    assert out.read_bytes() == WANT[: report["cached"] * len(WANT) // PAGES]
    return report


@pytest.fixture
def file_url(tmp_path):
    return f"file://{tmp_path / 'l3'}"


def _saves_l3_on_sigterm_then_serves_them_through_a_new_service(tmp_path, url: str) -> None:
    sock = str(tmp_path / "run" / "node.sock")
    svc = _start(sock, url)
    a = start_peer("compute", sock)
    try:
        assert peer_report(a)["backed_up"] == PAGES  # published: saved through, or pending when SIGTERM comes
        assert stop(svc.proc) == 0  # SIGTERM with the engine attached: it drains the saves, then removes socket and region
        assert not os.path.exists(sock)
    finally:
        a.communicate("done\n", timeout=60)
        stop(svc.proc)
    assert a.returncode == 0, a.stderr  # the engine went on without its service
    # the objects are an engine's own L3's: one with no service and that store finds the whole prompt there
    own = _load("load-store", url, tmp_path / "own.bin")
    assert (own["storage_hit"], own["cached"]) == (PAGES, PAGES)
    # a new service on the same store: a new engine's lookup brings the prompt in from L3, a host hit through the service
    svc = _start(sock, url)
    try:
        report = _load("load-l3", sock, tmp_path / "b.bin")
        assert report == {"device_hit": 0, "host_hit": PAGES, "storage_hit": 0, "cached": PAGES, "shared_host_pages": PAGES}
        l3 = query_status_of(sock)()["l3"]
        assert (l3["found_pages"], l3["fetched_pages"], l3["fetch_failed_pages"], l3["corrupt_pages"]) == (PAGES, PAGES, 0, 0)
    finally:
        assert stop(svc.proc) == 0


def test_a_prefix_saved_by_a_service_stopped_with_sigterm_is_a_host_hit_through_a_new_service_bit_exact(tmp_path, file_url):
    _saves_l3_on_sigterm_then_serves_them_through_a_new_service(tmp_path, file_url)


@pytest.mark.integration
def test_the_same_over_redis(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        _saves_l3_on_sigterm_then_serves_them_through_a_new_service(tmp_path, server.url)
    finally:
        server.stop()


def test_an_engine_reattaches_to_a_restarted_service_on_its_own_and_its_l3_hits_resume(tmp_path, file_url):
    sock = str(tmp_path / "run" / "node.sock")
    status = query_status_of(sock)
    svc = _start(sock, file_url)
    engine, regions = None, []
    try:
        engine = Serving(sock, PATIENT_LOOKUP_S)  # this process's engine
        for seed in range(5):  # (25 pages through its 16 device pages: prompt 0 leaves its device)
            engine.request(prompt(seed))
        engine.cache.wait_idle()
        wait_until(lambda: status()["l3"]["saved_pages"] == 5 * PAGES, 60)  # written through as they were published
        regions.append(status()["region"])
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(30)
        svc = _start(sock, file_url, "--fresh-region")  # a new, empty region over the same store (not the killed one's, adopted)
        leased = engine.cache.host.allocator
        seed = 100
        while leased.reattaches == 0:  # new prompts: the engine finds the service gone, forgets its pages, attaches again
            assert seed < 200, "the engine did not attach to the restarted service"
            engine.request(prompt(seed))
            seed += 1
            time.sleep(0.05)
        assert leased.losses == 1 and not leased.lost
        engine.requests = engine.host_hit = engine.bad = 0
        engine.request(prompt(0))  # in neither the engine nor the new region: the service fetches it from L3
        assert (engine.host_hit, engine.bad) == (PAGES, 0)
        assert status()["l3"]["fetched_pages"] == PAGES
        regions.append(status()["region"])
        engine.cache.wait_idle()
        engine.cache.check_integrity(idle=True)
    finally:
        if engine is not None:
            engine.cache.close()
        stop(svc.proc)
        remove_regions(regions)  # (a SIGKILLed service leaves its region behind)


#: the drain's bound in the tests below that run the service in this process (s)
DRAIN_S = 3.0


def _held_store_service(sock: str, url: str) -> tuple[NodeService, Injecting, threading.Event]:
    """A service in this process over the store at ``url``, its calls to the store hookable (one page a call),
    and an event for the hooks to wait on."""
    service = NodeService(ServeConfig(host_gb=0.01, socket=sock, storage_url=url, drain_timeout_s=DRAIN_S))
    service.storage.backend = Injecting(service.storage.backend, HEADER_BYTES + SPEC.page_bytes)
    return service, service.storage.backend, threading.Event()


@contextmanager
def _looping(service: NodeService):
    """``service``'s loop on a thread of this process until the block ends (then it is ready to close)."""
    stopped = threading.Event()
    loop = threading.Thread(target=service.serve, args=(stopped.is_set,), daemon=True)
    loop.start()
    try:
        yield
    finally:
        stopped.set()
        loop.join(30)


def _stored_by_an_engines_own_l3(file_url: str) -> tuple[list, str]:
    """An engine with an L3 tier of its own (no service) computes :data:`PROMPT`: its page objects are in the
    store (backed up to its host tier, written through from there), as a service reads them. Their keys and
    namespace."""
    own = build_cache(SPEC, TierConfig(device_pages=16, host_pages=32), storage=StorageConfig(url=file_url))
    req = own.begin(PROMPT)
    new = req.alloc(PAGES)
    for i, page in enumerate(new.pages):
        write_page(own.device, page, PROMPT, i)
    req.commit(new.pages)
    own.wait_idle()
    keys, namespace = own.page_keys(PROMPT), str(own.namespace)
    with closing(open_backend(file_url)) as check:
        wait_until(lambda: check.exists([f"{namespace}/{k.hex()}" for k in keys]) == PAGES, 30)
    own.close()
    return keys, namespace


def test_a_page_being_fetched_is_never_offered_and_the_next_lookup_finds_it_once_verified(tmp_path, file_url):
    keys, namespace = _stored_by_an_engines_own_l3(file_url)
    sock = str(tmp_path / "run" / "node.sock")
    service, store, answer = _held_store_service(sock, file_url)
    store.before_get = lambda _call: answer.wait(60)  # the store's reads hang until told
    try:
        with _looping(service):
            client = ServiceClient(sock, namespace, RegionFormat.of(SPEC, "page_first"), lookup_deadline_s=2.0)
            pool = HostPool(SPEC, client.num_pages, "page_first", memory=map_region(client.region, client.region_size))
            start = time.monotonic()
            assert client.lookup(keys) == []  # answered when its wait ran out (half its deadline), with what the region had
            assert 0.9 < time.monotonic() - start < 2.0
            st = client.status()
            assert (st["writing"], st["ready"], st["l3"]["fetching_pages"]) == (PAGES, 0, PAGES)  # leased to the service
            assert client.lookup(keys) == []  # asked again while they are read in: still offered to nobody
            answer.set()
            wait_until(lambda: client.status()["l3"]["fetched_pages"] == PAGES, 30)
            pages = client.lookup(keys)  # verified and published: the next lookup has them
            assert [pool.page_bytes(p) for p in pages] == [expected_page(SPEC, PROMPT, i) for i in range(PAGES)]
            client.release(pages)
            client.close()
    finally:
        answer.set()
        service.close()


def test_a_load_never_waits_behind_the_saves_of_what_engines_publish(tmp_path, file_url):
    """The store's writes hang (an engine's published prefix is being written through): a lookup of another
    prefix the store holds is still read in and answered within its wait, bit-exact -- loads have a worker
    of their own."""
    keys, namespace = _stored_by_an_engines_own_l3(file_url)
    sock = str(tmp_path / "run" / "node.sock")
    service, store, answer = _held_store_service(sock, file_url)
    store.before_set = lambda _call: answer.wait(60)
    try:
        with _looping(service):
            engine = Serving(sock)
            engine.request(prompt(7))  # published: its save hangs in the store
            engine.cache.wait_idle()
            wait_until(lambda: store.calls("set") >= 1, 30)
            client = ServiceClient(sock, namespace, RegionFormat.of(SPEC, "page_first"), lookup_deadline_s=4.0)
            pool = HostPool(SPEC, client.num_pages, "page_first", memory=map_region(client.region, client.region_size))
            pages = client.lookup(keys)  # read in while the saves hang, answered within its wait (2 s)
            assert [pool.page_bytes(p) for p in pages] == [expected_page(SPEC, PROMPT, i) for i in range(PAGES)]
            assert client.status()["l3"]["saved_pages"] == 0  # the save still hangs
            client.release(pages)
            client.close()
            engine.cache.close()
    finally:
        answer.set()
        service.close()


@pytest.mark.parametrize("store_answers", [True, False], ids=["store-answers", "store-hangs"])
def test_sigterm_drains_the_saves_under_way_within_the_bound(tmp_path, file_url, store_answers):
    """The service in this process, its store's writes held: closing it (what SIGTERM does) waits for the saves
    under way -- they all land -- or, if the store never answers, gives up after ``drain_timeout_s``."""
    sock = str(tmp_path / "run" / "node.sock")
    service, store, answer = _held_store_service(sock, file_url)
    store.before_set = lambda _call: answer.wait(60)
    with _looping(service):
        engine = Serving(sock)
        engine.request(PROMPT)
        engine.cache.wait_idle()  # published: the service's save of them waits on the store
        wait_until(lambda: store.calls("set") >= 1, 30)
        engine.cache.close()
    if store_answers:
        threading.Timer(0.5, answer.set).start()
    start = time.monotonic()
    try:
        service.close()
    finally:
        took = time.monotonic() - start
        answer.set()
    assert not os.path.exists(sock) and not os.path.exists(service.region.path)
    saved = service.storage.counters.saved_pages
    if store_answers:
        assert 0.4 < took < DRAIN_S and saved == PAGES, (took, saved)
        with closing(open_backend(file_url)) as check:
            assert check.exists([f"{engine.cache.namespace}/{k.hex()}" for k in engine.cache.page_keys(PROMPT)]) == PAGES
    else:
        assert DRAIN_S <= took < DRAIN_S + 2.0 and saved == 0, (took, saved)


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_l3_object_is_never_served_and_is_deleted_and_counted(tmp_path, file_url, damage):
    sock = str(tmp_path / "run" / "node.sock")
    svc = _start(sock, file_url)
    try:
        engine = Serving(sock)
        engine.request(PROMPT)
        engine.cache.wait_idle()
        keys = engine.cache.page_keys(PROMPT)
        namespace = str(engine.cache.namespace)
        wait_until(lambda: query_status_of(sock)()["l3"]["saved_pages"] == PAGES, 60)
        engine.cache.close()
    finally:
        assert stop(svc.proc) == 0
    store = open_backend(file_url)
    path = store._path(f"{namespace}/{keys[2].hex()}")  # page 2 of 5
    data = bytearray(open(path, "rb").read())
    if damage == "flipped":
        data[-1] ^= 0x01  # one payload bit: its checksum fails
    else:
        data = data[: len(data) // 2]  # a value of the wrong size
    with open(path, "wb") as f:
        f.write(data)
    svc = _start(sock, file_url, "--metrics-port", "0")
    try:
        report = _load("load-l3", sock, tmp_path / "b.bin")
        assert (report["host_hit"], report["cached"]) == (2, 2)  # pages 0 and 1, bit-exact; never the damaged one, nor past it
        l3 = query_status_of(sock)()["l3"]
        assert (l3["fetched_pages"], l3["fetch_failed_pages"], l3["corrupt_pages"]) == (2, PAGES - 2, 1)
        # the same in Prometheus, beside the region's metrics (an operator watches L3 without --status)
        m = scrape_metrics(re.search(r"metrics on (http://\S+)", svc.banner).group(1))
        l3_metric = {name: m[(f"kvtier_service_l3_{name}_total", ())] for name in ("fetched_pages", "fetch_failed_pages", "corrupt_pages")}
        assert l3_metric == {"fetched_pages": 2, "fetch_failed_pages": PAGES - 2, "corrupt_pages": 1}
        assert m[("kvtier_service_l3_available", ())] == 1
        assert {op: m[("kvtier_service_l3_queue_pages", (("op", op),))] for op in ("save", "load")}.keys() == {"save", "load"}
    finally:
        assert stop(svc.proc) == 0  # (drains the saves of the pages the engine computed again)
        store.close()
    # the damaged object was deleted, so the save of the page computed again wrote it anew (a save skips keys the store
    # has): the whole prompt is in the store again, right
    healed = _load("load-store", file_url, tmp_path / "own.bin")
    assert (healed["storage_hit"], healed["cached"]) == (PAGES, PAGES)


@pytest.mark.integration
def test_a_stalled_store_holds_none_of_the_services_clients_past_the_bound(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    sock = str(tmp_path / "run" / "node.sock")
    status = query_status_of(sock)
    # each call to the stalled store waits 2 s, twice the engine's lookup deadline: a service that waited on it anywhere
    # on its selector thread would miss that deadline, and the engine would lose it
    svc = _start(sock, f"redis://127.0.0.1:{server.port}/0?timeout=2&lookup_timeout=2")
    engine, stalled = None, False
    try:
        engine = Serving(sock, 1.0)  # lookups answered within 1 s, the service's L3 waits at most half of it
        engine.request(prompt(0))
        engine.cache.wait_idle()
        wait_until(lambda: status()["l3"]["saved_pages"] == PAGES, 60)
        os.kill(server.proc.pid, signal.SIGSTOP)  # the store stalls: connections accepted, nothing answered
        stalled = True
        start, worst, seed = time.monotonic(), 0.0, 1
        while time.monotonic() - start < 4.0:  # new prompts: L3 lookups for each, their saves published to the stalled store
            t = time.monotonic()
            engine.request(prompt(seed))
            worst = max(worst, time.monotonic() - t)
            seed += 1
            t = time.monotonic()
            st = status()
            worst = max(worst, time.monotonic() - t)
        assert worst < STALL_BOUND_S, worst
        leased = engine.cache.host.allocator
        assert engine.bad == 0 and leased.losses == 0  # every lookup answered in time: the service never blocked on its store
        assert st["l3"]["available"] is False  # (its breaker found the store down)
    finally:
        if stalled:
            os.kill(server.proc.pid, signal.SIGCONT)
        if engine is not None:
            engine.cache.close()
        stop(svc.proc)
        server.stop()


@pytest.mark.parametrize(("url", "says"), [("nope://x", "unknown storage scheme 'nope'"), ("file://relative/dir", "file:///absolute/path"),
                                           ("redis://127.0.0.1:1/0?timeout=1", "cannot reach redis at 127.0.0.1:1")])
def test_a_bad_storage_url_is_one_line_and_exit_2_before_the_service_listens(tmp_path, url, says):
    sock = tmp_path / "run" / "node.sock"
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "serve", "--host-gb", "0.01", "--socket", str(sock), "--storage-url", url],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr
    assert not sock.exists()


def _refusal(sock: str, ops: list[dict]) -> dict:
    """``ops`` (a first hello among them, or after one of the right format) on a fresh connection: the
    service's typed error, the connection closed after it."""
    s = raw_connection(sock)
    try:
        if ops[0]["op"] != "hello":
            s.sendall(frame({"seq": 1, "ops": [hello("raw", RegionFormat.of(SPEC, "page_first").as_wire())]}))
            assert "results" in read_answer(s)
        s.sendall(frame({"seq": 2, "ops": ops}))
        answer = read_answer(s)
        assert answer is not None and "error" in answer and closed_by_peer(s), answer
        return answer["error"]
    finally:
        s.close()


def hello(namespace: str, fmt: dict) -> dict:
    return Hello(namespace=namespace, format=fmt).wire()


#: a page of two rows of an engine's own pools (SGLang's KV pool and its indexer: 64- and 16-byte pages of 4 tokens)
ROWS = RegionFormat.of_rows([RowObject("0123456789abcdef", 4), RowObject("fedcba9876543210", 4)], [64, 16]).as_wire()


def test_a_bad_wait_or_a_hello_without_the_right_spec_is_a_typed_error_and_the_service_serves_on(tmp_path, file_url):
    sock = str(tmp_path / "run" / "node.sock")
    svc = _start(sock, file_url)
    try:
        fmt = RegionFormat.of(SPEC, "page_first").as_wire()
        other = RegionFormat.of(SPEC.with_(page_size=2 * SPEC.page_size), "page_first").as_wire()["spec"]

        def sharded(n: int) -> dict:  # the single format's fields, its spec named as a shard's of n
            return {k: v for k, v in fmt.items() if k != "spec"} | {"shard_spec": fmt["spec"], "shards": n}
        cases = {
            # (a well-formed hello this service cannot serve: a ServiceError that names the engines it means and the fix)
            "no spec": ([hello("raw", {k: v for k, v in fmt.items() if k != "spec"})],
                        "names no spec nor its rows' objects, which this service's L3 tier (--storage-url) needs to store its pages "
                        "(an older kvtier, or an SGLang pool whose shard is not the engine's rank); attach this engine to a service "
                        "without --storage-url"),
            "shards past the buffers": ([hello("raw", sharded(9))], "names 9 shards, not 2 to its"),
            "shards not the format's": ([hello("raw", sharded(2))], "names a spec that is not the format's"),
            "a spec and a shard spec": ([hello("raw", fmt | {"shard_spec": fmt["spec"], "shards": 2})], "names spec and shard_spec"),
            # (rows of an engine's own pools: each row's object named from the namespace, which must be of the format)
            "rows and a spec": ([hello("raw", ROWS | {"spec": fmt["spec"]})], "names spec and row_objects"),
            "rows not the format's": ([hello("raw", ROWS | {"row_objects": [["0" * 16, 4], ["1" * 16, 4]]})],
                                      "names row objects that are not the format's"),
            "rows not one per buffer": ([hello("raw", ROWS | {"row_objects": ROWS["row_objects"][:1]})], "not one [16 hex digits"),
            "a row of no fingerprint": ([hello("raw", ROWS | {"row_objects": [["x", 4], ["1" * 16, 4]]})], "not one [16 hex digits"),
            "rows, a namespace of no format": ([hello("raw", ROWS)], "hello's namespace 'raw' is not a kvtier namespace of its format"),
            # (a page of two ranks' shards: each rank's objects are named from the namespace, which must be of the format)
            "shards, a namespace of no format": ([hello("raw", RegionFormat.of_shards(SPEC, "page_first", 2).as_wire())],
                                                 "hello's namespace 'raw' is not a kvtier namespace of its format"),
            "another spec": ([hello("raw", fmt | {"spec": other})], "names a spec that is not the format's"),
            "not a spec": ([hello("raw", fmt | {"spec": {"name": "x", "num_layers": "many"}})], "not the format's"),
            "negative wait": ([{"op": "lookup", "keys": ["ab" * 16], "wait_s": -1}], "lookup's wait_s"),
            "long wait": ([{"op": "lookup", "keys": ["ab" * 16], "wait_s": MAX_WAIT_S + 1}], "lookup's wait_s"),
            "wait not a number": ([{"op": "lookup", "keys": ["ab" * 16], "wait_s": "soon"}], "lookup's wait_s"),
            # (object names: one per key, each the text whose digest the key is)
            "a name not its key's": ([{"op": "lookup", "keys": ["ab" * 16], "names": ["x"]}],
                                     f"lookup's object name 'x' is not the one its key {'ab' * 16} is the digest of"),
            "a name short": ([{"op": "publish", "pages": [0], "keys": [xxh3_128_hexdigest(b"x")], "names": []}],
                             "publish names 1 keys and 0 objects"),
            "a name not text": ([{"op": "lookup", "keys": ["ab" * 16], "names": [7]}], "7 is not an object name"),
            "a name too long": ([{"op": "lookup", "keys": ["ab" * 16], "names": ["x" * 513]}], "is not an object name"),
            "a name with a slash": ([{"op": "lookup", "keys": [xxh3_128_hexdigest(b"ns/x")], "names": ["ns/x"]}],
                                    "'ns/x' is not an object name (a string of 1 to 512 characters of UTF-8 text, no '/')"),
            "a row twice": ([hello("raw", ROWS | {"fingerprint": rows_fingerprint(["0123456789abcdef"] * 2),
                                                  "row_objects": [["0123456789abcdef", 4]] * 2})], "names a row object twice"),
        }
        for name, (ops, text) in cases.items():
            err = _refusal(sock, ops)
            typed = "ServiceError" if name in ("no spec", "shards, a namespace of no format", "rows, a namespace of no format") \
                else "ServiceProtocolError"
            assert err["type"] == typed and text in err["message"], (name, err)
        engine = start_peer("compute", sock)  # the service serves on
        assert peer_report(engine)["backed_up"] == PAGES
        engine.communicate("done\n", timeout=60)
        assert engine.returncode == 0, engine.stderr
    finally:
        assert stop(svc.proc) == 0


def test_a_deferred_lookup_and_a_bye_in_one_batch_are_answered_and_the_service_serves_on(tmp_path, file_url):
    """A lookup whose answer waits on an L3 load, then ``bye``, in one batch: the answer comes (the run as it
    was: the client holds nothing any more), and the service serves other engines. (The deferred answer
    used to look the client up in the index after its bye: the selector loop raised and the service
    stopped for every engine on the node.)"""
    sock = str(tmp_path / "run" / "node.sock")
    svc = _start(sock, file_url)
    try:
        s = raw_connection(sock)
        try:
            s.sendall(frame({"seq": 1, "ops": [hello("raw", RegionFormat.of(SPEC, "page_first").as_wire())]}))
            assert "results" in read_answer(s)
            s.sendall(frame({"seq": 2, "ops": [{"op": "lookup", "keys": ["ab" * 16], "wait_s": 0.2}, {"op": "bye"}]}))
            answer = read_answer(s)
            assert answer == {"seq": 2, "results": [[], None]}, answer
        finally:
            s.close()
        assert svc.proc.poll() is None
        engine = start_peer("compute", sock)  # the service serves on
        assert peer_report(engine)["backed_up"] == PAGES
        engine.communicate("done\n", timeout=60)
        assert engine.returncode == 0, engine.stderr
    finally:
        assert stop(svc.proc) == 0


def test_a_refused_sharded_hello_never_writes_the_salt_to_the_service_log(tmp_path, file_url, caplog):
    """A page of two ranks' shards needs a namespace of its format (each rank's objects are named from it): one of
    another format is refused, typed, and the refusal the service logs shows the namespace as a label -- the
    salt as a digest, never as it is."""
    import logging

    from kvtier.errors import ServiceError
    from kvtier.hashing import Namespace

    caplog.set_level(logging.INFO)
    sock = str(tmp_path / "run" / "node.sock")
    service = NodeService(ServeConfig(host_gb=0.01, socket=sock, storage_url=file_url))
    stopping = threading.Event()
    loop = threading.Thread(target=service.serve, args=(stopping.is_set,), daemon=True)
    loop.start()
    try:
        fmt = RegionFormat.of_shards(SPEC, "page_first", 2)
        bad = str(Namespace("m", SPEC.fingerprint(), 0, "TOPSECRETSALT"))  # (the shard's fingerprint, not the format's)
        with pytest.raises(ServiceError, match="is not a kvtier namespace of its format") as refused:
            ServiceClient(sock, bad, fmt)
        good = ServiceClient(sock, str(Namespace("m", fmt.fingerprint, 0, "TOPSECRETSALT")), fmt)
        good.close()
    finally:
        stopping.set()
        loop.join(30)
        service.close()
    assert "TOPSECRETSALT" not in str(refused.value)
    assert [r.getMessage() for r in caplog.records if "TOPSECRETSALT" in r.getMessage()] == []
