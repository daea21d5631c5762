"""A hybrid model on the node service (issue 54, item 1): the region holds, beside each page, one object of each of the
model's other KV groups that keeps objects of its own (a window page, a state snapshot: an *object pool* per group);
an engine publishes the objects a copy to host wrote under their group keys, and pages adopted from another engine
bring the objects the service holds for them. Outputs equal a full recompute bit for bit; the objects verify across a
service restart; a flipped byte is never handed out; an engine whose service dies goes on with misses.

The format, the index's pools and the client's checks step by step; then real ``kvtier serve`` processes, the hybrid
reference model's engines (``kvtier run --model hybrid`` in processes of their own, and in this process)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from kvtier import DevicePool
from kvtier.app.engine import HybridEngine
from kvtier.app.model import ModelConfig
from kvtier.app.model.hybrid import FULL, SLIDING, STATE, HybridConfig, HybridReferenceModel
from kvtier.build import TierConfig, build_hybrid_cache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import NullCache
from kvtier.core.plans import Tier
from kvtier.errors import ServiceError, ServiceProtocolError
from kvtier.hashing import group_object_key
from kvtier.pools.host import HostPool
from kvtier.service.client import check_found
from kvtier.service.index import HostIndex
from kvtier.service.records import _page_spans
from kvtier.service.region import ObjectPool, Region, RegionFormat, RowObject, map_region
from support.cli import SMALL, kvtier
from support.service import query_status_of, remove_regions, running_service, start_service, stop, store_files, wait_until

pytestmark = pytest.mark.timeout(300)

BASE = ModelConfig(hidden=64, num_layers=3, num_heads=2, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16, kv_lora_rank=32,
                   index_heads=2, index_head_dim=32, quant_block_size=16, index_topk=24, mlp_hidden=128, page_size=8)
CFG = HybridConfig(base=BASE, window=12, swa_heads=2, swa_head_dim=16, state_heads=2, state_dim=8, state_every=2)
MODEL = CFG.model_spec()
FULL_SPEC = MODEL.group(FULL).attention
POOLS = [ObjectPool(SLIDING, MODEL.group(SLIDING).object_spec()), ObjectPool(STATE, MODEL.group(STATE).object_spec())]


def _format(layout: str = "page_first") -> RegionFormat:
    return RegionFormat.of(FULL_SPEC, layout).with_objects(POOLS)


# ---- the region's format -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_a_format_with_object_pools_crosses_the_wire_whole_and_each_pool_is_a_host_pool_of_its_part(tmp_path, layout):
    """Every pool's host pool over its part of the region writes exactly the bytes the service's records checksum as
    that pool's page (region-wide id ``pool * num_pages + page``), and no other pool's."""
    fmt = _format(layout)
    assert RegionFormat.from_wire(json.loads(json.dumps(fmt.as_wire()))) == fmt
    plain = RegionFormat.of(FULL_SPEC, layout)
    assert fmt.fingerprint != plain.fingerprint and fmt.pools == 3  # (an engine of the same full group without them never shares)
    assert fmt.page_bytes == FULL_SPEC.page_bytes + sum(p.spec.page_bytes for p in POOLS)
    n = 5
    memory = torch.zeros(fmt.size(n), dtype=torch.uint8)
    pools, end = [], 0
    for k, spec in enumerate([FULL_SPEC, *[p.spec for p in POOLS]]):
        start, size = fmt.part(k, n)
        assert start % 4096 == 0 and start == end and size >= n * spec.page_bytes  # (one after another: no two overlap)
        end = start + size
        pools.append(HostPool(spec, n, layout, memory=memory[start : start + size]))
    assert end == fmt.size(n)
    spans = _page_spans(Region(str(tmp_path / "region"), fmt, n, fmt.size(n)))
    for k, pool in enumerate(pools):
        for page in range(n):
            before = memory.clone()
            for b in pool.spec.buffers:
                for layer in range(pool.spec.num_layers):
                    pool.rows(b.name, layer)[page].view(torch.uint8).fill_(k * 16 + page + 1)
            changed = (memory != before).nonzero().flatten().tolist()
            covered = sorted(i for start, length in spans(k * n + page) for i in range(start, start + length))
            assert changed == covered, f"pool {k} page {page}: its host pool and the records' spans disagree"


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_each_ranks_slice_of_a_sharded_pages_object_pools_is_a_host_pool_of_its_own_covered_by_the_records(tmp_path, layout):
    """vLLM above one rank: every object pool holds each rank's shard of an object beside the others' (as the page does),
    each rank's slice a host pool of the group's spec alone. Writing one rank's object of a page changes exactly bytes the
    records checksum as that object's id, and no other rank's slice."""
    tp, n = 2, 3
    fmt = RegionFormat.of_shards(FULL_SPEC, layout, tp).with_objects(POOLS)
    assert [o.shards for o in fmt.objects] == [tp, tp]
    assert RegionFormat.from_wire(json.loads(json.dumps(fmt.as_wire()))) == fmt
    assert fmt.fingerprint != RegionFormat.of(FULL_SPEC, layout).with_objects(POOLS).fingerprint  # (the split is in it)
    assert fmt.page_bytes == tp * (FULL_SPEC.page_bytes + sum(p.spec.page_bytes for p in POOLS))
    memory = torch.zeros(fmt.size(n), dtype=torch.uint8)
    spans = _page_spans(Region(str(tmp_path / "region"), fmt, n, fmt.size(n)))
    slices = []
    for k, pool in enumerate(POOLS, start=1):
        for rank in range(tp):
            start, size = fmt.object_shard(k, n, rank)
            slices.append((start, start + size))
            host = HostPool(pool.spec, n, layout, memory=memory[start : start + size])
            for page in range(n):
                before = memory.clone()
                for b in host.spec.buffers:
                    for layer in range(host.spec.num_layers):
                        host.rows(b.name, layer)[page].view(torch.uint8).fill_(16 * k + 4 * rank + page + 1)
                changed = (memory != before).nonzero().flatten().tolist()
                covered = {i for s, length in spans(k * n + page) for i in range(s, s + length)}
                assert changed and set(changed) <= covered and all(start <= i < start + size for i in changed), (k, rank, page)
    slices.sort()
    assert all(a[1] <= b[0] for a, b in zip(slices, slices[1:]))  # no two ranks' slices overlap
    assert fmt.object_shard(1, n, 0)[0] == fmt.part(1, n)[0]


@pytest.mark.parametrize("change, message", [
    (lambda w: w["object_pools"].__setitem__(0, [SLIDING, {**w["object_pools"][0][1], "num_layers": 3}]), "not the format's"),
    (lambda w: w["object_pools"].append(w["object_pools"][0]), "not the format's"),
    (lambda w: w["object_pools"][0].__setitem__(0, "a/b"), "not the format's"),
    (lambda w: w["object_pools"].clear(), "1 to 8 pools"),
    (lambda w: w.pop("spec"), "beside a page of one spec"),
    (lambda w: w.__setitem__("object_pools", "sliding"), "1 to 8 pools"),
    (lambda w: w["object_pools"].__setitem__(1, [STATE, {"attention": "mha"}]), "not the format's"),
])
def test_a_hellos_object_pools_that_are_not_its_formats_are_refused_typed(change, message):
    wire = json.loads(json.dumps(_format().as_wire()))
    change(wire)
    with pytest.raises(ServiceProtocolError, match=message):
        RegionFormat.from_wire(wire)


@pytest.mark.parametrize("where", ["shard_spec", "object pool"])
def test_a_sharded_hellos_spec_with_a_float_field_is_refused_typed(where):
    """A float equal to a whole number in a hello's spec (its fingerprint the sender's to compute) never makes a region:
    the service sized one with it (an internal error, a directory left behind)."""
    import copy

    full, window = copy.copy(FULL_SPEC), copy.copy(POOLS[0].spec)
    bad = full if where == "shard_spec" else window  # (made past KVSpec's own checks, as a hostile sender's would be)
    object.__setattr__(bad, "num_layers", float(bad.num_layers))
    fmt = RegionFormat.of_shards(full, "layer_first", 2).with_objects([ObjectPool(POOLS[0].name, window)])
    wire = json.loads(json.dumps(fmt.as_wire()))  # (its fingerprint the float spec's: only the spec's own check is left)
    wire["num_layers"] = int(wire["num_layers"])
    with pytest.raises(ServiceProtocolError, match="not the format's|not a spec"):
        RegionFormat.from_wire(wire)


def test_object_pools_of_a_spec_go_beside_a_page_of_a_spec_only():
    rows = RegionFormat.of_rows([RowObject("0123456789abcdef", 4)], [256])
    with pytest.raises(ServiceError, match="a page of a kvtier spec"):
        rows.with_objects(POOLS)


def _rows_format() -> RegionFormat:
    """SGLang's region page: its KV pool's row, and its SWA and Mamba pools (page ids of their own) as object pools of rows."""
    rows = RegionFormat.of_rows([RowObject("0123456789abcdef", 4)], [256])
    return rows.with_objects([ObjectPool.of_row("swa", RowObject("fedcba9876543210", 4), 128),
                              ObjectPool.of_row("mamba", RowObject("00112233445566ff", 1), 1000)])


def test_an_engines_own_pools_are_object_pools_of_rows_round_tripped_on_the_wire_and_bound_by_the_fingerprint():
    fmt = _rows_format()
    back = RegionFormat.from_wire(json.loads(json.dumps(fmt.as_wire())))
    assert back == fmt and back.rows == fmt.rows and back.objects == fmt.objects
    assert fmt.parts() == [(1, (256,)), (1, (128,)), (1, (1000,))] and fmt.page_bytes == 256 + 128 + 1000
    assert fmt.fingerprint != RegionFormat.of_rows([RowObject("0123456789abcdef", 4)], [256]).fingerprint
    # a page's key and its window page's differ (indexed apart), each bound to the pool's name
    assert len({fmt.key_of(0, "h"), fmt.key_of(1, "h"), fmt.key_of(2, "h")}) == 3
    with pytest.raises(ServiceError, match="pools of rows"):  # rows beside a spec, specs beside rows
        RegionFormat.of(FULL_SPEC, "page_first").with_objects(fmt.objects[:1])
    with pytest.raises(ServiceError, match="pools of rows"):
        RegionFormat.of_rows([RowObject("0123456789abcdef", 4)], [256]).with_objects(POOLS)


@pytest.mark.parametrize("change", [
    lambda w: w["object_pools"][0].__setitem__(2, 64),  # another row's bytes
    lambda w: w["object_pools"][0].__setitem__(1, ["fedcba9876543211", 4]),  # another row's fingerprint
    lambda w: w["object_pools"][1].__setitem__(1, ["00112233445566ff", 2]),  # another page size
    lambda w: w["object_pools"][0].pop(),  # a spec pool's shape beside rows
    lambda w: w["row_objects"].__setitem__(0, ["0123456789abcdee", 4]),  # the page's own rows changed
    lambda w: w["object_pools"][0].__setitem__(2, True),
])
def test_a_hellos_object_pools_of_rows_that_are_not_its_formats_are_refused_typed(change):
    wire = json.loads(json.dumps(_rows_format().as_wire()))
    change(wire)
    with pytest.raises(ServiceProtocolError, match="not the format's|not 1 to"):
        RegionFormat.from_wire(wire)


# ---- the index's pools ---------------------------------------------------------------------------------------------
A, B = 1, 2
KEYS = [bytes([i]) * 16 for i in range(1, 9)]


def _index(pages: int = 3) -> HostIndex:
    ix = HostIndex(pages, pools=3)
    ix.attach(A, "m")
    ix.attach(B, "m")
    return ix


def test_each_pool_hands_out_its_own_ids_and_makes_room_by_evicting_its_own_objects_only():
    ix = _index()
    assert ix.reserve(A, 3) == [0, 1, 2] and ix.reserve(A, 3, pool=1) == [3, 4, 5] and ix.reserve(A, 1, pool=2) == [6]
    ix.publish(A, [0, 1, 2], KEYS[:3])
    ix.publish(A, [3, 4, 5], [group_object_key(k, SLIDING) for k in KEYS[:3]])
    ix.release(A, [5, 4, 3, 2, 1, 0])  # nobody holds anything now
    ix.check_integrity()
    got = ix.reserve(B, 2, pool=1)  # room in pool 1: its deepest objects go, never a page of pool 0
    assert sorted(got) == [4, 5] and ix.status().evicted_pages == 2
    assert ix.lookup(A, KEYS[:3]) == [0, 1, 2]  # every page is still there
    assert ix.find(A, [group_object_key(k, SLIDING) for k in KEYS[:3]], 1) == [3, -1, -1]
    ix.check_integrity()
    with pytest.raises(ServiceProtocolError, match="pool 3"):
        ix.reserve(A, 1, pool=3)


def test_find_answers_key_by_key_in_its_pool_and_a_run_never_returns_an_object():
    ix = _index()
    obj = ix.reserve(A, 2, pool=1)
    ix.publish(A, obj, [group_object_key(KEYS[0], SLIDING), KEYS[1]])  # the second under a page's key: a confused (or hostile) engine
    assert ix.lookup(B, KEYS[1:2]) == []  # a run is of pages: an object under a page key ends it
    keys = [KEYS[5], group_object_key(KEYS[0], SLIDING), KEYS[1]]
    assert ix.find(B, keys, 2) == [-1, -1, -1]  # another pool's: never
    assert ix.find(B, keys, 1) == [-1, 3, 4]  # each key on its own, held for B
    assert ix.find(B, keys, 1) == [-1, -1, -1]  # (held by B already: its own tree has them)
    assert ix.status().held == 2
    ix.detach(B)
    ix.check_integrity()


def test_a_find_answer_of_another_pool_or_another_length_or_a_page_twice_is_a_protocol_error():
    assert check_found([-1, 12, 10], 3, 5, 2) == [-1, 12, 10]
    for bad, why in (([4, -1, -1], "not one of its region's 5 of pool 2"), ([-1, 10], "of 3 pages with 2"),
                     ([10, 10, -1], "twice"), ([15, -1, -1], "of pool 2"), (["10", -1, -1], "not one of")):
        with pytest.raises(ServiceProtocolError, match=why):
            check_found(bad, 3, 5, 2)


# ---- engines on a real service ---------------------------------------------------------------------------------------
def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, BASE.vocab_size, (n,), generator=g).tolist()


class Engine:
    """A hybrid reference engine whose cache's host tier is the service at ``sock`` (its group objects too), beside a
    recompute of the same model: :meth:`check` serves a prompt on both and asserts the outputs are equal."""

    def __init__(self, sock: str, device_pages: int = 12, host_pages: int = 40, required: bool = True):
        self.model = HybridReferenceModel(CFG)
        tiers = TierConfig(device_pages=device_pages, host_pages=host_pages, service=sock, service_required=required)
        self.cache = build_hybrid_cache(MODEL, tiers, CacheConfig(write_policy="write_through"), state_every=CFG.state_every)
        pools = {name: DevicePool(dev.spec, 64) for name, (dev, _h) in self.cache.group_pools.items()}
        null = NullCache(DevicePool(FULL_SPEC, 64), pools)
        self.base = HybridEngine(self.model, null, {FULL: null.device, **pools})
        groups = {n: d for n, (d, _h) in self.cache.group_pools.items()}
        self.ours = HybridEngine(self.model, self.cache, {FULL: self.cache.device, **groups})

    def check(self, tokens: list[int]):
        r = self.ours.prefill(tokens)
        b = self.base.prefill(tokens)
        assert torch.equal(r.logits, b.logits), "an output differs from recompute"
        self.cache.wait_idle()
        return r

    def adopted(self) -> dict[str, int]:
        return {c.name: c.adopted for c in self.cache.components}

    def close(self) -> None:
        self.cache.close()


SYSTEM = _prompt(0, 6 * 8)  # six pages: snapshots at 2, 4, 6 (state_every=2), a window of two pages


def test_a_second_engine_gets_the_first_ones_pages_with_their_window_pages_and_snapshots_bit_exact(tmp_path):
    with running_service(tmp_path, 0.05, "--verify-sample", "1") as svc:
        a, b = Engine(svc.socket), Engine(svc.socket)
        try:
            assert {c.name: type(c.alloc[Tier.HOST]).__name__ for c in a.cache.components} == {SLIDING: "ObjectLease",
                                                                                                   STATE: "ObjectLease"}
            a.check(SYSTEM + _prompt(1, 13))  # computed: its pages, window pages and snapshots backed up and published
            st = query_status_of(svc.socket)()
            assert st["object_pools"] == [SLIDING, STATE] and st["published_pages"] > 6
            r = b.check(SYSTEM + _prompt(2, 11))  # another engine: the system prompt's pages are host hits with their objects
            assert r.host_hit_tokens == len(SYSTEM)
            assert b.adopted()[SLIDING] >= 2 and b.adopted()[STATE] >= 1  # the window's pages and the snapshot at 6, at least
            assert query_status_of(svc.socket)()["verify"]["failed_pages"] == 0
            for e in (a, b):
                e.cache.check_integrity(idle=True)
        finally:
            a.close()
            b.close()


def test_an_objects_bytes_flipped_after_their_write_are_never_handed_out(tmp_path):
    """Every window page in the region flipped after its publish: a second engine gets the pages and the snapshots, never
    a window page (each a miss, dropped), and its outputs still equal recompute."""
    with running_service(tmp_path, 0.05, "--verify-sample", "1") as svc:
        a, b = Engine(svc.socket), Engine(svc.socket)
        try:
            a.check(SYSTEM + _prompt(1, 13))
            st = query_status_of(svc.socket)()
            fmt = _format()
            start, size = fmt.part(1, st["region_pages"])
            memory = map_region(st["region"], fmt.size(st["region_pages"]), pin=False)
            memory[start : start + size] ^= 0x40  # every window page's bytes (and the pool's unused ones)
            r = b.check(SYSTEM + _prompt(2, 11))
            assert b.adopted()[SLIDING] == 0 and b.adopted()[STATE] >= 1
            assert r.host_hit_tokens < len(SYSTEM)  # the prefix stops where the window pages are missing
            st = query_status_of(svc.socket)()
            assert st["corrupt_pages"] >= 2 and st["verify"]["failed_pages"] >= 2, st
            b.cache.check_integrity(idle=True)
        finally:
            a.close()
            b.close()


def test_an_engine_whose_service_dies_goes_on_with_misses_and_gets_its_objects_back_from_the_next_one(tmp_path):
    sock = str(tmp_path / "run" / "node.sock")
    svc = start_service(sock, 0.05)
    regions = []
    a = Engine(sock)
    try:
        a.check(SYSTEM + _prompt(1, 13))
        regions.append(query_status_of(sock)()["region"])
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(30)
        wait_until(lambda: a.cache.host.allocator.lost, 30)  # (its heartbeat notices the hang-up)
        a.cache.evict_device(a.cache.device.num_pages)
        r = a.check(SYSTEM + _prompt(3, 9))  # the service is gone: its pages and objects are forgotten, a miss
        assert r.host_hit_tokens == 0
        a.cache.check_integrity(idle=True)
        assert all(len(c.at[Tier.HOST]) == 0 for c in a.cache.components)  # (no object of the old region left in the tree)
        svc = start_service(sock, 0.05, "--fresh-region")
        wait_until(lambda: not a.cache.host.allocator.lost, 30)  # (its heartbeat attaches it again)
        a.check(SYSTEM + _prompt(4, 9))  # computed again, published to the new service
        b = Engine(sock)
        try:
            r = b.check(SYSTEM + _prompt(5, 7))
            assert r.host_hit_tokens == len(SYSTEM) and b.adopted()[SLIDING] >= 2 and b.adopted()[STATE] >= 1
        finally:
            b.close()
        regions.append(query_status_of(sock)()["region"])
        a.cache.check_integrity(idle=True)
    finally:
        a.close()
        stop(svc.proc)
        remove_regions(regions)


def test_an_engine_started_before_its_service_and_one_whose_service_came_back_larger_back_up_their_objects(tmp_path):
    """The group pools over the region are remapped with its pages' -- from none (the engine started first) and to
    another size (a service restarted with more --host-gb): every copy to host goes on, and another engine hits."""
    sock = str(tmp_path / "run" / "node.sock")
    os.makedirs(os.path.dirname(sock), mode=0o700)
    a = Engine(sock, required=False)  # (no service yet: it starts with host misses, and attaches when one answers)
    svc, regions = None, []
    try:
        assert a.cache.host.allocator.lost and a.cache.host.num_pages == 0
        for host_gb in (0.02, 0.05):
            if svc is not None:
                os.kill(svc.proc.pid, signal.SIGKILL)
                svc.proc.wait(30)
                wait_until(lambda: a.cache.host.allocator.lost, 30)
                a.check(_prompt(9, 17))  # (a request while lost: the old region's pages and objects are forgotten)
            svc = start_service(sock, host_gb, "--fresh-region")
            wait_until(lambda: not a.cache.host.allocator.lost, 30)
            regions.append(query_status_of(sock)()["region"])
            pages = query_status_of(sock)()["region_pages"]
            assert a.cache.host.num_pages == pages and all(h.num_pages == pages for _d, h in a.cache.group_pools.values())
            failures = a.cache.stats.transfer_failures
            a.check(SYSTEM + _prompt(int(host_gb * 100), 13))
            assert a.cache.stats.transfer_failures == failures
            b = Engine(sock)
            try:
                r = b.check(SYSTEM + _prompt(5, 7))
                assert r.host_hit_tokens == len(SYSTEM) and b.adopted()[SLIDING] >= 2 and b.adopted()[STATE] >= 1, (host_gb, b.adopted())
            finally:
                b.close()
        a.cache.check_integrity(idle=True)
    finally:
        a.close()
        if svc is not None:
            stop(svc.proc)
        remove_regions(regions)


def test_an_attachment_lost_is_not_replaced_while_an_object_of_its_region_is_still_held(tmp_path):
    """An object of the old region the core still holds (a copy may be writing it) keeps the attachment from being
    replaced, as a page does: once it is freed, the next call attaches again."""
    from kvtier.hashing import Namespace
    from kvtier.service.attach import attach_host_pool

    sock = str(tmp_path / "run" / "node.sock")
    svc = start_service(sock, 0.02)
    regions = [None]
    host = attach_host_pool(sock, FULL_SPEC, "page_first", Namespace(MODEL.name, MODEL.fingerprint()), 8,
                            objects={p.name: p.spec for p in POOLS}, heartbeat_s=None)
    leased = host.allocator
    try:
        regions[0] = query_status_of(sock)()["region"]
        lease = leased.objects(1, SLIDING)
        held = lease.alloc(1).pages  # an object being written
        assert held and leased.num_used == 0
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(30)
        svc = start_service(sock, 0.02, "--fresh-region")
        assert leased.lookup(KEYS[:1]) == [] and leased.lost  # (the dead connection found)
        wait_until(lambda: leased._backoff.due(), 5)
        assert leased.lookup(KEYS[:1]) == [] and leased.lost  # the object of the old region is still held: not attached
        lease.free(held)
        wait_until(lambda: leased.lookup(KEYS[:1]) == [] and not leased.lost, 10)
        regions.append(query_status_of(sock)()["region"])
    finally:
        leased.close(quiesced=True)
        stop(svc.proc)
        remove_regions([r for r in regions if r])


def test_an_engine_told_there_is_no_room_asks_again_a_beat_later(tmp_path):
    """A reservation the full region could not give leaves the engine's pages (and each object pool's) booked as having
    no room; an engine that holds nothing would never give one back to learn otherwise: each heartbeat forgets it."""
    from kvtier.hashing import Namespace
    from kvtier.service.attach import attach_host_pool

    fmt = _format()
    sock = str(tmp_path / "run" / "node.sock")
    with running_service(tmp_path, 4 * fmt.page_bytes / (1 << 30)) as svc:
        ns = Namespace(MODEL.name, MODEL.fingerprint())
        attach = {"objects": {p.name: p.spec for p in POOLS}}
        first = attach_host_pool(sock, FULL_SPEC, "page_first", ns, None, heartbeat_s=None, **attach).allocator
        second = attach_host_pool(svc.socket, FULL_SPEC, "page_first", ns, None, heartbeat_s=0.05, **attach).allocator
        try:
            pages, objects = first.alloc(4).pages, first.objects(1, SLIDING).alloc(4).pages
            assert len(pages) == len(objects) == 4  # every page and window object of the region is the first engine's
            assert second.alloc(1).pages == [] and second.objects(1, SLIDING).alloc(1).pages == []
            assert second.num_free == second.objects(1, SLIDING).num_free == 0  # (no room, as the service said)
            first.free(pages)
            first.objects(1, SLIDING).free(objects)
            wait_until(lambda: second.num_free > 0 and second.objects(1, SLIDING).num_free > 0, 10)
            assert len(second.alloc(1).pages) == len(second.objects(1, SLIDING).alloc(1).pages) == 1
        finally:
            first.close(quiesced=True)
            second.close(quiesced=True)


def test_a_services_l3_keeps_the_window_pages_and_snapshots_as_an_engines_own_l3_does_and_brings_them_back(tmp_path):
    """A service with ``--storage-url`` writes a hybrid engine's pages and group objects through to the store; a new
    service on the same store (its region fresh) brings both back for another engine, whose outputs equal recompute.
    Every object the service wrote is, name and bytes, the one an engine's own L3 writes for the same requests."""
    l3, own_l3 = tmp_path / "l3", tmp_path / "own-l3"
    prompts = [SYSTEM + _prompt(1, 13), SYSTEM + _prompt(2, 11)]
    with running_service(tmp_path, 0.05, "--storage-url", f"file://{l3}") as svc:
        a = Engine(svc.socket)
        try:
            for p in prompts:
                a.check(p)
        finally:
            a.close()
        wait_until(lambda: query_status_of(svc.socket)()["l3"]["saving_pages"] == 0, 30)
    saved = store_files(l3)
    sizes = {len(b) for b in saved.values()}
    assert len(sizes) == 3, sizes  # pages, window pages and snapshots: three sizes of object
    # the same requests on an engine with an L3 of its own, in the same namespace
    model = HybridReferenceModel(CFG)
    own = build_hybrid_cache(MODEL, TierConfig(device_pages=12, host_pages=40), CacheConfig(write_policy="write_through"),
                             StorageConfig(url=f"file://{own_l3}", write_policy="write_through"), state_every=CFG.state_every)
    try:
        eng = HybridEngine(model, own, {FULL: own.device, **{n: d for n, (d, _h) in own.group_pools.items()}})
        for p in prompts:
            eng.prefill(p)
        own.wait_idle()
    finally:
        own.close()
    theirs = store_files(own_l3)
    assert saved and all(theirs.get(name) == data for name, data in saved.items()), "an object the service wrote is not the engine's own"
    with running_service(tmp_path, 0.05, "--storage-url", f"file://{l3}", "--fresh-region") as svc:  # (another region: L3 only)
        b = Engine(svc.socket)
        try:
            r = b.check(SYSTEM + _prompt(3, 9))
            assert r.host_hit_tokens == len(SYSTEM), r  # pages and objects came back from the store through the region
            assert b.adopted()[SLIDING] >= 2 and b.adopted()[STATE] >= 1, b.adopted()
            st = query_status_of(svc.socket)()["l3"]
            assert st["fetched_pages"] > len(SYSTEM) // 8 and st["corrupt_pages"] == 0, st
            b.cache.check_integrity(idle=True)
        finally:
            b.close()


