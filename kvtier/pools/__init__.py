"""Device (L1) and host (L2) page pools, built from a KVSpec; no per-attention-kind subclasses."""

from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.memory import host_memory_available

__all__ = ["DevicePool", "HostPool", "host_memory_available"]
