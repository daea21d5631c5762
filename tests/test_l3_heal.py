"""A bad L3 object heals: whatever is wrong with it -- its length (one byte short, one byte long, empty),
its header, its checksum, or it is another key's, another model's or another group's object -- a reader
counts it as corrupt, serves no byte of it, and deletes it, so the next save of its key writes it again
and the prefix is a full L3 hit after one recompute. In every backend (file, memory, Redis, Mooncake),
for a hybrid model's window pages and state snapshots, and through the SGLang HiCache backend. A header
that claims a partial page fails the check too.

Before, an object of the wrong length was reported as a read error without a check: never deleted nor
counted, and every later save skipped its key because the store "had" it, so that prefix missed for good."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from support import l3_scenarios as sc
from support.cache_helpers import make_tiered_cache, serve, serve_tiered
from kvtier import DevicePool, HostPool
from kvtier.app.devservers import MooncakeMaster, RedisServer
from kvtier.cache import HierarchicalCache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.hashing import Namespace, group_object_key, page_keys
from kvtier.l3 import open_backend
from kvtier.l3.page import HEADER_BYTES, PageCodec
from kvtier.l3.tier import StorageTier


# ---- the stores ------------------------------------------------------------------------------
@dataclasses.dataclass
class Store:
    """A store under test: its URL and a client of it (``raw``) for the test's own reads and writes of objects."""

    kind: str
    url: str
    raw: object

    def backend(self):
        """The backend a cache opens: its own client (a memory:// store lives in one object: that one)."""
        return self.raw if self.kind == "memory" else open_backend(self.url)

    def read(self, name: str) -> bytes | None:
        if self.kind == "file":
            path = Path(self.raw._path(name))
            return path.read_bytes() if path.exists() else None
        if self.kind == "memory":
            return self.raw.data.get(name)
        if self.kind == "redis":
            return self.raw.client.get(name)
        return self.raw.store.get(name) if self.raw.store.get_size(name) >= 0 else None

    def write(self, name: str, data: bytes) -> None:
        """Put ``data`` at ``name`` as it is, past every check of kvtier's own writes."""
        if self.kind == "file":
            Path(self.raw._path(name)).write_bytes(data)
        elif self.kind == "memory":
            self.raw.data[name] = data
        elif self.kind == "redis":
            self.raw.client.set(name, data)
        else:
            self.raw.store.remove(name, True)
            assert self.raw.store.put(name, data) == 0


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def mooncake_url():
    master = MooncakeMaster().start()
    yield master.url
    master.stop()


@pytest.fixture(params=["file", "memory", pytest.param("redis", marks=pytest.mark.integration),
                        pytest.param("mooncake", marks=pytest.mark.integration)])
def store(request, tmp_path):
    url = {"file": lambda: f"file://{tmp_path / 'l3'}", "memory": lambda: "memory://",
           "redis": lambda: request.getfixturevalue("redis_url"), "mooncake": lambda: request.getfixturevalue("mooncake_url")}
    s = Store(request.param, url[request.param](), None)
    s.raw = open_backend(s.url)
    yield s
    s.raw.close()


def model_of(request) -> str:
    """A model name of the test's own (the servers are shared by the module's tests)."""
    return "heal-" + "".join(c if c.isalnum() else "-" for c in request.node.name)


# ---- what can be wrong with an object ----------------------------------------------------------
def flipped(obj: bytes, offset: int) -> bytes:
    bad = bytearray(obj)
    bad[offset] ^= 0xFF
    return bytes(bad)


#: way -> the bad object from (the good object, another key's object, another model's object of the same page)
WAYS = {
    "shorter by one byte": lambda good, other, foreign: good[:-1],
    "longer by one byte": lambda good, other, foreign: good + b"\0",
    "empty": lambda good, other, foreign: b"",
    "bad header": lambda good, other, foreign: flipped(good, 17),  # inside the spec fingerprint
    "bad checksum": lambda good, other, foreign: flipped(good, HEADER_BYTES + 5),  # a payload byte
    "another key's object": lambda good, other, foreign: other,
    "another model's object": lambda good, other, foreign: foreign,
}
TOKENS = list(range(16))  # 4 pages of 4


def open_cache(store: Store, model: str) -> HierarchicalCache:
    """A fresh engine's cache (new device and host pools, its own store client) over ``store``."""
    spec = sc.tiny()
    ns = Namespace(model, spec.fingerprint())
    host = HostPool(spec, 8, "page_first")
    tier = StorageTier(store.backend(), host, ns, owns_backend=store.kind != "memory")
    return HierarchicalCache(DevicePool(spec, 8), host, CacheConfig(), namespace=ns, storage=tier,
                             storage_config=StorageConfig(url=store.url))


def object_name(cache, page: int) -> str:
    return cache.storage.key(cache.page_keys(TOKENS)[page])


