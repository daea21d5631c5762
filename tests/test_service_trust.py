"""The engine's side of the node service's trust boundary (issue 53, items 1 and 2): an engine checks
what it attaches to -- the socket's directory, the listener's uid, the region file it would map -- and
every answer before it books it. Another user who made ``/tmp/kvtier-<uid>`` first and listens there
gets no byte of the engine's (a typed error names the path, the owner and the fix); a hello or a page
id out of protocol is a typed error at build, a lost service (misses, counted) while serving, never an
exception out of the engine's API; and an engine behind a service that answers at random raises
nothing, keeps its books and serves only right bytes. The other users are forked children that drop
root (those tests are skipped where the suite does not run as root); every wait is bounded."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import socket
import tempfile
import threading
import time

import pytest
import xxhash

from support.fake_service import CorruptingProxy, FakeService, ForkedFake
from support.service import OtherUser
from support.service_peer import SPEC, Serving, prompt

from kvtier.build import build_cache
from kvtier.config import TierConfig
from kvtier.errors import ConfigError, ServiceAccessError, ServiceError, ServiceProtocolError
from kvtier.integrations.sglang.options import SGLangStorageOptions
from kvtier.integrations.sglang.service import ServicePages
from kvtier.integrations.vllm.options import ConnectorOptions
from kvtier.service import backoff
from kvtier.service.client import ServiceClient, SessionWriter, check_pages, query_status
from kvtier.service.leased import LeasedPages
from kvtier.service.peer import ServiceTrust, private_socket_dir
from kvtier.service.region import RegionFormat, map_region
from kvtier.service.server import NodeService, ServeConfig

pytestmark = pytest.mark.timeout(300)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="another user's files and processes need root to make")
#: a uid nobody on this machine uses (a forked child becomes it)
OTHER = 54331
FMT = RegionFormat.of(SPEC, "page_first")
NUM_PAGES = 8


def _config(sock: str, **kw) -> TierConfig:
    return TierConfig(device_pages=16, host_pages=NUM_PAGES, service=sock, **kw)


def _make_region(path: str, *, mode: int = 0o600, size: int | None = None) -> str:
    """A file the shape of a region of NUM_PAGES pages (``size``: another size), with ``mode``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, FMT.size(NUM_PAGES) if size is None else size)
    os.fchmod(fd, mode)
    os.close(fd)
    return path


def _hello(path: str, **changes) -> dict:
    return {"region": path, "size": FMT.size(NUM_PAGES), "num_pages": NUM_PAGES, "session": "s" * 16, **changes}


class Scripted:
    """Answers as a service would: hello with :attr:`hello`; lookups with nothing; reservations with fresh
    pages (while the region has them); anything else with an empty object."""

    def __init__(self, hello: dict):
        self.hello = hello
        self.next_page = 0

    def __call__(self, op: dict) -> object:
        kind = op.get("op")
        if kind == "hello":
            return self.hello
        if kind == "lookup":
            return []
        if kind == "reserve":
            pages = list(range(self.next_page, min(self.next_page + op["n"], NUM_PAGES)))
            self.next_page += len(pages)
            return pages
        return {}


@contextlib.contextmanager
def _fake(folder: str, answer, mode: int = 0o700):
    """A :class:`FakeService` of this process's on ``folder``/node.sock (``folder`` made with ``mode``)."""
    os.makedirs(folder, exist_ok=True)
    os.chmod(folder, mode)
    sock = os.path.join(folder, "node.sock")
    fake = FakeService(sock, answer)
    try:
        yield sock, fake
    finally:
        fake.close()


@contextlib.contextmanager
def _node_service(sock: str):
    """A real :class:`NodeService` serving on a thread of this process."""
    service = NodeService(ServeConfig(host_gb=0.01, socket=sock))
    stopping = threading.Event()
    t = threading.Thread(target=service.serve, args=(stopping.is_set,), daemon=True)
    t.start()
    try:
        yield service
    finally:
        stopping.set()
        t.join(30)
        service.close()