def test_a_find_or_a_lookup_that_names_a_key_twice_gets_it_once_and_the_service_with_l3_stays_up(tmp_path):
    """A client's repeat (never a chain's, never kvtier's engines': a peer's) of keys the service misses in its region and
    holds in its L3: one load reads each once, the answer names each page once, and the service serves on."""
    from kvtier.hashing import Namespace
    from kvtier.service.client import ServiceClient

    l3 = f"file://{tmp_path / 'l3'}"
    tokens = SYSTEM + _prompt(1, 13)
    with running_service(tmp_path, 0.05, "--storage-url", l3) as svc:
        a = Engine(svc.socket)
        try:
            a.check(tokens)
            keys = a.cache.page_keys(tokens)
        finally:
            a.close()
        wait_until(lambda: query_status_of(svc.socket)()["l3"]["saving_pages"] == 0, 30)
    objects = [group_object_key(k, SLIDING) for k in keys]
    with running_service(tmp_path, 0.05, "--storage-url", l3, "--fresh-region") as svc:  # (a fresh region: the store only)
        client = ServiceClient(svc.socket, str(Namespace(MODEL.name, MODEL.fingerprint())), _format(), lookup_deadline_s=10.0)
        try:
            found = client.find([objects[4], objects[4], objects[5]], 1)
            assert found[0] >= 0 and found[1] == -1 and found[2] >= 0, found
            run = client.lookup([keys[0], keys[0], keys[1]])
            assert len(run) == 1, run  # the run ends at the repeat (a chain never repeats)
            assert svc.proc.poll() is None and query_status_of(svc.socket)()["l3"]["fetched_pages"] >= 3
        finally:
            client.close(quiesced=True)


