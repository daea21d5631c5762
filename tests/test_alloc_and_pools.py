import pytest
import torch

from kvtier import DevicePool, DoubleFreeError, HostMemoryBudgetError, HostPool, KVSpec, PageAlignmentError, UnknownNameError
from kvtier.alloc import PageAllocator
from support.pools import tiny_specs


def test_allocator_accounting_and_ascending_runs():
    a = PageAllocator(8, "dev")
    first = a.alloc(3)
    assert first.ok and first.pages == [0, 1, 2] and a.num_free == 5 and a.num_used == 3
    a.free([1])
    again = a.alloc(2)
    assert again.pages == [1, 3]
    assert a.allocated_pages() == {0, 1, 2, 3}


def test_allocator_exhaustion_is_a_result_and_takes_nothing():
    a = PageAllocator(4, "dev")
    a.alloc(3)
    r = a.alloc(2)
    assert not r.ok and r.pages == [] and r.shortfall == 2 and r.free_before == 1
    assert a.num_free == 1


def test_double_free_rejected_and_frees_nothing():
    a = PageAllocator(4, "dev")
    got = a.alloc(2).pages
    a.free([got[0]])
    with pytest.raises(DoubleFreeError, match="page 0"):
        a.free([got[1], got[0]])
    assert a.is_allocated(got[1]) and a.num_free == 3
    with pytest.raises(DoubleFreeError, match="twice in one free call"):
        a.free([got[1], got[1]])
    assert a.is_allocated(got[1]) and a.num_free == 3  # the first of the two was not freed either
    with pytest.raises(DoubleFreeError, match="page 99 is not allocated"):
        a.free([got[1], 99])
    with pytest.raises(DoubleFreeError, match="page -1 is not allocated"):
        a.free([-1])  # not the last page by Python indexing
    assert a.is_allocated(got[1]) and a.num_free == 3


def test_padding_page_is_never_handed_out_or_freed():
    a = PageAllocator(4, "dev", reserve_padding_page=True)
    assert a.capacity == 3
    assert sorted(a.alloc(3).pages) == [1, 2, 3]
    with pytest.raises(DoubleFreeError, match="padding"):
        a.free([0])


def test_host_alloc_in_tokens_must_be_page_aligned():
    spec = KVSpec.preset("deepseek-v3.2", num_layers=1)
    host = HostPool(spec, 4)
    with pytest.raises(PageAlignmentError) as e:
        host.alloc(100)
    assert "host pool allocation must be page-aligned: asked for 100 tokens with page_size 64" in str(e.value)
    got = host.alloc(128)
    assert got.tolist() == list(range(128))
    assert host.alloc(192) is None and host.allocator.num_free == 2
    host.free(got)
    assert host.allocator.num_free == 4


def test_host_budget_error_states_numbers_and_fix():
    spec = KVSpec.preset("deepseek-v3.2")
    with pytest.raises(HostMemoryBudgetError) as e:
        HostPool(spec, 1000, available_bytes=3 << 30, reserve_bytes=1 << 30)
    msg = str(e.value)
    assert "needs 4.67 GB" in msg and "only 2.00 GB is available" in msg
    assert f"at most {(2 << 30) // spec.page_bytes} pages" in msg
    assert isinstance(e.value, MemoryError)


def test_host_budget_uses_real_memory_when_not_given():
    spec = KVSpec.preset("deepseek-v3.2")
    with pytest.raises(HostMemoryBudgetError):
        HostPool(spec, 10**7)  # ~50 TB


def test_unknown_layout_lists_valid():
    with pytest.raises(UnknownNameError, match="layer_first, page_first"):
        HostPool(tiny_specs()["mla"], 4, "page_major")


def test_device_pool_shapes_follow_design():
    specs = tiny_specs(page_size=4, num_layers=2)
    dsa = DevicePool(specs["dsa"], 5)
    assert dsa.buffer("latent", 1).shape == (20, 1, 24) and dsa.buffer("latent", 1).dtype == torch.bfloat16
    assert dsa.buffer("indexer", 0).shape == (5, 4 * (32 + 2 * 4)) and dsa.buffer("indexer", 0).dtype == torch.uint8
    mha = DevicePool(specs["mha"], 5)
    assert mha.buffer("k", 0).shape == (20, 2, 8) and mha.buffer("v", 1).shape == (20, 2, 8)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_host_layout_shapes(layout):
    spec = tiny_specs(page_size=4, num_layers=3)["dsa"]
    host = HostPool(spec, 6, layout)
    pb = spec.buffer("latent").page_bytes
    assert host.buffers["latent"].shape == ((3, 6, pb) if layout == "layer_first" else (6, 3, pb))
    if layout == "page_first":  # one contiguous run per page and buffer
        assert host.buffers["latent"][2].is_contiguous()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_host_buffers_start_on_a_4k_boundary(layout):
    """L3 file writes from a buffer 64 bytes past a 4 KiB boundary hit 4K aliasing (see page_aligned_empty)."""
    for spec in (KVSpec.preset("deepseek-v3.2", page_size=16), KVSpec.preset("llama-3.1-8b", page_size=16)):
        host = HostPool(spec, 3, layout)
        for name, t in host.buffers.items():
            assert t.data_ptr() % 4096 == 0, (spec.name, name, t.data_ptr() % 4096)
            assert t.is_contiguous() and t.numel() == 3 * spec.buffer(name).page_bytes * spec.num_layers
            assert int(t.count_nonzero()) == 0  # touched and zeroed, like before