# ---- 1. the engine checks the service --------------------------------------------------------------
@needs_root
def test_another_users_squatted_default_directory_gets_no_byte_of_the_engine():
    """The issue's attack: user A makes ``/tmp/kvtier-<uid of V>`` before V does (the default socket's
    directory where ``$XDG_RUNTIME_DIR`` is unset), listens there and names a region file of its own.
    V's service refuses the directory, and so does V's engine: a typed error naming the path, the owner
    found and the fix, before it sends the service a frame -- so A never sees a hello, never a page."""
    base = tempfile.mkdtemp(prefix="kvtier-trust-", dir="/tmp")  # (as /tmp is: anyone may make a directory in it)
    os.chmod(base, 0o1777)
    squat = os.path.join(base, f"kvtier-{os.getuid()}")
    sock, region = os.path.join(squat, "node.sock"), os.path.join(squat, "region")

    def squat_it() -> socket.socket:  # (as A)
        os.mkdir(squat, 0o755)
        _make_region(region, mode=0o666)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(sock)
        os.chmod(sock, 0o777)
        listener.listen(16)
        return listener

    hostile = ForkedFake(OtherUser(OTHER, OTHER), squat_it, Scripted(_hello(region)))
    try:
        assert os.stat(squat).st_uid == OTHER
        with pytest.raises(ServiceAccessError) as refused:
            build_cache(SPEC, _config(sock))
        message = str(refused.value)
        assert f"socket {sock}: its directory {squat} is owned by uid {OTHER}" in message and "another user's" in message
        assert "XDG_RUNTIME_DIR" in message and "--socket in a directory you own" in message
        for attach in (lambda: ServiceClient(sock, "ns", FMT), lambda: SessionWriter(sock, "s" * 16), lambda: query_status(sock)):
            with pytest.raises(ServiceAccessError, match=f"owned by uid {OTHER}"):
                attach()
        # the service refuses the same directory (its own side of the same check)
        with pytest.raises(ConfigError, match=f"its directory {squat} must be a directory of uid {os.getuid()}"):
            private_socket_dir(sock, os.getuid())
        assert hostile.ops() == []  # not a hello, not a lookup: nothing reached it
    finally:
        hostile.stop()
        shutil.rmtree(base, ignore_errors=True)


@needs_root
def test_a_listener_of_another_uid_is_refused_unless_it_is_the_configured_service_uid(tmp_path):
    """The directory is the engine's own, but the process listening in it runs as another uid (it called
    ``listen`` as that user): refused by ``SO_PEERCRED``. Named on purpose (``TierConfig.service_uid``:
    a member of another user's ``--allow-group``), that uid's service is attached to -- through a
    directory of that uid only, and mapping only a region file of that uid."""
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    sock, region = str(folder / "node.sock"), _make_region(str(tmp_path / "region"))
    os.chown(region, OTHER, OTHER)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock)  # (bound here; the child listens on it as the other user)
    script = Scripted(_hello(region))

    def listen() -> socket.socket:
        listener.listen(16)
        return listener

    other = ForkedFake(OtherUser(OTHER, OTHER), listen, script)
    listener.close()
    try:
        with pytest.raises(ServiceAccessError, match=f"the node service at {sock} is process {other.pid} of uid {OTHER}, not of uid "
                                                     f"{os.getuid()}.*TierConfig.service_uid"):
            build_cache(SPEC, _config(sock))
        # named as the service's uid: its directory must be that uid's too
        with pytest.raises(ServiceAccessError, match=f"its directory {folder} is owned by uid {os.getuid()}"):
            build_cache(SPEC, _config(sock, service_uid=OTHER))
        assert other.ops() == []
        os.chown(folder, OTHER, OTHER)
        cache = build_cache(SPEC, _config(sock, service_uid=OTHER))
        leased = cache.host.allocator
        assert leased.client.trust == ServiceTrust(OTHER, None) and cache.host.num_pages == NUM_PAGES
        cache.close()
        # a region of any other uid than the service's is not mapped (here: this process's own)
        os.chown(region, os.getuid(), os.getgid())
        with pytest.raises(ServiceAccessError, match=f"region {region} is of uid {os.getuid()}.*not uid {OTHER}'s"):
            build_cache(SPEC, _config(sock, service_uid=OTHER))
        assert other.ops().count("hello") == 2  # (the one attached, and the one whose region was refused)
    finally:
        other.stop()


