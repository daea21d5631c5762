"""The SGLang harness the storage-backend tests drive (it lives in the app: ``kvtier bench sglang`` uses it too)."""

from peers.sglang_harness import *  # noqa: F401,F403  (imports SGLang from its wheel first)
from peers.sglang_harness import StorageBackendFactory  # noqa: F401
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: F401,E402

import torch  # noqa: E402


def _mamba_pool(seed: int | None = None):
    """SGLang's own MambaPoolHost on CPU (page_first: its supported host layout), 2 layers of fp32
    SSM state and bf16 conv state per slot; its get_data_page concatenates them into a copy."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(temporal=torch.zeros(2, 9, 4, 8, dtype=torch.float32),
                                conv=(torch.zeros(2, 9, 3, 16, dtype=torch.bfloat16),))
    pool = MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, device="cpu", layout="page_first")
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        pool.temporal_buffer.copy_(torch.randn(pool.temporal_buffer.shape, generator=g))
        pool.conv_buffer[0].copy_(torch.randn(pool.conv_buffer[0].shape, generator=g).to(torch.bfloat16))
    return pool
