"""L3 storage: a narrow batched key/value interface, backends chosen by URL, and the tier that moves host pages."""

from kvtier.l3.base import Capabilities, StorageBackend
from kvtier.l3.registry import open_backend
from kvtier.l3.page import PageCodec

__all__ = ["Capabilities", "PageCodec", "StorageBackend", "open_backend"]