@pytest.mark.parametrize("mode, why", [(0o777, "others may write into it"), (0o733, "others may write into it"),
                                       (0o770, "its group may write into it")])
def test_a_socket_directory_others_may_write_into_is_refused_before_a_byte_is_sent(tmp_path, mode, why):
    """Anyone who can write into the socket's directory can have made the socket: refused whoever owns it
    (no root needed), naming the directory, its owner and mode, and the fix."""
    region = _make_region(str(tmp_path / "region"))
    with _fake(str(tmp_path / "run"), Scripted(_hello(region)), mode) as (sock, fake):
        with pytest.raises(ServiceAccessError) as refused:
            build_cache(SPEC, _config(sock))
        assert f"its directory {tmp_path / 'run'} is owned by uid {os.getuid()} with mode {mode:o} ({why})" in str(refused.value)
        assert "XDG_RUNTIME_DIR" in str(refused.value)
        assert fake.received == []


def test_a_socket_directory_that_is_a_symlink_is_refused(tmp_path):
    region = _make_region(str(tmp_path / "region"))
    with _fake(str(tmp_path / "real"), Scripted(_hello(region))) as (_sock, fake):
        os.symlink(tmp_path / "real", tmp_path / "link")
        with pytest.raises(ServiceAccessError, match=r"its directory .*link is owned by .*\(not a directory\)"):
            ServiceClient(str(tmp_path / "link" / "node.sock"), "ns", FMT)
        assert fake.received == []


def _region_cases(tmp_path) -> dict[str, tuple[str, type, str]]:
    """Regions a service may not name: path, the error, what its message says."""
    good = _make_region(str(tmp_path / "good"))
    os.symlink(good, tmp_path / "link")
    os.mkfifo(tmp_path / "fifo", 0o600)
    (tmp_path / "folder").mkdir(mode=0o700)
    cases = {
        "a symlink to a region": (str(tmp_path / "link"), ServiceAccessError, "is a symbolic link"),
        "world-readable": (_make_region(str(tmp_path / "open"), mode=0o644), ServiceAccessError, "permission bits beyond 600"),
        "group-shared, the socket's directory not": (_make_region(str(tmp_path / "grouped"), mode=0o660), ServiceAccessError,
                                                     "permission bits beyond 600"),
        "setuid": (_make_region(str(tmp_path / "setuid"), mode=0o4600), ServiceAccessError, "permission bits beyond 600"),
        "a FIFO": (str(tmp_path / "fifo"), ServiceAccessError, "not a regular file"),
        "a directory": (str(tmp_path / "folder"), ServiceAccessError, "not a regular file"),
        "a device": ("/dev/zero", ServiceAccessError, "not a regular file"),
        "missing": (str(tmp_path / "missing"), ServiceError, "cannot open the node service's region"),
        "of another size": (_make_region(str(tmp_path / "short"), size=FMT.size(NUM_PAGES) - 1), ServiceProtocolError,
                            f"is {FMT.size(NUM_PAGES) - 1} bytes, not the {FMT.size(NUM_PAGES)} it announced"),
    }
    if os.geteuid() == 0:
        other = _make_region(str(tmp_path / "others"))
        os.chown(other, OTHER, OTHER)
        cases["another user's"] = (other, ServiceAccessError, f"is of uid {OTHER}")
    return cases


