"""Bad page indices and layer ids -- floats, bools, strings, the wrong shape, out of range -- are typed
errors raised before any byte moves: a host pool's copies to the device, and OffloadCache's loads and
saves, which check every page of a request before its first copy."""

import numpy as np
import pytest
import torch

from kvtier import DevicePool, HostPool
from kvtier.errors import IndexTypeError, PageIndexError
from support import l3_scenarios as sc
from support.pools import slots


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
