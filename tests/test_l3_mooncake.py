"""L3 over a real Mooncake Store: a mooncake_master started on 127.0.0.1, clients pinned to loopback over TCP."""

import os

import numpy as np
import pytest

from support.cache_helpers import make_tiered_cache, serve, serve_tiered
from kvtier.app.devservers import MooncakeMaster, wait_until
from support import l3_scenarios as sc

pytestmark = pytest.mark.integration


@pytest.fixture
def master():
    m = MooncakeMaster().start()
    yield m
    m.stop()


def overwrite_mooncake_byte(backend, key, offset):
    """Read the object, flip a byte, write it back (upsert) through the same client."""
    size = backend.store.get_size(key)
    buf = memoryview(bytearray(size))
    assert backend.get([key], [buf])[0].value == "ok"
    buf[offset] ^= 0xFF
    backend.store.remove(key, True)
    arr = np.frombuffer(buf, dtype=np.uint8).copy()
    assert backend.store.put(key, arr.tobytes()) == 0


@pytest.mark.parametrize("spec_name", ["deepseek-v3.2", "llama-3.1-8b"])
def test_round_trip_bit_exact(master, spec_name):
    sc.round_trip(master.url, sc.real_specs()[spec_name])


def test_namespace_isolation(master):
    sc.namespace_isolation(master.url)


def test_corrupted_page_is_a_miss(master):
    sc.corrupted_page_is_a_miss(master.url, overwrite_mooncake_byte)


def test_wrong_header_is_a_miss(master):
    sc.wrong_header_is_a_miss(master.url, overwrite_mooncake_byte)


def test_master_killed_mid_run_then_restarted(master):
    spec = sc.tiny()
    cache = make_tiered_cache(spec, 6, 16, master.url, model="fault")
    before = [list(range(i * 100, i * 100 + 16)) for i in range(3)]
    for toks in before:
        serve(cache, toks)
    cache.wait_idle()
    assert cache.stats.storage_saved_pages == 12
    master.kill()
    for toks in [list(range(i * 100, i * 100 + 16)) for i in range(3, 9)]:
        serve(cache, toks)
    for toks in before:
        d, h, s, c = serve_tiered(cache, toks)
        assert s == 0
    cache.wait_idle()
    assert cache.stats.storage_failures > 0
    cache.check_integrity()
    master.start()  # same ports: the client re-mounts its segment and the tier resumes
    fresh = list(range(5000, 5016))

    def saved_again() -> bool:
        cache.evict_device(6)
        cache.evict_host(16)
        serve(cache, fresh)
        cache.wait_idle()
        m = cache.match(fresh)
        return m.num_device_pages == 4 and cache.stats.storage_saved_pages > 12

    wait_until(saved_again, timeout=20, what="Mooncake saves to resume after the master restart")
    cache.evict_device(6)
    cache.evict_host(16)
    d, h, s, c = serve_tiered(cache, fresh)
    assert (s, c) == (4, 0), (d, h, s, c)
    cache.wait_idle()
    cache.check_integrity()
    cache.close()