def test_a_region_that_is_not_a_private_file_of_the_service_is_never_mapped(tmp_path):
    """The hello names a region; the engine maps it only if it is a regular file (not a link, a FIFO, a
    device), of the service's uid, of the size announced, mode 0600 -- 0660 only of the group the socket's
    directory lets in. Refused at the hello (typed, naming the path, owner and mode), before any page is
    booked; and ``map_region`` refuses it the same way on the descriptor it maps."""
    script = Scripted(None)
    with _fake(str(tmp_path / "run"), script) as (sock, _fake_service):
        for case, (path, error, says) in _region_cases(tmp_path).items():
            script.hello = _hello(path)
            with pytest.raises(error, match=re.escape(says)):
                ServiceClient(sock, "ns", FMT, deadline_s=5)
            with pytest.raises(error, match=re.escape(says)):
                map_region(path, FMT.size(NUM_PAGES), trust=ServiceTrust(os.getuid()))
        script.hello = _hello(_make_region(str(tmp_path / "fine")))
        client = ServiceClient(sock, "ns", FMT)  # (what is right is attached to)
        assert client.map_region(pin=False).numel() == FMT.size(NUM_PAGES)
        client.close()


def test_a_group_shared_region_is_mapped_only_where_the_socket_directory_is_that_groups(tmp_path):
    """``--allow-group``'s shape: the socket's directory 0750 and the region 0660, both of the group."""
    region = _make_region(str(tmp_path / "region"), mode=0o660)
    with _fake(str(tmp_path / "run"), Scripted(_hello(region)), mode=0o750) as (sock, _fake_service):
        client = ServiceClient(sock, "ns", FMT)
        assert client.trust == ServiceTrust(os.getuid(), os.stat(tmp_path / "run").st_gid)
        client.close()
    os.chmod(region, 0o664)  # but never open to others
    with _fake(str(tmp_path / "run2"), Scripted(_hello(region)), mode=0o750) as (sock, _fake_service):
        with pytest.raises(ServiceAccessError, match="permission bits beyond 660"):
            ServiceClient(sock, "ns", FMT)


def test_the_service_uid_an_engine_expects_is_a_uid_wherever_it_is_configured():
    assert TierConfig(service_uid=0).service_uid == 0 and TierConfig().service_uid is None
    assert ConnectorOptions.from_extra_config({"service": "unix:///run/k/node.sock", "service_uid": 7}).tiers.service_uid == 7
    assert SGLangStorageOptions(service="/run/k/node.sock", service_uid=7).service_uid == 7
    for bad in (-1, True, 1.0, "0", (1 << 32) - 1):
        with pytest.raises(ConfigError, match="service_uid must be an integer"):
            TierConfig(service_uid=bad)
        with pytest.raises(ConfigError, match="service_uid must be an integer"):
            SGLangStorageOptions(service="/run/k/node.sock", service_uid=bad)


# ---- 2. every answer is checked before it is booked -------------------------------------------------
BAD_HELLOS = {
    "no pages": {"num_pages": 0}, "negative pages": {"num_pages": -1}, "10**13 pages": {"num_pages": 10**13},
    "pages a bool": {"num_pages": True}, "pages a string": {"num_pages": str(NUM_PAGES)}, "pages a float": {"num_pages": 8.0},
    "one page more": {"num_pages": NUM_PAGES + 1}, "a size not the pages'": {"size": FMT.size(NUM_PAGES) + 1},
    "size a float": {"size": float(FMT.size(NUM_PAGES))}, "a relative region": {"region": "region"}, "region a number": {"region": 5},
    "a NUL in the region": {"region": "/dev/shm/x\0y"}, "no session": {"session": None}, "an empty session": {"session": ""},
    "a long session": {"session": "s" * 65}, "a session not a string": {"session": 7},
}