def stored(store: Store, model: str) -> list[str]:
    """Serve ``TOKENS`` in a cache of ``model`` that saves them to L3; the names of its 4 page objects."""
    cache = open_cache(store, model)
    serve(cache, TOKENS)
    cache.wait_idle()
    names = [object_name(cache, p) for p in range(4)]
    cache.close()
    assert all(store.read(n) for n in names)
    return names


@pytest.mark.parametrize("way", WAYS)
def test_a_bad_page_object_is_counted_never_served_deleted_and_healed_by_one_recompute(store, way, request):
    model = model_of(request)
    names, other_model = stored(store, model), stored(store, model + "-other")
    name, good = names[1], store.read(names[1])
    if store.kind == "mooncake" and way == "empty":  # Mooncake refuses an empty value: no empty object can be there
        assert store.raw.store.put(name + "-empty", b"") != 0 and store.read(name + "-empty") is None
        return
    store.write(name, WAYS[way](good, store.read(names[3]), store.read(other_model[1])))

    fresh = open_cache(store, model)
    gone = []
    # page 0 comes from L3, page 1 is a miss, pages 1-3 are computed; serve checks every page's bytes
    served = serve(fresh, TOKENS, prefetch=True, on_begin=lambda _req: gone.append(store.read(name) is None))
    assert (served.storage_hit, served.computed) == (1, 3)
    assert gone == [True]  # the read deleted it, before anything was computed
    fresh.wait_idle()
    assert fresh.storage.discarded_corrupt == 1 and fresh.stats.storage_corrupt_pages == 1
    # the lookup counted 4 L3 pages; the 3 the bad object kept from being served are reported as corrupt misses
    assert (fresh.stats.storage_hit_pages, fresh.stats.storage_corrupt_miss_pages) == (4, 3)
    assert fresh.stats.miss_pages == 3
    assert fresh.stats.storage_saved_pages == 3 and store.read(name) == good  # the recompute's save wrote it again, whole
    assert fresh.storage.breaker.opened == 0  # a bad object is no store fault
    fresh.check_integrity()
    fresh.close()

    again = open_cache(store, model)
    assert serve_tiered(again, TOKENS) == (0, 0, 4, 0)  # a full L3 hit
    assert (again.stats.storage_corrupt_pages, again.stats.storage_corrupt_miss_pages, again.storage.discarded_corrupt) == (0, 0, 0)
    again.close()


def test_a_bad_object_past_the_first_page_is_reported_for_the_pages_it_kept_from_being_served(store, request):
    """The count the lookup made and the pages served agree once the corrupt misses are taken off."""
    model = model_of(request)
    name = stored(store, model)[3]
    store.write(name, store.read(name)[:-1])
    fresh = open_cache(store, model)
    served = serve(fresh, TOKENS, prefetch=True)
    fresh.wait_idle()
    st = fresh.stats
    assert (served.storage_hit, served.computed) == (3, 1)
    assert (st.storage_hit_pages, st.storage_corrupt_miss_pages, st.storage_corrupt_pages) == (4, 1, 1)
    assert st.storage_hit_pages - st.storage_corrupt_miss_pages == served.storage_hit == st.storage_prefetched_pages
    fresh.close()


# ---- a hybrid model: a window page or a state snapshot --------------------------------------------
HYBRID_WAYS = ["shorter by one byte", "longer by one byte", "empty", "another group's object"]


@pytest.mark.parametrize("way", HYBRID_WAYS)
@pytest.mark.parametrize("group", ["ssm", "swa"])  # the snapshot at 6 / window page 5
def test_a_bad_group_object_is_counted_never_served_deleted_and_healed_by_one_recompute(tmp_path, group, way):
    from support.hybrid_bytes import TOKENS as HYBRID_TOKENS
    from support.hybrid_bytes import build, check_served, compute

    def store_name(cache, g: str) -> str:
        return cache.storage.key(group_object_key(cache.page_keys(HYBRID_TOKENS)[5], g))

    cache = build("one process", tmp_path)
    compute(cache, HYBRID_TOKENS)
    cache.wait_idle()
    files = Store("file", f"file://{tmp_path}", open_backend(f"file://{tmp_path}"))
    name, elsewhere = store_name(cache, group), store_name(cache, "swa" if group == "ssm" else "ssm")
    good, others = files.read(name), files.read(elsewhere)
    assert len(good) != len(others)  # (so another group's object is one of the wrong length here)
    bad = {"shorter by one byte": good[:-1], "longer by one byte": good + b"\0", "empty": b"", "another group's object": others}[way]
    files.write(name, bad)
    cache.close()

    fresh = build("one process", tmp_path)
    req = fresh.begin(HYBRID_TOKENS)
    # the lookup saw all 6 pages and their objects; the prefetch brings the objects boundary 6 reads, and with
    # one of them bad no boundary has every group's objects: nothing is served, every page is recomputed
    assert req.wait() == 0
    check_served(fresh, req, 0)
    assert files.read(name) is None  # deleted on read
    req.abort()
    compute(fresh, HYBRID_TOKENS)  # the recompute, written through to L3
    fresh.wait_idle()
    st = fresh.stats
    assert st.storage_corrupt_pages == 1 and (st.storage_hit_pages, st.storage_corrupt_miss_pages) == (6, 6)
    assert files.read(name) == good
    fresh.close()

    again = build("one process", tmp_path)
    try:
        req = again.begin(HYBRID_TOKENS)
        assert req.served(6) == (0, 0, 6)
        check_served(again, req, 6)
        assert again.stats.storage_corrupt_pages == 0
        req.abort()
    finally:
        again.close()
        files.raw.close()


