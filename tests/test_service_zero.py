"""``kvtier serve --zero-evicted-pages`` (issue 56, item 4): a region page evicted from one engine's namespace reaches the
next engine that reserves it zeroed -- never holding what another tenant's engine wrote there. A real service on a
temp socket; the bytes read through the second engine's own mapping of the region."""

from __future__ import annotations

import pytest

from support.service import query_status_of, running_service
from support.service_peer import NAMESPACE, SPEC, fill

from kvtier.pools.host import HostPool
from kvtier.service.client import ServiceClient
from kvtier.service.region import RegionFormat, map_region

OTHER = NAMESPACE + "-other"


@pytest.mark.parametrize("zero", [True, False], ids=["zeroed", "not zeroed"])
def test_a_page_evicted_from_the_region_reaches_the_next_engine_zeroed(tmp_path, zero):
    with running_service(tmp_path, 0.01, *(["--zero-evicted-pages"] if zero else [])) as svc:
        fmt = RegionFormat.of(SPEC, "page_first")
        a = ServiceClient(svc.socket, NAMESPACE, fmt)
        b = None
        try:
            pool_a = HostPool(SPEC, a.num_pages, "page_first", memory=map_region(a.region, a.region_size))
            mine = a.reserve(a.num_pages)
            fill(pool_a, mine, 0xA5)
            a.publish_and_release(mine, [p.to_bytes(16, "big") for p in mine])  # offered, held by nobody: evictable
            b = ServiceClient(svc.socket, OTHER, fmt)
            pool_b = HostPool(SPEC, b.num_pages, "page_first", memory=map_region(b.region, b.region_size))
            got = b.reserve(8)  # the region is full of a's pages: eight are evicted for b
            assert len(got) == 8 and set(got) <= set(mine)
            held = [bool((t[got] == 0xA5).any()) for t in pool_b.buffers.values()]
            zeros = [bool((t[got] == 0).all()) for t in pool_b.buffers.values()]
            status = query_status_of(svc.socket)()
            if zero:
                assert all(zeros) and not any(held)
                assert status["zeroed_pages"] == 8 and status["evicted_pages"] == 8
            else:  # (what the flag prevents: b reads a's bytes)
                assert all(held) and status["zeroed_pages"] is None
            rest = [p for p in mine if p not in got]
            assert [a.lookup([p.to_bytes(16, "big")]) for p in rest[:3]] == [[p] for p in rest[:3]]  # a's others untouched
            assert all(bool((t[rest] == 0xA5).all()) for t in pool_a.buffers.values())
        finally:
            if b is not None:
                b.close()
            a.close()
