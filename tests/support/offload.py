"""An OffloadCache (host + L3 behind engine-owned device memory, what the vLLM connector uses) over an
engine's own tensors, and the page keys its tests save and load."""

import torch

from kvtier.config import StorageConfig
from kvtier.hashing import Namespace, page_keys
from kvtier.l3 import open_backend
from kvtier.l3.tier import StorageTier
from kvtier.offload import OffloadCache
from kvtier.pools import DevicePool, HostPool
from kvtier.spec import KVSpec

SPEC = KVSpec("smol-like", "mha", 3, 4, "bfloat16", kv_heads=2, head_dim=8, kv_layout="hnd_paired")


def engine_tensors(num_blocks=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, 2, 4, 16, generator=g).to(torch.bfloat16) for _ in range(SPEC.num_layers)]


def make(tensors, host_pages=8, url=None):
    device = DevicePool.wrap(SPEC, {"kv": tensors})
    host = HostPool(SPEC, host_pages, "page_first")
    storage = None
    if url:
        ns = Namespace("m", SPEC.fingerprint())
        storage = StorageTier(open_backend(url), host, ns, batch_pages=2)
    return OffloadCache(device, host, storage, StorageConfig(url=url))


def keys(n, seed=1):
    root = Namespace("m", SPEC.fingerprint()).root()
    return page_keys(list(range(seed, seed + n * SPEC.page_size)), SPEC.page_size, root)