@pytest.mark.integration
def test_kvtier_run_hybrid_through_a_service_killed_and_restarted_keeps_its_window_pages_and_snapshots(tmp_path):
    """Two ``kvtier run --model hybrid`` processes, the service SIGKILLed and started again between them: the second
    engine's host hits come with window pages and snapshots the restarted service verified and offers again, and both
    runs' logits equal recompute."""
    sock = str(tmp_path / "run" / "node.sock")
    svc = start_service(sock, 0.2, "--verify-sample", "1")
    regions = []
    try:
        reports = []
        for i in range(2):
            r = kvtier("run", "--model", "hybrid", "--no-progress", "--json", "-", "--tiers-service", sock, *SMALL, timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
            reports.append(json.loads(r.stdout))
            if i == 0:
                regions.append(query_status_of(sock)()["region"])
                os.kill(svc.proc.pid, signal.SIGKILL)
                svc.proc.wait(30)
                svc = start_service(sock, 0.2, "--verify-sample", "1")
                adopted = query_status_of(sock)()["adopted"]
                assert adopted["pages"] > 0 and adopted["dropped_pages"] == 0, adopted
        for rep in reports:
            assert rep["logits_bit_exact"], rep
        second = reports[1]["groups"]
        assert second["sliding"]["pages_from_service"] > 0 and second["linear"]["snapshots_from_service"] > 0, second
        assert reports[1]["stats"]["host_hit_pages"] > reports[0]["stats"]["host_hit_pages"]
    finally:
        stop(svc.proc)
        remove_regions(regions)

