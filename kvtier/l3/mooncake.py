"""``mooncake://`` backend: Mooncake Store (``mooncake-transfer-engine-non-cuda`` wheel).

The client mounts a memory segment into the store (its contribution to the
cluster's capacity) and registers the tier's staging buffer, so puts and gets
go straight between the store and that buffer (``batch_put_from`` /
``batch_get_into``: zero-copy on this side). Buffers that are not registered go
through a registered bounce buffer.

URL::

    mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata
        &local=127.0.0.1&protocol=tcp&segment_mb=512&buffer_mb=128

``local`` pins the address the transfer engine listens on (use loopback in
tests); ``metadata`` is the master's HTTP metadata server (or an etcd URL).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.errors import StorageError
from kvtier.l3.base import BackendStats, KeyStatus, StorageURL

#: Mooncake's OBJECT_NOT_FOUND error code: a plain miss.
_NOT_FOUND = -704


def _address(mv: memoryview) -> int:
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data


class MooncakeBackend:
    name = "mooncake"

    def __init__(self, store, bounce_bytes: int):
        self.store = store
        self.stats = BackendStats()
        self._regions: list[tuple[int, int]] = []
        self._bounce = np.zeros(bounce_bytes, dtype=np.uint8)
        self._register(self._bounce.ctypes.data, self._bounce.nbytes)

    @classmethod
    def from_url(cls, u: StorageURL) -> MooncakeBackend:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StorageError(f"the mooncake backend needs the Mooncake wheel: pip install 'kvtier[mooncake]' (and Debian libibverbs1): {e}") from None
        q = u.query
        master = f"{u.host or '127.0.0.1'}:{u.port or 50051}"
        metadata = q.get("metadata", f"http://{u.host or '127.0.0.1'}:8080/metadata")
        store = MooncakeDistributedStore()
        rc = store.setup(q.get("local", "127.0.0.1"), metadata, int(q.get("segment_mb", 512)) << 20, int(q.get("buffer_mb", 128)) << 20,
                         q.get("protocol", "tcp"), q.get("rdma_devices", ""), master)
        if rc != 0:
            raise StorageError(f"Mooncake Store setup failed (code {rc}) for master {master}, metadata {metadata}: is mooncake_master running there?")
        return cls(store, int(q.get("bounce_mb", 64)) << 20)

    # ---- buffers -------------------------------------------------------------------
    def _register(self, ptr: int, size: int) -> None:
        rc = self.store.register_buffer(ptr, size)
        if rc != 0:
            raise StorageError(f"Mooncake register_buffer failed (code {rc})")
        self._regions.append((ptr, size))

    def register_buffer(self, mv: memoryview) -> None:
        """Register caller memory that stays alive while the backend is open (the tier's staging)."""
        self._register(_address(mv), len(mv))

    def _registered(self, mv: memoryview) -> int | None:
        ptr = _address(mv)
        for base, size in self._regions[1:]:
            if base <= ptr and ptr + len(mv) <= base + size:
                return ptr
        return None

    def _direct(self, bufs: Sequence[memoryview]) -> list[int] | None:
        ptrs = [self._registered(b) for b in bufs]
        return None if any(p is None for p in ptrs) else ptrs  # type: ignore[return-value]

    def _fault(self, what: str, codes) -> None:
        self.stats.errors += 1
        self.stats.last_error = f"{what}: codes {list(codes)[:4]}"

    # ---- interface -----------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        codes = self.store.batch_is_exist(list(keys))
        n = 0
        for c in codes:
            if c != 1:
                if c < 0:
                    self._fault("mooncake exists", codes)
                break
            n += 1
        return n

    def get(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[KeyStatus]:
        self.stats.gets += len(keys)
        sizes = [len(o) for o in outs]
        ptrs = self._direct(outs)
        bounce = ptrs is None
        if bounce:
            offs = np.cumsum([0, *sizes[:-1]]).tolist()
            if sum(sizes) > self._bounce.nbytes:
                raise StorageError("mooncake get batch larger than the bounce buffer; raise bounce_mb or register the buffers")
            ptrs = [self._bounce.ctypes.data + o for o in offs]
        codes = self.store.batch_get_into(list(keys), ptrs, sizes)
        out: list[KeyStatus] = []
        for i, (c, size) in enumerate(zip(codes, sizes)):
            if c == size:
                if bounce:
                    outs[i][:] = self._bounce[offs[i] : offs[i] + size].data
                out.append(KeyStatus.OK)
                self.stats.get_hits += 1
                self.stats.bytes_read += size
            elif c == _NOT_FOUND:
                out.append(KeyStatus.MISS)
            else:
                out.append(KeyStatus.ERROR)
        if KeyStatus.ERROR in out:
            self._fault("mooncake get", codes)
        return out

    def set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[KeyStatus]:
        self.stats.sets += len(keys)
        sizes = [len(v) for v in values]
        ptrs = self._direct(values)
        if ptrs is None:
            if sum(sizes) > self._bounce.nbytes:
                raise StorageError("mooncake set batch larger than the bounce buffer; raise bounce_mb or register the buffers")
            ptrs, off = [], 0
            for v in values:
                self._bounce[off : off + len(v)] = np.frombuffer(v, dtype=np.uint8)
                ptrs.append(self._bounce.ctypes.data + off)
                off += len(v)
        codes = self.store.batch_put_from(list(keys), ptrs, sizes)
        out = [KeyStatus.OK if c == 0 else KeyStatus.ERROR for c in codes]
        if KeyStatus.ERROR in out:
            self._fault("mooncake set", codes)
        else:
            self.stats.bytes_written += sum(sizes)
        return out

    def delete(self, keys: Sequence[str]) -> None:
        if keys:
            self.store.batch_remove(list(keys), True)

    def close(self) -> None:
        self.store.close()