def test_scattered_get_and_set_registered_and_through_the_bounce_buffer(master):
    """Registered buffers go straight to the store (multi-buffer put/get); unregistered ones bounce.
    Either way the bytes are exact, a miss is a miss, and an object of another size than asked is WRONG_SIZE
    (never a store fault: the reader deletes it)."""
    from kvtier.l3 import open_backend
    from kvtier.l3.base import KeyStatus

    be = open_backend(master.url)
    try:
        rng = np.random.default_rng(7)
        heads, bodies, tails = (rng.integers(0, 256, (3, n), dtype=np.uint8) for n in (72, 4000, 600))
        for arr in (heads, bodies, tails):
            be.register_buffer(memoryview(arr).cast("B"))
        parts = [[memoryview(heads[i]), memoryview(bodies[i]), memoryview(tails[i])] for i in range(3)]
        keys = [f"scatter/{i}" for i in range(3)]
        assert be.set_scattered(keys[:2], parts[:2]) == [KeyStatus.OK] * 2  # direct
        loose = [memoryview(bytearray(bytes(p))) for p in parts[2]]  # not registered: bounced
        assert be.set_scattered(keys[2:], [loose]) == [KeyStatus.OK]
        expect = [b"".join(bytes(p) for p in ps) for ps in parts]
        reg_out = np.zeros((2, 4672), dtype=np.uint8)
        be.register_buffer(memoryview(reg_out).cast("B"))
        direct = [[memoryview(reg_out[i][:72]), memoryview(reg_out[i][72:])] for i in range(2)]
        assert be.get_scattered([keys[2], keys[0]], direct) == [KeyStatus.OK] * 2
        assert [bytes(reg_out[0]), bytes(reg_out[1])] == [expect[2], expect[0]]
        bounced = [[memoryview(bytearray(100)), memoryview(bytearray(4572))] for _ in range(3)]
        statuses = be.get_scattered([keys[1], "scatter/absent", keys[0]], bounced)
        assert statuses == [KeyStatus.OK, KeyStatus.MISS, KeyStatus.OK]
        assert b"".join(bytes(p) for p in bounced[0]) == expect[1] and b"".join(bytes(p) for p in bounced[2]) == expect[0]
        assert be.get_scattered([keys[0]], [[memoryview(bytearray(10))]]) == [KeyStatus.WRONG_SIZE]
        assert be.get_scattered([keys[0]], [[memoryview(reg_out[0][:4000])]]) == [KeyStatus.WRONG_SIZE]  # registered: direct
        longer = np.zeros(5000, dtype=np.uint8)
        be.register_buffer(memoryview(longer))
        assert be.get_scattered([keys[0]], [[memoryview(longer)]]) == [KeyStatus.WRONG_SIZE]
        assert be.stats.errors == 0
    finally:
        be.delete([f"scatter/{i}" for i in range(3)])
        be.close()


def test_one_io_thread_by_default_and_registering_a_pool_twice_is_harmless(master):
    """Mooncake runs a batch's transfers in parallel itself: the tier uses one I/O thread unless told
    otherwise. A second tier over the same host pool registers memory already registered: no error,
    and its pages still move straight to and from the store, bit-exact."""
    import torch

    from kvtier.hashing import Namespace, PageHash
    from kvtier.l3 import open_backend
    from kvtier.l3.tier import StorageTier
    from kvtier.pools import HostPool

    spec = sc.tiny()
    host = HostPool(spec, 4, "page_first")
    for t in host.buffers.values():
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    want = [t.clone() for t in host.buffers.values()]
    backend = open_backend(master.url)
    ns = Namespace("twice", spec.fingerprint())
    first = StorageTier(backend, host, ns)
    assert first.io_threads == 1
    second = StorageTier(backend, host, ns, io_threads=2)  # registers its own staging and headers, not the pool again
    assert second.io_threads == 2
    bases = [base for base, _size in backend._regions]
    assert all(bases.count(t.data_ptr()) == 1 for t in host.buffers.values())
    keys = [PageHash(os.urandom(16)) for _ in range(4)]
    assert second.submit("save", keys, [0, 1, 2, 3]).wait(10)
    for t in host.buffers.values():
        t.zero_()
    job = second.submit("prefetch", keys, [0, 1, 2, 3])
    assert job.wait(10) and job.arrived == 4
    assert all(torch.equal(t, w) for t, w in zip(host.buffers.values(), want))
    first.close()  # closes the shared backend too: the second is done with it


def test_header_slabs_that_grow_keep_their_registered_memory(master):
    """The page mover's header slabs grow when a pool of smaller pages registers (SGLang: a Mamba state
    pool after the KV pool; a Mooncake batch holds more of them). The block they grow from stays alive,
    as registered memory must: freed, it was where the next block could land -- memory Mooncake refuses
    to register twice ("overlapped memory region"), so the SGLang backend with a Mamba pool failed to start."""
    import gc
    import weakref

    from kvtier.l3 import open_backend
    from kvtier.l3.breaker import CircuitBreaker
    from kvtier.l3.mover import PageMover

    be = open_backend(master.url)
    try:
        mover = PageMover(be, CircuitBreaker(be, 1.0, 1.0, probe_key="ns/probe"))
        mover.reserve_slabs(4, 1000)
        with mover._heads(1) as slab:
            first = weakref.ref(slab.base)  # the registered block the slabs are rows of
        del slab
        mover.reserve_slabs(4, 2000)
        gc.collect()
        assert first() is not None and mover.slabs_free == 4
    finally:
        be.close()