# ---- through SGLang's HiCache backend ------------------------------------------------------------
def test_a_mamba_snapshot_three_bytes_short_is_deleted_counted_and_written_again_through_the_sglang_backend(store, request):
    from support.sglang_helpers import PoolName, PoolTransfer, _mamba_pool, attach, mha_pool, page_keys, storage_config

    state = _mamba_pool(seed=41)
    sg = attach(storage_config(store.url, model=model_of(request)), mha_pool(), (PoolName.MAMBA, state))
    keys = page_keys(list(range(12)), 4)
    slots, into = torch.tensor([3, 7, 11]), torch.tensor([0, 5, 16])

    def transfer(where):
        return [PoolTransfer(name=PoolName.MAMBA, host_indices=where, keys=keys)]

    assert sg.batch_set_v2(transfer(slots))[PoolName.MAMBA] == [True] * 3
    raw = dataclasses.replace(store, raw=sg.backend)
    name = sg._pool(PoolName.MAMBA).names([keys[1]])[0]
    good = raw.read(name)
    raw.write(name, good[:-3])
    before = [state.get_data_page(d).clone() for d in into.tolist()]
    assert sg.batch_get_v2(transfer(into))[PoolName.MAMBA] == [True, False, False]
    stats = sg.get_stats()
    assert (stats.corrupt, stats.faults, sg.backend.stats.errors, sg.breaker.opened) == (1, 0, 0, 0)  # corrupt, no store fault
    assert raw.read(name) is None  # deleted: the next save writes it again
    assert torch.equal(state.get_data_page(0), state.get_data_page(3))
    assert all(torch.equal(state.get_data_page(d), b) for d, b in zip(into.tolist()[1:], before[1:]))  # no byte of it served
    written = stats.pages_written
    assert sg.batch_set_v2(transfer(slots))[PoolName.MAMBA] == [True] * 3
    assert sg.get_stats().pages_written == written + 2 and raw.read(name) == good
    assert sg.batch_get_v2(transfer(into))[PoolName.MAMBA] == [True] * 3
    assert all(torch.equal(state.get_data_page(d), state.get_data_page(s)) for s, d in zip(slots.tolist(), into.tolist()))
    assert sg.get_stats().corrupt == 1
    sg.close()


@pytest.mark.integration
def test_a_value_of_the_wrong_size_through_redis_pys_cluster_pipeline_is_wrong_size_too(tmp_path):
    """Keys a cluster node redirects, or whose node failed, are read through redis-py's pipeline: a value of
    another size is reported as such there too (before: an error, so it was never deleted)."""
    from kvtier.app.devservers import start_redis_cluster
    from kvtier.l3.base import KeyStatus

    servers = start_redis_cluster(tmp_path)
    try:
        b = open_backend(f"redis+cluster://127.0.0.1:{servers[0].port}?timeout=2")
        b.client.set("heal/short", b"x" * 99)
        b.client.set("heal/whole", b"y" * 100)
        outs = [[memoryview(bytearray(100))] for _ in range(3)]
        assert b._get_via_client(["heal/short", "heal/absent", "heal/whole"], outs) == [KeyStatus.WRONG_SIZE, KeyStatus.MISS, KeyStatus.OK]
        assert bytes(outs[2][0]) == b"y" * 100 and b.stats.errors == 0
        b.close()
    finally:
        for s in servers:
            s.stop()


# ---- a corrupt object is repaired by the next save -----------------------------------------------
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


# ---- a header's valid_tokens is checked: a partial page is never a page --------------------------
def test_header_valid_tokens_must_be_a_whole_page(tmp_path):
    spec = sc.tiny()
    codec = PageCodec.for_spec(spec)
    key = page_keys(list(range(4)), 4, Namespace("v", spec.fingerprint()).root())[0]
    payload = memoryview(bytearray(os.urandom(codec.payload_bytes)))
    good = codec.header(key, payload) + bytes(payload)
    partial = codec.header(key, payload, valid_tokens=3) + bytes(payload)  # checksum correct, page partial
    assert codec.check(memoryview(good), key) == "ok"
    assert codec.check(memoryview(partial), key) == "valid_tokens"