@pytest.mark.parametrize("case", sorted(BAD_HELLOS))
def test_a_hello_out_of_protocol_is_a_typed_error_at_build_never_a_crash(tmp_path, case):
    """Today's crashes (a ValueError, MemoryError, TypeError out of build_cache) are one typed
    :class:`ServiceProtocolError` naming the field; nothing is allocated from the bad number."""
    region = _make_region(str(tmp_path / "region"))
    with _fake(str(tmp_path / "run"), Scripted(_hello(region, **BAD_HELLOS[case]))) as (sock, _fake_service):
        with pytest.raises(ServiceProtocolError, match="the node service's hello"):
            build_cache(SPEC, _config(sock))


def test_a_hello_that_is_not_an_object_is_a_typed_error(tmp_path):
    with _fake(str(tmp_path / "run"), lambda op: [1, 2]) as (sock, _fake_service):
        with pytest.raises(ServiceProtocolError, match="answered hello with \\[1, 2\\], not an object"):
            ServiceClient(sock, "ns", FMT)


BAD_PAGES = {
    "negative": [-1], "past the region": [NUM_PAGES], "far past": [10**13], "a repeat": [2, 2], "a bool": [True],
    "a float": [1.0], "a string": ["1"], "None": [None], "a list in the list": [[1]], "not a list": {"0": 1}, "a number": 3,
    "too many": list(range(5)),
}


@pytest.mark.parametrize("case", sorted(BAD_PAGES))
def test_page_ids_out_of_protocol_break_the_client_typed(tmp_path, case):
    """A lookup of 4 keys or a reservation of 4 pages answered with ids that are not distinct ints of the
    region, or more than asked: a :class:`ServiceProtocolError`, and the client is not used again."""
    region = _make_region(str(tmp_path / "region"))
    bad = BAD_PAGES[case]
    for op in ("lookup", "reserve"):
        answers = {"hello": _hello(region), op: bad}
        with _fake(str(tmp_path / f"run-{op}"), lambda o, answers=answers: answers.get(o["op"], [])) as (sock, _fake_service):
            client = ServiceClient(sock, "ns", FMT)
            what = "lookup" if op == "lookup" else "reservation"
            with pytest.raises(ServiceProtocolError, match=f"the node service('s| answered a) {what}"):
                client.lookup([bytes([i]) * 16 for i in range(4)]) if op == "lookup" else client.reserve(4)
            with pytest.raises(ServiceError, match="unusable"):
                client.status()
    assert check_pages([3, 0, 1], 3, NUM_PAGES, "lookup") == [3, 0, 1]


def test_a_steps_lookups_answered_with_one_page_in_two_runs_break_the_client_typed(tmp_path):
    """vLLM's scheduler asks about a step's requests in one frame (:meth:`ServiceClient.lookup_many`): each
    run's pages are checked as a lookup's, and a page named in two runs -- each answer valid on its own --
    would be booked twice: a :class:`ServiceProtocolError`, and the client is not used again."""
    region = _make_region(str(tmp_path / "region"))
    answers = {"hello": _hello(region), "lookup": [1]}
    with _fake(str(tmp_path / "run"), lambda o: answers.get(o["op"], [])) as (sock, fake):
        client = ServiceClient(sock, "ns", FMT)
        with pytest.raises(ServiceProtocolError, match="named a page in two runs"):
            client.lookup_many([[bytes([1]) * 16], [bytes([2]) * 16]])
        assert [op["op"] for op in fake.received] == ["hello", "lookup", "lookup"]  # one frame of two
        with pytest.raises(ServiceError, match="unusable"):
            client.status()


class _HandsBack:
    """A client whose every lookup and reservation hands out ``pages`` (each one valid on its own)."""

    def __init__(self, pages: list[int]):
        self.pages = pages
        self.num_pages, self.socket_path, self.session, self.closed = NUM_PAGES, "/nowhere", "s", 0

    def lookup(self, keys):
        return list(self.pages)

    def reserve(self, n, pool=0):
        return list(self.pages[:n])

    def release(self, pages):
        pass

    def close(self, *, quiesced: bool = True):
        self.closed += 1


