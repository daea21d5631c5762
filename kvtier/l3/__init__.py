"""L3 storage: a narrow batched key/value interface, backends chosen by URL, and the tier that moves host pages."""

from kvtier.l3.base import StorageBackend, open_backend
from kvtier.l3.page import PageCodec

__all__ = ["PageCodec", "StorageBackend", "open_backend"]
