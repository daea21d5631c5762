"""The node service's page records (:mod:`kvtier.service.records`), on a real region file: a page's
checksum is of its bytes in every buffer and layer (both host layouts), a record is adopted only whole and
only with bytes that match it, one torn by a kill mid-write is parked, a torn namespace line is ignored."""

from __future__ import annotations

import os

import pytest
import torch

from support.pools import tiny_specs

from kvtier.pools.host import HostPool
from kvtier.service.records import RECORD_BYTES, PageRecords, Writer, session_digest
from kvtier.service.region import Owner, RegionFormat, create_region, map_region, remove_region
from kvtier.service.tenants import NAMESPACE_OWNER, owner_id

SPEC = tiny_specs()["dsa"]


@pytest.fixture(params=["page_first", "layer_first"])
def region(request):
    r = create_region(RegionFormat.of(SPEC, request.param), 8 * SPEC.page_bytes)
    yield r
    remove_region(r)


def _records(region, fresh: bool) -> tuple[PageRecords, HostPool]:
    memory = map_region(region.path, region.size, pin=False)
    pool = HostPool(SPEC, region.num_pages, region.format.layout, memory=memory)
    return PageRecords(region, memory.numpy(), verify_sample=1.0, fresh=fresh, keep=memory), pool


def _write(pool: HostPool, page: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(SPEC.num_layers):
        for name, t in pool.buffers.items():
            rows = pool.layout.page_layers(t, page)
            rows[layer].copy_(torch.randint(0, 256, rows[layer].shape, dtype=torch.uint8, generator=g))


def test_every_byte_of_a_page_in_every_buffer_and_layer_is_covered_and_no_byte_of_another(region):
    records, pool = _records(region, fresh=True)
    _write(pool, 3, seed=1)
    records.reserved([3], 1)
    records.indexed(3, "ns", b"k" * 16)
    assert records.verify(3)
    for name, t in pool.buffers.items():
        for layer in range(SPEC.num_layers):
            row = pool.layout.page_layers(t, 3)[layer]
            row[-1] ^= 1
            assert not records.verify(3), (name, layer)
            row[-1] ^= 1
    _write(pool, 2, seed=2)
    _write(pool, 4, seed=3)  # neighbours in every layout
    assert records.verify(3)
    records.close()


def test_adopting_keeps_whole_matching_records_and_parks_writing_and_torn_ones(region):
    records, pool = _records(region, fresh=True)
    tenant = owner_id("0123456789abcdef")
    for page, ns in ((0, "a"), (1, "b"), (2, "a"), (3, "a")):
        _write(pool, page, seed=page)
        records.reserved([page], 1)
        records.indexed(page, ns, bytes([page]) * 16, tenant if page == 1 else NAMESPACE_OWNER)
    records.indexed(5, "a", bytes([0]) * 16)  # the same key again on another page (its first page evicted, not rewritten)
    records.writer_of = lambda client: (os.getpid(), "session-4")
    records.reserved([4], 1)  # mid-write at the kill, by this process
    pool.layout.page_layers(pool.buffers["latent"], 2)[0][0] ^= 0xFF  # changed after its write
    records._map[3 * RECORD_BYTES + 20] ^= 1  # torn: the record no longer matches its own hash
    records.close()
    with open(os.path.join(os.path.dirname(region.path), "namespaces"), "ab") as f:
        f.write(b'"half-writ')  # a line torn by the kill
    again, _pool = _records(region, fresh=False)
    adopted = again.adopt()
    # (each with its owner: a tenant's bounds hold across the restart)
    assert adopted.pages == [(0, "a", bytes([0]) * 16, NAMESPACE_OWNER), (1, "b", bytes([1]) * 16, tenant)]
    writer = Writer(Owner.of(os.getpid()), session_digest("session-4"))
    assert adopted.quarantined == {3: None, 4: writer} and adopted.dropped == 1  # (the torn one's writer unknown)
    second = again.adopt()  # a second adopter finds the same: the dropped page's record cleared, the parked ones kept
    assert (second.pages, second.quarantined, second.dropped) == (adopted.pages, adopted.quarantined, 0)
    again.indexed(6, "c", b"x")  # a new namespace after the torn line is read back by the next adopter
    _write(pool, 6, seed=9)
    again.indexed(6, "c", b"x")
    again.close()
    third, _pool = _records(region, fresh=False)
    assert (6, "c", b"x", NAMESPACE_OWNER) in third.adopt().pages
    third.close()