def test_a_page_the_engine_holds_given_again_is_a_lost_service_counted_not_a_double_booking():
    """The client cannot know what the engine holds: the host tier checks that no page it is given is one
    it holds already (a reservation's or a lookup's), and makes it a protocol error: lost, counted, no
    exception, nothing booked twice."""
    client = _HandsBack([0, 1])
    leased = LeasedPages(client, 4)
    assert leased.alloc(2).pages == [0, 1]
    assert leased.lookup([b"k" * 16] * 2) == [] and leased.lost  # it holds 0 and 1
    assert (leased.losses, leased.protocol_errors, leased.num_used) == (1, 1, 2)
    assert client.closed == 1


# ---- an engine behind a service that answers at random ---------------------------------------------
def _fake_regions(tmp_path, real: str, size: int) -> list[str]:
    """Files a lying hello may name instead of the real region (each refused)."""
    folder = tmp_path / "fakes"
    folder.mkdir(mode=0o700)
    open_copy = _make_region(str(folder / "open"), mode=0o644, size=size)
    os.symlink(real, folder / "link")
    os.mkfifo(folder / "fifo", 0o600)
    paths = [open_copy, str(folder / "link"), str(folder / "fifo"), "/dev/zero", str(folder / "missing")]
    if os.geteuid() == 0:
        other = _make_region(str(folder / "others"), size=size)
        os.chown(other, OTHER, OTHER)
        paths.append(other)
    return paths


@pytest.fixture
def quick_reattach(monkeypatch):
    """Attach again at once after a loss (a lie per few answers, and each costs the backoff's wait otherwise)."""
    monkeypatch.setattr(backoff, "RETRY_FIRST_S", 0.0)
    monkeypatch.setattr(backoff, "RETRY_MAX_S", 0.0)


def test_an_engine_behind_a_service_that_answers_at_random_raises_nothing_and_serves_only_right_bytes(tmp_path, quick_reattach):
    """A real service behind a proxy that answers a share of its frames out of protocol -- hellos (pages
    0, negative, 10**13; sizes, regions and sessions that are not), lookups and reservations (negative
    ids, past the region, repeats, more than asked, wrong types), whole frames (another seq, not JSON,
    a bad length) -- while an engine serves requests: no exception out of its API, every cached page's
    bytes the prompt's, its books whole, each lie a lost service (misses, recompute) counted in
    ``protocol_errors``. Once the lies stop it attaches again and reads its host tier."""
    real = str(tmp_path / "real" / "node.sock")
    (tmp_path / "run").mkdir(mode=0o700)
    with _node_service(real):
        proxy = CorruptingProxy(str(tmp_path / "run" / "node.sock"), real, seed=53, rate=0.0, fake_paths=[], num_pages=1)
        engine = None
        try:
            engine = Serving(str(tmp_path / "run" / "node.sock"), lookup_s=2.0)  # (an honest hello: build attaches)
            leased = engine.cache.host.allocator
            proxy.num_pages = leased.num_pages
            proxy.fake_paths = _fake_regions(tmp_path, leased.client.region, leased.client.region_size)
            proxy.honest_hellos, proxy.rate = False, 0.25
            rng = random.Random(53)
            prompts = [prompt(i) for i in range(10)]
            start = time.monotonic()
            while time.monotonic() - start < 10.0 and engine.requests < 1200:
                engine.request(prompts[rng.randrange(len(prompts))])
                if rng.random() < 0.1:
                    engine.cache.wait_idle()
                    engine.cache.check_integrity(idle=True)
            assert engine.bad == 0, engine.report()
            assert proxy.corrupted >= 20 and leased.protocol_errors >= 10, (proxy.corrupted, engine.report(), leased.protocol_errors)
            assert leased.protocol_errors <= proxy.corrupted  # (each lie breaks one connection, once)
            # the lies stop: it attaches again and reads its host tier back (host hits, right bytes)
            proxy.rate = 0.0
            engine.host_hit = 0
            start = time.monotonic()
            while engine.host_hit == 0 and time.monotonic() - start < 30.0:
                engine.request(prompts[rng.randrange(len(prompts))])
            assert engine.host_hit > 0 and not leased.lost and engine.bad == 0, engine.report()
            engine.cache.wait_idle()
            engine.cache.check_integrity(idle=True)
        finally:
            if engine is not None:
                engine.cache.close()
            proxy.close()


