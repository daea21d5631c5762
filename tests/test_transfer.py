"""Page-aligned transfers: bit-exact round trips, alignment errors that move nothing, property tests."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from kvtier import DevicePool, HostPool, PageAlignmentError, PageIndexError, SpecError, UnknownNameError
from support.pools import fill_random, slots, tiny_specs
from kvtier.core.plans import Tier

LAYOUTS = ["layer_first", "page_first"]


def snapshot(pool):
    if isinstance(pool, HostPool):
        return {k: t.clone() for k, t in pool.buffers.items()}
    return {k: [t.clone() for t in ls] for k, ls in pool.buffers.items()}


def same(a, b):
    return all(torch.equal(x.view(torch.uint8) if x.dtype != torch.uint8 else x, y.view(torch.uint8) if y.dtype != torch.uint8 else y)
               for k in a for x, y in (zip(a[k], b[k]) if isinstance(a[k], list) else [(a[k], b[k])]))


@pytest.mark.parametrize("kind", ["mha", "mla", "dsa"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_bit_exact(kind, layout):
    spec = tiny_specs(page_size=4, num_layers=3)[kind]
    dev = DevicePool(spec, 12)
    host = HostPool(spec, 10, layout)
    fill_random(dev, seed=1)
    src_pages, host_pages, dst_pages = [7, 2, 9, 3], [5, 0, 8, 1], [10, 11, 4, 0]
    originals = [dev.page_bytes(p) for p in src_pages]
    host.backup_from_device_all_layer(dev, slots(host_pages, 4), slots(src_pages, 4))
    for layers in dev.buffers.values():
        for t in layers:
            t.zero_()
    for layer in range(spec.num_layers):
        host.load_to_device_per_layer(dev, slots(host_pages, 4), slots(dst_pages, 4), layer)
    assert [dev.page_bytes(p) for p in dst_pages] == originals
    assert [host.page_bytes(p) for p in host_pages] == originals
    # untouched device pages stay zero
    assert all(set(dev.page_bytes(p)) == {0} for p in range(12) if p not in dst_pages)


def test_dsa_scales_region_travels():
    spec = tiny_specs(page_size=4, num_layers=2)["dsa"]
    dev, host = DevicePool(spec, 4), HostPool(spec, 4, "page_first")
    keys_bytes = spec.page_size * spec.index_head_dim
    idx = dev.buffer("indexer", 1)
    idx[2, keys_bytes:] = torch.arange(idx.shape[1] - keys_bytes, dtype=torch.uint8) + 1  # scales only
    scales = idx[2, keys_bytes:].clone()
    host.backup_from_device_all_layer(dev, slots([3], 4), slots([2], 4))
    idx.zero_()
    host.load_to_device_per_layer(dev, slots([3], 4), slots([1], 4), 1)
    assert torch.equal(idx[1, keys_bytes:], scales) and scales.count_nonzero() == scales.numel()


@pytest.mark.parametrize(
    "host_idx, message",
    [
        ([0, 1, 2], "3 token slots is not a multiple of page_size 4"),
        ([2, 3, 4, 5], "starts at slot 2, which is not on a page boundary"),
        ([0, 1, 2, 4], "are not consecutive"),
    ],
)
@pytest.mark.parametrize("direction", ["load", "backup"])
def test_misaligned_indices_raise_and_move_nothing(host_idx, message, direction):
    spec = tiny_specs(page_size=4, num_layers=2)["dsa"]
    dev, host = DevicePool(spec, 4), HostPool(spec, 4)
    fill_random(dev, 2)
    fill_random(host, 3)
    before_dev, before_host = snapshot(dev), snapshot(host)
    dev_idx = torch.arange(len(host_idx))
    with pytest.raises(PageAlignmentError) as e:
        if direction == "load":
            host.load_to_device_per_layer(dev, torch.tensor(host_idx), dev_idx, 0)
        else:
            host.backup_from_device_all_layer(dev, torch.tensor(host_idx), dev_idx)
    assert message in str(e.value) and "host indices for host pool" in str(e.value)
    assert isinstance(e.value, ValueError)
    assert same(snapshot(dev), before_dev) and same(snapshot(host), before_host)


def test_aligned_eight_slots_succeed_and_device_side_named():
    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    dev, host = DevicePool(spec, 4), HostPool(spec, 4)
    fill_random(dev, 4)
    host.backup_from_device_all_layer(dev, torch.arange(8), torch.arange(8, 16))
    assert host.page_bytes(0) == dev.page_bytes(2) and host.page_bytes(1) == dev.page_bytes(3)
    with pytest.raises(PageAlignmentError, match="device indices for device pool"):
        host.backup_from_device_all_layer(dev, torch.arange(8), torch.arange(1, 9))
    with pytest.raises(PageAlignmentError, match="differ in length: 8 host slots vs 4 device slots"):
        host.backup_from_device_all_layer(dev, torch.arange(8), torch.arange(4))


def test_empty_indices_are_a_noop():
    spec = tiny_specs(page_size=4, num_layers=1)["mha"]
    dev, host = DevicePool(spec, 2), HostPool(spec, 2)
    fill_random(dev, 5)
    before = snapshot(host)
    host.backup_from_device_all_layer(dev, torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))
    host.load_to_device_per_layer(dev, [], [], 0)
    assert same(snapshot(host), before)


def test_out_of_range_unknown_backend_and_spec_mismatch():
    specs = tiny_specs(page_size=4, num_layers=1)
    dev, host = DevicePool(specs["mha"], 2), HostPool(specs["mha"], 2)
    with pytest.raises(PageIndexError, match="page 5 is outside"):
        host.load_to_device_per_layer(dev, slots([5], 4), slots([0], 4), 0)
    with pytest.raises(UnknownNameError, match="valid: auto, direct, dma, triton"):
        host.load_to_device_per_layer(dev, slots([0], 4), slots([0], 4), 0, io_backend="kernel")
    with pytest.raises(SpecError, match="one KVSpec"):
        host.load_to_device_per_layer(DevicePool(specs["mla"], 2), slots([0], 4), slots([0], 4), 0)


@st.composite
def transfer_case(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    kind = draw(st.sampled_from(["mha", "mla", "dsa"]))
    layers = draw(st.integers(1, 3))
    spec = tiny_specs(page_size=page_size, num_layers=layers)[kind]
    dev_pages = draw(st.integers(1, 12))
    host_pages = draw(st.integers(1, 12))
    n = draw(st.integers(0, min(dev_pages, host_pages)))
    dev_sel = draw(st.permutations(range(dev_pages)))[:n]
    host_sel = draw(st.permutations(range(host_pages)))[:n]
    shape = draw(st.sampled_from(["shuffled", "device sorted", "both in runs"]))
    if shape == "device sorted":
        dev_sel = sorted(dev_sel)  # exercise run-coalescing paths too
    elif shape == "both in runs":  # runs both sides share: one slice copy per run
        d0, h0 = draw(st.integers(0, dev_pages - n)), draw(st.integers(0, host_pages - n))
        cut = draw(st.integers(0, n))
        dev_sel = list(range(d0, d0 + n))
        host_sel = list(range(h0 + cut, h0 + n)) + list(range(h0, h0 + cut))  # two runs, rotated
    layout = draw(st.sampled_from(LAYOUTS))
    return spec, dev_pages, host_pages, dev_sel, host_sel, layout, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(transfer_case())
def test_property_transfers_preserve_bytes_and_touch_only_given_pages(case):
    spec, n_dev, n_host, dev_sel, host_sel, layout, seed = case
    ps = spec.page_size
    dev, host = DevicePool(spec, n_dev), HostPool(spec, n_host, layout)
    fill_random(dev, seed)
    fill_random(host, seed + 1)
    dev_before = [dev.page_bytes(p) for p in range(n_dev)]
    host_before = [host.page_bytes(p) for p in range(n_host)]
    host.backup_from_device_all_layer(dev, slots(host_sel, ps), slots(dev_sel, ps))
    for p in range(n_host):
        expect = dev_before[dev_sel[host_sel.index(p)]] if p in host_sel else host_before[p]
        assert host.page_bytes(p) == expect
    assert [dev.page_bytes(p) for p in range(n_dev)] == dev_before
    # load back into a reversed destination order
    targets = list(reversed(dev_sel))
    host_after = [host.page_bytes(p) for p in range(n_host)]
    for layer in range(spec.num_layers):
        host.load_to_device_per_layer(dev, slots(host_sel, ps), slots(targets, ps), layer)
    for p in range(n_dev):
        expect = host_after[host_sel[targets.index(p)]] if p in targets else dev_before[p]
        assert dev.page_bytes(p) == expect


# ---- layered device->host jobs (a save that follows the forward layer by layer) -----------------
def layer_rows(pool, page: int, layer: int) -> bytes:
    return b"".join(pool.rows(b.name, layer)[page].view(torch.uint8).cpu().numpy().tobytes() for b in pool.spec.buffers)


@pytest.mark.parametrize("kind", ["mha", "dsa"])
def test_layered_backup_copies_a_layer_only_once_it_is_released(kind):
    from kvtier.transfer.engine import TransferEngine

    spec = tiny_specs(page_size=4, num_layers=3)[kind]
    dev, host = DevicePool(spec, 8), HostPool(spec, 8, "page_first")
    fill_random(dev, seed=3)
    with TransferEngine(host, dev) as engine:
        job = engine.submit(Tier.DEVICE, Tier.HOST, [5, 2], [1, 6], layered=True)
        engine.release_layer(job, 1)
        job.wait_layer(1)
        assert [layer_rows(host, p, 1) for p in (1, 6)] == [layer_rows(dev, p, 1) for p in (5, 2)]
        assert all(set(layer_rows(host, p, layer)) == {0} for p in (1, 6) for layer in (0, 2))  # not released: not copied
        assert not job.done() and engine.take_finished() == []
        # the forward writes layer 2 after layer 1 was released; its copy reads what was written by its own release
        dev.rows(spec.buffers[0].name, 2)[5].fill_(7)
        engine.release_layer(job, 2)
        engine.release_layer(job, 2)  # a repeat is ignored
        engine.release_rest(job)
        job.wait()
        assert [host.page_bytes(p) for p in (1, 6)] == [dev.page_bytes(p) for p in (5, 2)]
        assert engine.take_finished() == [job] and job.error is None
        with pytest.raises(PageIndexError, match="layers 0..2"):
            engine.release_layer(job, 3)
        plain = engine.submit(Tier.DEVICE, Tier.HOST, [0], [0])
        with pytest.raises(Exception, match="not layered"):
            engine.release_layer(plain, 0)
        with pytest.raises(Exception, match="cannot be layered"):
            engine.submit(Tier.HOST, Tier.DEVICE, [0], [0], layered=True)


def test_closing_the_engine_copies_the_layers_never_released():
    from kvtier.transfer.engine import TransferEngine

    spec = tiny_specs(page_size=4, num_layers=2)["mla"]
    dev, host = DevicePool(spec, 4), HostPool(spec, 4, "layer_first")
    fill_random(dev, seed=4)
    engine = TransferEngine(host, dev)
    job = engine.submit(Tier.DEVICE, Tier.HOST, [3], [2], layered=True)
    engine.release_layer(job, 0)
    engine.close()  # a waiter on this job must not hang
    assert job.done() and job.error is None and host.page_bytes(2) == dev.page_bytes(3)


def test_a_failed_layer_fails_its_layered_job_and_the_rest_is_not_copied(monkeypatch):
    from kvtier.transfer import engine as engine_mod

    spec = tiny_specs(page_size=4, num_layers=3)["mha"]
    dev, host = DevicePool(spec, 4), HostPool(spec, 4, "page_first")
    fill_random(dev, seed=5)
    real = engine_mod.backup_pages_one_layer

    def fails_at_layer_one(host_pool, device_pool, host_pages, device_pages, layer, backend, plan=None):
        if layer == 1:
            raise RuntimeError("copy engine fault")
        real(host_pool, device_pool, host_pages, device_pages, layer, backend, plan)

    monkeypatch.setattr(engine_mod, "backup_pages_one_layer", fails_at_layer_one)
    with engine_mod.TransferEngine(host, dev) as engine:
        job = engine.submit(Tier.DEVICE, Tier.HOST, [1], [3], layered=True)
        for layer in range(3):
            engine.release_layer(job, layer)
        job.finished.wait()
        assert isinstance(job.error, RuntimeError) and engine.take_finished() == [job]
        assert layer_rows(host, 3, 0) == layer_rows(dev, 1, 0) and set(layer_rows(host, 3, 2)) == {0}


# ---- the direct backend's plan: runs both sides share ---------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30))
def test_paired_runs_cover_the_pages_in_maximal_runs_both_sides_count_up_in(pairs):
    from kvtier.pages import paired_runs

    src = torch.tensor([a for a, _ in pairs], dtype=torch.int64)
    dst = torch.tensor([b for _, b in pairs], dtype=torch.int64)
    runs = paired_runs(src, dst)
    expanded = [(s + i, d + i) for s, d, n in runs for i in range(n)]
    assert expanded == pairs  # every page once, in order
    for (s, d, n), (s2, d2, _) in zip(runs, runs[1:]):
        assert (s2, d2) != (s + n, d + n)  # maximal: the next run does not continue this one
    assert all(n > 0 for _, _, n in runs)


@pytest.mark.parametrize("src, dst, pairs", [
    (list(range(16)), list(range(100, 116)), [(0, 100, 16)]),
    (list(range(8, 16)) + list(range(8)), list(range(16)), [(8, 0, 8), (0, 8, 8)]),
    (list(range(15, -1, -1)), list(range(16)), None),  # reversed: 16 runs of one page, index ops instead
])
def test_direct_plan_copies_shared_runs_as_slices_and_every_shape_bit_exact(src, dst, pairs):
    from kvtier.transfer import direct

    p = direct.plan(torch.tensor(src), torch.tensor(dst))
    assert p.pairs == pairs
    g = torch.Generator().manual_seed(5)
    src_rows = torch.randint(0, 256, (32, 24), dtype=torch.uint8, generator=g)
    dst_rows = torch.zeros((128, 24), dtype=torch.uint8)
    direct.copy(p, src_rows, dst_rows)
    untouched = sorted(set(range(128)) - set(dst))
    assert torch.equal(dst_rows[dst], src_rows[src]) and not dst_rows[untouched].any()


@pytest.mark.parametrize("kind", ["mha", "mla", "dsa"])
@pytest.mark.parametrize("host_sel", [[3, 4, 5, 6, 7], [6, 1, 4, 0, 7], [5, 6, 7, 0, 1]], ids=["one run", "shuffled", "two runs"])
def test_whole_page_backup_into_a_page_first_host_pool_equals_the_per_layer_copy(monkeypatch, kind, host_sel):
    """What an all-layer backup to a GPU's page_first host pool runs (staging, then a copy per run of
    whole host pages), here on the CPU, in chunks of two pages, against the per-layer path."""
    from kvtier.transfer import direct
    from kvtier.transfer.backends import get_io_backend
    from kvtier.transfer.ops import backup_pages_all_layers

    spec = tiny_specs(page_size=4, num_layers=3)[kind]
    per_page = spec.num_layers * max(b.page_bytes for b in spec.buffers)
    monkeypatch.setattr(direct, "_STAGING_BYTES", 2 * per_page)  # chunks of two pages of the largest buffer
    dev = DevicePool(spec, 8)
    fill_random(dev, 1)
    dev_sel = torch.tensor([7, 2, 0, 5, 3])
    whole, per_layer = HostPool(spec, 8, "page_first"), HostPool(spec, 8, "page_first")
    fill_random(whole, 2)
    fill_random(per_layer, 2)
    before = [whole.page_bytes(p) for p in range(8)]
    direct.backup_whole_pages(whole, dev, torch.tensor(host_sel), dev_sel)
    backup_pages_all_layers(per_layer, dev, torch.tensor(host_sel), dev_sel, get_io_backend("direct"))  # CPU: per layer
    for p in range(8):
        expect = dev.page_bytes(int(dev_sel[host_sel.index(p)])) if p in host_sel else before[p]
        assert whole.page_bytes(p) == expect == per_layer.page_bytes(p)
