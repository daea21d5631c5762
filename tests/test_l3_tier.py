"""The storage tier's parallel scattered I/O: batches run on several threads, results land in order.

The store is the real file backend; :class:`~support.proxies.Injecting` wraps it to delay, fail or
hold individual calls (a fault injector around the real thing, not a stand-in),
one page per call, so a job of ten pages is ten batches with up to
``2 * io_threads`` in flight. The counts that size a tier's buffers and threads are bounded before
anything is allocated.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kvtier.config import StorageConfig
from kvtier.errors import ConfigError
from kvtier.hashing import Namespace, PageHash
from kvtier.l3 import open_backend
from kvtier.l3.base import KeyStatus
from kvtier.l3.page import HEADER_BYTES
from kvtier.l3.tier import StorageTier
from kvtier.pools import HostPool
from support.l3_scenarios import tiny
from support.proxies import Injecting

PAGES = 10


def filled_pool(seed: int) -> HostPool:
    pool = HostPool(tiny(), PAGES, "page_first")
    g = torch.Generator().manual_seed(seed)
    for t in pool.buffers.values():
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    return pool


def page_bytes(pool: HostPool, page: int) -> bytes:
    """One host page's bytes in page-object payload order, whatever the pool's layout."""
    return b"".join(bytes(pool.layout.page_layers(t, page).contiguous().numpy()) for t in pool.buffers.values())


@pytest.fixture
def store(tmp_path):
    """(a tier that saved PAGES random pages, its keys, a fresh tier over an empty pool and an injecting backend)."""
    spec = tiny()
    ns = Namespace("tier-test", spec.fingerprint())
    src = filled_pool(1)
    keys = [PageHash(os.urandom(16)) for _ in range(PAGES)]
    writer = StorageTier(open_backend(f"file://{tmp_path}"), src, ns)
    job = writer.submit("save", keys, list(range(PAGES)))
    assert job.wait(10) and job.statuses == [KeyStatus.OK] * PAGES
    writer.close()
    dst = HostPool(spec, PAGES, "page_first")
    backend = Injecting(open_backend(f"file://{tmp_path}"), writer.codec.object_bytes)
    tier = StorageTier(backend, dst, ns, io_threads=2)
    yield src, keys, tier, backend
    tier.close()


def idle(tier: StorageTier) -> bool:
    """No scattered batch is in flight (each holds a header slab until it returns)."""
    return tier.mover.slabs_free == tier._in_flight


def test_batches_finishing_out_of_order_land_in_order(store):
    src, keys, tier, backend = store
    backend.before_get = lambda i: time.sleep(0.03 if i % 2 == 0 else 0.0)  # even calls finish after odd ones
    job = tier.submit("prefetch", keys, list(range(PAGES)))
    assert job.wait(10)
    assert backend.finished != sorted(backend.finished), "the batches must really finish out of order for this test to mean anything"
    assert job.arrived == PAGES and job.statuses == [KeyStatus.OK] * PAGES and job.corrupt == 0
    assert all(page_bytes(tier.host, p) == page_bytes(src, p) for p in range(PAGES))
    assert idle(tier)


def test_a_corrupt_page_ends_the_prefix_and_later_batches_are_not_counted(store):
    src, keys, tier, backend = store
    path = backend.inner._path(tier.key(keys[4]))
    data = bytearray(open(path, "rb").read())
    data[HEADER_BYTES + 3] ^= 0xFF
    open(path, "wb").write(bytes(data))
    job = tier.submit("prefetch", keys, list(range(PAGES)))
    assert job.wait(10)
    assert job.arrived == 4 and job.corrupt == 1
    assert job.statuses == [KeyStatus.OK] * 4 + [KeyStatus.ERROR]  # pages after 4 read in flight, not counted
    assert all(page_bytes(tier.host, p) == page_bytes(src, p) for p in range(4))
    assert backend.calls("get") <= 5 + tier._in_flight  # nothing submitted after the failure was seen
    assert idle(tier)


def test_cancel_stops_submitting_and_the_job_waits_for_batches_in_flight(store):
    _src, keys, tier, backend = store
    release = threading.Event()
    # every read waits (not only the first call: under load another batch's read can be the first), so
    # nothing completes and frees a slot in the window before the cancel
    backend.before_get = lambda i: release.wait(5)
    job = tier.submit("prefetch", keys, list(range(PAGES)))
    deadline = time.monotonic() + 5
    while backend.calls("get") < min(tier._in_flight, tier.io_threads) and time.monotonic() < deadline:
        time.sleep(0.005)
    job.cancel()
    assert not job.wait(0.1), "the job must not finish while its first batch is still reading"
    release.set()
    assert job.wait(10)
    assert job.arrived < PAGES and backend.calls("get") <= tier._in_flight
    assert idle(tier)


def test_a_batch_that_raises_fails_the_job_and_the_worker_keeps_going(store):
    src, keys, tier, backend = store
    bad = tier.key(keys[3])  # page 3's batch raises, whichever I/O thread reaches the store first
    reads = backend.get_scattered

    def boom(names, outs):
        if bad in names:
            raise RuntimeError("injected")
        return reads(names, outs)

    backend.get_scattered = boom
    job = tier.submit("prefetch", keys, list(range(PAGES)))
    assert job.wait(10)
    assert job.statuses == [KeyStatus.OK] * 3 + [KeyStatus.ERROR] * (PAGES - 3)
    assert job.arrived == 3  # the prefix ends at the batch that raised; batches after it do not count
    assert idle(tier)
    del backend.get_scattered
    again = tier.submit("prefetch", keys, list(range(PAGES)))
    assert again.wait(10) and again.arrived == PAGES
    assert all(page_bytes(tier.host, p) == page_bytes(src, p) for p in range(PAGES))


def test_parallel_saves_store_every_page_and_a_failed_batch_ends_the_job(tmp_path):
    spec = tiny()
    ns = Namespace("tier-save", spec.fingerprint())
    src = filled_pool(2)
    probe = StorageTier(open_backend(f"file://{tmp_path}"), src, ns)
    backend = Injecting(open_backend(f"file://{tmp_path}"), probe.codec.object_bytes)
    probe.close()
    tier = StorageTier(backend, src, ns, io_threads=2)
    backend.before_set = lambda i: time.sleep(0.02 if i % 3 == 0 else 0.0)
    keys = [PageHash(os.urandom(16)) for _ in range(PAGES)]
    job = tier.submit("save", keys, list(range(PAGES)))
    assert job.wait(10) and job.statuses == [KeyStatus.OK] * PAGES
    assert backend.exists([tier.key(k) for k in keys]) == PAGES
    # a store that fails page 6 (by its key: the I/O threads may reach the store in either order): earlier
    # pages OK, the rest recorded as failed, nothing raised
    more = [PageHash(os.urandom(16)) for _ in range(PAGES)]
    bad = tier.key(more[6])
    writes = backend.set_scattered
    backend.set_scattered = lambda names, parts: [KeyStatus.ERROR] * len(names) if bad in names else writes(names, parts)
    job = tier.submit("save", more, list(range(PAGES)))
    assert job.wait(10)
    assert job.statuses == [KeyStatus.OK] * 6 + [KeyStatus.ERROR] * 4
    assert idle(tier)
    tier.close()
    # what was saved reads back bit-exact into another pool
    dst = HostPool(spec, PAGES, "page_first")
    reader = StorageTier(open_backend(f"file://{tmp_path}"), dst, ns)
    job = reader.submit("prefetch", keys, list(range(PAGES)))
    assert job.wait(10) and job.arrived == PAGES
    assert all(page_bytes(dst, p) == page_bytes(src, p) for p in range(PAGES))
    reader.close()


def test_io_threads_is_validated():
    with pytest.raises(ConfigError, match="io_threads must be an integer >= 1"):
        StorageConfig(url="file:///tmp/x", io_threads=0)



def test_batch_and_thread_counts_are_bounded_before_anything_is_allocated():
    from kvtier.config import StorageConfig
    from kvtier.errors import ConfigError
    from kvtier.integrations.sglang.options import SGLangStorageOptions

    for make in (lambda **kw: SGLangStorageOptions(**kw), lambda **kw: StorageConfig(url="file:///tmp/x", **kw)):
        with pytest.raises(ConfigError, match=r"batch_pages must be an integer >= 1, <= 4096; got 1000000000"):
            make(batch_pages=10**9)
        with pytest.raises(ConfigError, match=r"io_threads must be an integer >= 1, <= 64; got 1000000"):
            make(io_threads=10**6)
        make(batch_pages=4096, io_threads=64)  # the bounds themselves are fine


def test_io_threads_default_to_the_backends_choice_and_config_overrides(tmp_path):
    from kvtier.build import open_storage_tier

    spec = tiny()
    host = HostPool(spec, 4, "page_first")
    ns = Namespace("threads", spec.fingerprint())
    for io_threads, want in ((None, 2), (3, 3)):  # file: two threads copying on two cores
        tier = open_storage_tier(StorageConfig(url=f"file://{tmp_path}", io_threads=io_threads), host, ns)
        assert tier.io_threads == want and tier._io._max_workers == want and tier._in_flight == 2 * want
        tier.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_a_store_of_whole_objects_round_trips_and_a_corrupt_object_never_reaches_the_page(layout):
    """memory:// takes whole objects only: the page mover stages each, checks it, and copies the
    payload out only when it passes, so a corrupt object leaves the host page as it was."""
    spec = tiny()
    ns = Namespace("whole", spec.fingerprint())
    src = HostPool(spec, PAGES, layout)
    for t in src.buffers.values():
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    backend = open_backend("memory://")
    assert not backend.capabilities.scattered
    tier = StorageTier(backend, src, ns)
    keys = [PageHash(os.urandom(16)) for _ in range(PAGES)]
    assert tier.submit("save", keys, list(range(PAGES))).wait(10)
    name = tier.key(keys[3])
    obj = bytearray(backend.data[name])
    obj[-1] ^= 0xFF
    backend.data[name] = bytes(obj)
    dst = HostPool(spec, PAGES, "layer_first" if layout == "page_first" else "page_first")
    reader = StorageTier(backend, dst, ns, owns_backend=False)
    job = reader.submit("prefetch", keys, list(range(PAGES)))
    assert job.wait(10) and (job.arrived, job.corrupt) == (3, 1)
    assert all(page_bytes(dst, p) == page_bytes(src, p) for p in range(3))
    assert page_bytes(dst, 3) == bytes(len(page_bytes(dst, 3)))  # untouched: still zero
    assert name not in backend.data and reader.discarded_corrupt == 1  # deleted: the next save writes it again
    assert tier.submit("save", keys, list(range(PAGES))).wait(10)
    again = reader.submit("prefetch", keys, list(range(PAGES)))
    assert again.wait(10) and again.arrived == PAGES
    assert all(page_bytes(dst, p) == page_bytes(src, p) for p in range(PAGES))
    reader.close()
    tier.close()