class _BytePages:
    """Stands in for an SGLang host pool's :class:`~kvtier.integrations.sglang.pool_pages.PoolPages`: pages
    of ``payload_bytes`` in one buffer, each page one run."""

    def __init__(self, num_pages: int, payload_bytes: int = 256):
        self.num_pages, self.payload_bytes, self.name, self.page_size = num_pages, payload_bytes, "kv", 1
        self.fingerprint = xxhash.xxh3_64_hexdigest(f"bytes-{payload_bytes}".encode())
        self.buf = bytearray(num_pages * payload_bytes)

    def views(self, page: int) -> list[memoryview]:
        return [memoryview(self.buf)[page * self.payload_bytes : (page + 1) * self.payload_bytes]]

    def write_back(self, page: int, views) -> None:
        pass

    def payload(self, key: bytes) -> bytes:
        return (key * (self.payload_bytes // len(key) + 1))[: self.payload_bytes]


def test_sglang_threads_behind_a_service_that_answers_at_random_raise_nothing_and_read_only_right_bytes(tmp_path, quick_reattach):
    """SGLang's storage backend on the service (:class:`ServicePages`) uses the same client: behind the
    same lying proxy, its writes and reads raise nothing, every page it reads holds what was written
    under its key, and each lie is a lost connection (misses) counted in ``protocol_errors``."""
    real = str(tmp_path / "real" / "node.sock")
    (tmp_path / "run").mkdir(mode=0o700)
    sock = str(tmp_path / "run" / "node.sock")
    src, dst = _BytePages(64), _BytePages(64)
    names = [f"page-{i}" for i in range(48)]  # (SGLang's page hashes; the keys their digests)
    keys = [xxhash.xxh3_128_digest(name.encode()) for name in names]
    with _node_service(real):
        proxy = CorruptingProxy(sock, real, seed=46, rate=0.0, fake_paths=[], num_pages=1)
        writer = ServicePages(sock, "sglang-ns", [src], deadline_s=10.0, lookup_deadline_s=2.0)
        reader = ServicePages(sock, "sglang-ns", [dst], deadline_s=10.0, lookup_deadline_s=2.0)
        try:
            assert writer.attach_now() and reader.attach_now()
            proxy.num_pages = writer._state.session.client.num_pages
            proxy.honest_hellos, proxy.rate = False, 0.25
            rng = random.Random(46)
            read = 0
            for _ in range(400):
                start, n = rng.randrange(0, 40), rng.randrange(1, 9)
                run, run_names, pages = keys[start : start + n], names[start : start + n], list(range(start, start + n))
                for key, page in zip(run, pages):
                    src.views(page)[0][:] = src.payload(key)
                if rng.random() < 0.5:
                    writer.write(run_names, pages)
                into = [rng.randrange(64) for _ in run]
                into = list(dict.fromkeys(into))[: len(run)]
                got = reader.read(dst, run_names[: len(into)], into)
                assert all(bytes(dst.views(p)[0]) == dst.payload(k) for p, k in zip(into[:got], run)), "a page read holds another's bytes"
                read += got
                reader.stored(run_names)
            assert read > 0 and proxy.corrupted >= 20
            assert writer.protocol_errors + reader.protocol_errors >= 10, (writer.protocol_errors, reader.protocol_errors)
            assert writer.protocol_errors + reader.protocol_errors <= proxy.corrupted
        finally:
            writer.close()
            reader.close()
            proxy.close()
