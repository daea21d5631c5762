"""``memory://`` backend: an in-process LRU key/value store bounded in objects.

The reference implementation of the interface (no server, no persistence): what
capacity planning uses for a shared L3 of a given size, and a store for tests
of code above the backend. ``memory://?max_objects=N``; values are kept as
given (bytes copies), so it is bit-exact like any other backend.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvtier.l3.base import BackendStats, Capabilities, KeyStatus, StorageURL
from kvtier.l3.tenant_bounds import refuse_unkept


class MemoryBackend:
    name = "memory"
    capabilities = Capabilities()  # whole objects only, through the tier's staging buffer

    def __init__(self, max_objects: int | None = None):
        self.max_objects = max_objects
        self.data: OrderedDict[str, bytes] = OrderedDict()
        self.stats = BackendStats()
        self.evicted = 0

    @classmethod
    def from_url(cls, u: StorageURL) -> MemoryBackend:
        refuse_unkept(u.query, "memory")
        cap = u.query.get("max_objects")
        return cls(int(cap) if cap is not None else None)

    def exists(self, keys: Sequence[str]) -> int:
        n = 0
        for k in keys:
            if k not in self.data:
                break
            n += 1
        return n

    def get(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[KeyStatus]:
        out = []
        for k, buf in zip(keys, outs):
            self.stats.gets += 1
            v = self.data.get(k)
            if v is None:
                out.append(KeyStatus.MISS)
            elif len(v) != len(buf):
                out.append(KeyStatus.WRONG_SIZE)
            else:
                self.data.move_to_end(k)
                buf[:] = v
                self.stats.get_hits += 1
                out.append(KeyStatus.OK)
        return out

    def set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[KeyStatus]:
        for k, v in zip(keys, values):
            self.stats.sets += 1
            self.data[k] = bytes(v)
            self.data.move_to_end(k)
        if self.max_objects is not None:
            while len(self.data) > self.max_objects:
                self.data.popitem(last=False)
                self.evicted += 1
        return [KeyStatus.OK] * len(keys)

    def delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.data.pop(k, None)

    def delete_namespace(self, namespace: str) -> int:
        doomed = [k for k in self.data if k.startswith(namespace + "/")]
        for k in doomed:
            del self.data[k]
        return len(doomed)

    def close(self) -> None:
        pass
