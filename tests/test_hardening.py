"""Hardening, one test per finding of the hostile-co-tenant / careless-user review: the file store
stays under its root, namespaces and token ids never alias, credentials never leak, a slow or
wrong server never hangs the engine or serves bad bytes, and bad indices fail before any byte moves.
Each test failed on the code before the fix (see the closing note of the hardening issue)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from support import l3_scenarios as sc
from support.cache_helpers import make_tiered_cache, serve, serve_tiered
from support.proxies import DripProxy
from support.pools import slots
from kvtier import DevicePool, HostPool
from kvtier.app.devservers import RedisServer
from kvtier.errors import ConfigError, IndexTypeError, PageIndexError, StorageError
from kvtier.hashing import Namespace, page_keys
from kvtier.l3 import open_backend
from kvtier.l3.base import KeyStatus, redact_url
from kvtier.l3.file import FileBackend, dir_name
from kvtier.l3.page import HEADER_BYTES, PageCodec
from kvtier.l3.tier import StorageTier


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# ---- 1. the file store writes only under its root ----------------------------------------------
@pytest.mark.parametrize("model, salt", [("../../../escaped", ""), ("/tmp/absolute-escape", ""), ("m", "../../salted"), ("..", "..")])
def test_file_store_namespace_cannot_escape_the_root(tmp_path, model, salt):
    spec = sc.tiny()
    root = tmp_path / "a" / "b" / "store"
    outside_before = _tree(tmp_path)
    host = HostPool(spec, 4, "page_first")
    tier = StorageTier(open_backend(f"file://{root}"), host, Namespace(model, spec.fingerprint(), salt=salt))
    keys = page_keys(list(range(16)), spec.page_size, tier.namespace.root())
    job = tier.submit("save", keys, [0, 1, 2, 3])
    job.wait(10)
    assert job.statuses == [KeyStatus.OK] * 4
    tier.close()
    added = _tree(tmp_path) - outside_before
    assert added and all(p in ("a", "a/b") or p.startswith("a/b/store/") or p == "a/b/store" for p in added), sorted(added)
    # exactly one namespace directory, named by the encoding, holding every page
    assert [p.name for p in root.iterdir()] == [dir_name(str(tier.namespace))]
    assert not Path("/tmp/absolute-escape").exists()


def test_file_store_refuses_a_symlink_planted_for_the_namespace_directory(tmp_path):
    spec = sc.tiny()
    root, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    ns = Namespace("victim", spec.fingerprint())
    (root / dir_name(str(ns))).symlink_to(elsewhere, target_is_directory=True)
    host = HostPool(spec, 4, "page_first")
    tier = StorageTier(open_backend(f"file://{root}"), host, ns)
    keys = page_keys(list(range(16)), spec.page_size, ns.root())
    job = tier.submit("save", keys, [0, 1, 2, 3])
    job.wait(10)
    assert KeyStatus.ERROR in job.statuses and tier.backend.stats.errors >= 1
    tier.backend.delete([tier.key(k) for k in keys])  # deletes go through the same guarded path
    tier.close()
    assert list(elsewhere.iterdir()) == []  # nothing written through the link


# ---- 2. namespaces are an unambiguous encoding ----------------------------------------------------
def test_namespace_fields_cannot_be_spliced_into_another_namespace():
    fp = "0123abcd"
    a = Namespace(f"a-{fp}-tp0-b", fp)
    b = Namespace("a", fp, salt=f"b-{fp}-tp0")
    assert str(a) != str(b) and a.root() != b.root()
    toks = list(range(64))
    assert not set(page_keys(toks, 16, a.root())) & set(page_keys(toks, 16, b.root()))


# ---- 3 and 4. credentials: never printed; a wrong one is an error at start-up -----------------------
@pytest.fixture
def redis_with_password(tmp_path):
    server = RedisServer(tmp_path / "redis-auth", extra=("--requirepass", "s3cret-pw")).start()
    yield server
    server.stop()


SMALL_RUN = ["run", "--no-progress", "--workload-sessions", "2", "--workload-turns", "2", "--workload-system-tokens", "64",
             "--workload-user-tokens", "20", "--workload-reply-tokens", "10", "--tiers-device-pages", "16", "--tiers-host-pages", "20"]


@pytest.mark.integration
def test_password_is_never_in_the_report_or_output(redis_with_password, tmp_path):
    url = f"redis://:s3cret-pw@127.0.0.1:{redis_with_password.port}/0?timeout=2"
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", *SMALL_RUN, "--storage-url", url, "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "s3cret-pw" not in text + r.stdout + r.stderr
    assert f"redis://:***@127.0.0.1:{redis_with_password.port}/0" in text  # the URL is still reported, redacted
    assert redact_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0" and redact_url("file:///x") == "file:///x"
    with pytest.raises(StorageError) as err:  # error messages carry the redacted form too
        open_backend("file://:s3cret-pw@somehost/x")
    assert "s3cret-pw" not in str(err.value) and ":***@" in str(err.value)


@pytest.mark.integration
def test_wrong_password_is_a_clear_error_at_start_up(redis_with_password):
    for url, expect in ((f"redis://:wrong-pw@127.0.0.1:{redis_with_password.port}/0", "refused the credentials"),
                        (f"redis://127.0.0.1:{redis_with_password.port}/0", "needs a password")):
        with pytest.raises(StorageError, match=expect):
            open_backend(url)
        r = subprocess.run(
            [sys.executable, "-m", "kvtier.app.cli", *SMALL_RUN, "--storage-url", url], capture_output=True, text=True, timeout=120
        )
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and expect in lines[0] and "wrong-pw" not in r.stderr, r.stderr


# ---- 5. token ids keep their full width ------------------------------------------------------------
def test_token_ids_beyond_int32_never_alias_small_ids():
    root = Namespace("m", "fp").root()
    big = np.array([2**32 + 1] + list(range(2, 65)), dtype=np.int64)
    small = np.array([1] + list(range(2, 65)), dtype=np.int64)
    assert page_keys(big, 16, root)[0] != page_keys(small, 16, root)[0]
    assert page_keys(big, 16, root)[1:] != page_keys(small, 16, root)[1:]  # chained: every later page differs too
    # pages whose ids fit in int32 keep their keys whatever the container (list, int32 or int64 array)
    assert page_keys(small, 16, root) == page_keys(small.tolist(), 16, root) == page_keys(small.astype(np.int32), 16, root)
    for bad in ([0.5] * 16, [[1] * 16], ["a"] * 16, [2**70] * 16):
        with pytest.raises(ConfigError):
            page_keys(bad, 16, root)


# ---- 6. bad namespace strings fail at construction ------------------------------------------------
@pytest.mark.parametrize("model", ["nul\x00byte", "x" * 300, "lone\ud800surrogate", "new\nline"])
def test_bad_model_names_are_typed_errors(model):
    with pytest.raises(ConfigError, match="namespace model name"):
        Namespace(model, "fp")


# ---- 7. a slow-drip server: whole-call deadline, the engine never blocks, close is bounded ---------
@pytest.mark.integration
def test_slow_drip_server_fails_the_call_on_time_and_never_blocks_the_engine(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    proxy = DripProxy(server.port)
    try:
        spec = sc.tiny()
        host = HostPool(spec, 8, "page_first")
        backend = open_backend(f"redis://127.0.0.1:{proxy.port}/0?timeout=1")
        tier = StorageTier(backend, host, Namespace("drip", spec.fingerprint()), queue_depth=1, io_threads=1)
        keys = page_keys(list(range(32)), spec.page_size, tier.namespace.root())
        first = tier.submit("save", keys[:4], [0, 1, 2, 3])
        assert first.wait(10) and first.statuses == [KeyStatus.OK] * 4  # full speed: stored
        proxy.drip.set()
        # one GET reply of ~1 KB would take minutes at a byte per 0.5 s: the call fails after ~1 s
        out = [memoryview(bytearray(PageCodec.for_spec(spec).object_bytes))]
        t0 = time.monotonic()
        assert backend.get([tier.key(keys[0])], out) == [KeyStatus.ERROR]
        assert time.monotonic() - t0 < 3.0
        # the engine's thread: submissions return at once even with the worker stuck and the queue full
        t0 = time.monotonic()
        jobs = [tier.submit("prefetch", keys[:4], [4, 5, 6, 7]) for _ in range(4)] + [
            tier.submit("save", keys[4:8], [0, 1, 2, 3]) for _ in range(4)
        ]
        assert time.monotonic() - t0 < 0.5
        assert None in jobs and tier.skipped_prefetches + tier.skipped_saves > 0
        t0 = time.monotonic()
        tier.close(timeout_s=2.0)
        assert time.monotonic() - t0 < 6.0
        assert all(j.finished.is_set() for j in jobs if j is not None)
    finally:
        proxy.close()
        server.stop()


# ---- 8. a corrupt object is repaired by the next save -------------------------------------------
def _flip_file(backend, key, offset):
    path = Path(backend._path(key))
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _flip_redis(backend, key, offset):
    value = bytearray(backend.client.get(key))
    value[offset] ^= 0xFF
    backend.client.set(key, bytes(value))


def corrupt_object_is_repaired(url: str, corrupt) -> None:
    spec = sc.tiny()
    toks = list(range(16))
    a = make_tiered_cache(spec, 8, 8, url, model="repair")
    serve(a, toks)
    a.wait_idle()
    keys = a.page_keys(toks)
    corrupt(a.storage.backend, a.storage.key(keys[2]), HEADER_BYTES + 5)
    a.close()
    b = make_tiered_cache(spec, 8, 8, url, model="repair")
    assert serve_tiered(b, toks)[2:] == (2, 2)  # page 2 corrupt: 2 from L3, 2 recomputed (and saved)
    b.wait_idle()
    assert b.storage.discarded_corrupt == 1
    b.close()
    c = make_tiered_cache(spec, 8, 8, url, model="repair")
    assert serve_tiered(c, toks)[2:] == (4, 0)  # the recompute's save wrote page 2 again: every page hits
    assert c.stats.storage_corrupt_pages == 0
    c.close()


def test_corrupt_file_object_is_repaired(tmp_path):
    corrupt_object_is_repaired(f"file://{tmp_path}", _flip_file)


@pytest.mark.integration
def test_corrupt_redis_object_is_repaired(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        corrupt_object_is_repaired(server.url, _flip_redis)
    finally:
        server.stop()


# ---- 9. valid_tokens in the header is checked -----------------------------------------------------
def test_header_valid_tokens_must_be_a_whole_page(tmp_path):
    spec = sc.tiny()
    codec = PageCodec.for_spec(spec)
    key = page_keys(list(range(4)), 4, Namespace("v", spec.fingerprint()).root())[0]
    payload = memoryview(bytearray(os.urandom(codec.payload_bytes)))
    good = codec.header(key, payload) + bytes(payload)
    partial = codec.header(key, payload, valid_tokens=3) + bytes(payload)  # checksum correct, page partial
    assert codec.check(memoryview(good), key) == "ok"
    assert codec.check(memoryview(partial), key) == "valid_tokens"


# ---- 10. indices: typed errors before any byte moves ---------------------------------------------
def _pools():
    spec = sc.tiny()
    dev, host = DevicePool(spec, 8), HostPool(spec, 8, "page_first")
    for layer in range(spec.num_layers):
        for b in spec.buffers:
            host.rows(b.name, layer).view(torch.uint8).copy_(
                torch.randint(0, 256, host.rows(b.name, layer).view(torch.uint8).shape, dtype=torch.uint8)
            )
    return spec, dev, host


@pytest.mark.parametrize(
    "bad, err",
    [
        (torch.tensor([0.5, 1.5, 2.5, 3.5]), IndexTypeError),
        ([0.0, 1.0, 2.0, 3.0], IndexTypeError),
        (np.array([0.0, 1.0, 2.0, 3.0]), IndexTypeError),
        (torch.arange(8).view(2, 4), IndexTypeError),
        (None, IndexTypeError),
        ("0123", IndexTypeError),
        ([2**63, 1, 2, 3], PageIndexError),
        ([True, 1, 2, 3], IndexTypeError),
    ],
)
def test_bad_index_tensors_are_typed_errors_and_move_nothing(bad, err):
    spec, dev, host = _pools()
    before = [dev.page_bytes(p) for p in range(8)]
    with pytest.raises(err):
        host.load_to_device_per_layer(dev, bad, slots([1], spec.page_size), 0)
    with pytest.raises(err):
        host.load_to_device_per_layer(dev, slots([1], spec.page_size), bad, 0)
    assert [dev.page_bytes(p) for p in range(8)] == before


@pytest.mark.parametrize("layer", [-1, 2, 99, 0.0, None])
def test_bad_layer_ids_are_typed_errors(layer):
    spec, dev, host = _pools()
    before = [dev.page_bytes(p) for p in range(8)]
    with pytest.raises((PageIndexError, IndexTypeError)):
        host.load_to_device_per_layer(dev, slots([1], spec.page_size), slots([2], spec.page_size), layer)
    assert [dev.page_bytes(p) for p in range(8)] == before


# ---- 11. whole requests validated before the first copy ------------------------------------------
def test_offload_load_and_save_validate_every_page_first():
    from support.offload import engine_tensors, keys, make

    src = engine_tensors(seed=3)
    cache = make(src)
    k = keys(3)
    assert cache.save(k, [0, 1, 2]).saved == 3
    before = [t.clone() for t in src]
    with pytest.raises(PageIndexError, match="page 99"):
        cache.load(k, [5, 6, 99])
    assert all(torch.equal(a, b) for a, b in zip(src, before))  # pages 5 and 6 untouched
    with pytest.raises(PageIndexError, match="page -1"):
        cache.save(keys(2, seed=500), [-1, 3])
    with pytest.raises(IndexTypeError):
        cache.load(k, [5.0, 6.0, 7.0])
    cache.drain()
    cache.check_integrity()  # nothing leaked
    cache.core.check_integrity(idle=True)  # nothing left locked or in flight
    cache.close()


# ---- 15. several writers keep a capped store within its stated bound -----------------------------
WRITER = """
import os, sys
from kvtier.l3.file import FileBackend
be = FileBackend(sys.argv[1], max_bytes=int(sys.argv[2]))
for i in range(int(sys.argv[3])):
    be.set([f"ns/{sys.argv[4]}{i:030x}"], [memoryview(b"KVTP" + os.urandom(9_996))])
"""


def test_two_writers_keep_a_capped_store_within_its_bound(tmp_path):
    cap, obj, writers = 400_000, 10_000, 2
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(cap), "300", f"{w:02x}"]) for w in range(writers)]

    def stored_bytes() -> int:
        total = 0
        for f in tmp_path.rglob("*"):
            try:  # the writers evict files while this walks
                if f.is_file() and not f.name.startswith(".tmp-"):
                    total += f.stat().st_size
            except FileNotFoundError:
                pass
        return total

    peak = 0
    while any(p.poll() is None for p in procs):
        peak = max(peak, stored_bytes())
        time.sleep(0.02)
    assert all(p.wait(60) == 0 for p in procs)
    final = FileBackend(tmp_path).usage_bytes()
    bound = cap * (1 + FileBackend(tmp_path).rescan_fraction * writers) + writers * obj
    assert final <= bound and peak <= bound, (final, peak, bound)
