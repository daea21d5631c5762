"""kvtier: a tiered, paged KV cache (GPU / pinned host / storage) for LLM inference."""

from kvtier.errors import (
    ConfigError,
    DoubleFreeError,
    HostMemoryBudgetError,
    InvalidStateError,
    KVTierError,
    PageAlignmentError,
    PageIndexError,
    SpecError,
    StorageError,
    UnknownNameError,
)
from kvtier.layout import HostLayout
from kvtier.pools import DevicePool, HostPool
from kvtier.spec import PRESETS, BufferSpec, KVSpec

__version__ = "0.1.0"

__all__ = [
    "PRESETS", "BufferSpec", "ConfigError", "DevicePool", "DoubleFreeError", "HostLayout", "HostMemoryBudgetError",
    "HostPool", "InvalidStateError", "KVSpec", "KVTierError", "PageAlignmentError", "PageIndexError", "SpecError",
    "StorageError", "UnknownNameError",
]
