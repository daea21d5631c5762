"""``mooncake://`` backend: Mooncake Store (``mooncake-transfer-engine-non-cuda`` wheel).

The client mounts a memory segment into the store (its contribution to the
cluster's capacity). The tier registers its host pool, header slabs and
staging buffer, so puts and gets go straight between the store and the host
pages (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``:
header and each buffer of a page, zero-copy on this side). Buffers that are not
registered go through a registered bounce buffer.

URL::

    mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata
        &local=127.0.0.1&protocol=tcp&segment_mb=512&buffer_mb=128

``local`` pins the address the transfer engine listens on (use loopback in
tests); ``metadata`` is the master's HTTP metadata server (or an etcd URL).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from kvtier.errors import StorageError
from kvtier.l3.base import BackendStats, Capabilities, KeyStatus, StorageURL, scatter_into
from kvtier.l3.tenant_bounds import refuse_unkept

#: Mooncake's OBJECT_NOT_FOUND error code: a plain miss.
_NOT_FOUND = -704


def _address(mv: memoryview) -> int:
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data


#: characters ECMAScript regular expressions treat specially (Python's re.escape also escapes '-', which they reject)
_REGEX_META = frozenset(".^$|?*+()[]{}\\")


class MooncakeBackend:
    name = "mooncake"
    #: batches: one call for up to 128 MB (an SGLang storage batch of 128 half-MB pages is one call,
    #: not three of 32 MB: kvtier bench sglang, median set/get vs SGLang's MooncakeStore 0.63/0.71
    #: with 32 MB calls, 0.66-0.78/0.79-0.80 with one); the tier keeps two per I/O thread in
    #: flight. Threads: one call at a time -- a batch
    #: call already runs its transfers in parallel in the transfer engine, and a second thread only
    #: competes with it for CPU (loopback, 2 cores, 96 pages of 1.25 MB, median GB/s one vs two
    #: threads: gets 1.06 / 0.88, puts 1.07 / 0.84). Zero-copy needs registered memory.
    capabilities = Capabilities(scattered=True, registers_buffers=True, batch_bytes=128 << 20, io_threads=1)

    def __init__(self, store, bounce_bytes: int):
        self.store = store
        self.stats = BackendStats()
        self._regions: list[tuple[int, int]] = []
        self._bounce = np.zeros(bounce_bytes, dtype=np.uint8)
        self._bounce_lock = threading.Lock()  # the tier calls from several I/O threads
        self._register(self._bounce.ctypes.data, self._bounce.nbytes)

    @classmethod
    def from_url(cls, u: StorageURL) -> MooncakeBackend:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StorageError(
                f"the mooncake backend needs the Mooncake wheel: pip install 'kvtier[mooncake]' (and Debian libibverbs1): {e}"
            ) from None
        q = u.query
        refuse_unkept(q, "mooncake")
        master = f"{u.host or '127.0.0.1'}:{u.port or 50051}"
        metadata = q.get("metadata", f"http://{u.host or '127.0.0.1'}:8080/metadata")
        store = MooncakeDistributedStore()
        rc = store.setup(
            q.get("local", "127.0.0.1"),
            metadata,
            int(q.get("segment_mb", 512)) << 20,
            int(q.get("buffer_mb", 128)) << 20,
            q.get("protocol", "tcp"),
            q.get("rdma_devices", ""),
            master,
        )
        if rc != 0:
            raise StorageError(
                f"Mooncake Store setup failed (code {rc}) for master {master}, metadata {metadata}: is mooncake_master running there?"
            )
        return cls(store, int(q.get("bounce_mb", 64)) << 20)

    # ---- buffers -------------------------------------------------------------------
    def _register(self, ptr: int, size: int) -> None:
        rc = self.store.register_buffer(ptr, size)
        if rc != 0:
            raise StorageError(f"Mooncake register_buffer failed (code {rc})")
        self._regions.append((ptr, size))

    def register_buffer(self, mv: memoryview) -> None:
        """Register caller memory that stays alive while the backend is open (the tier's staging).
        Memory inside a region already registered is left as it is (Mooncake refuses it twice)."""
        if self._registered(mv) is None:
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
        return self.get_scattered(keys, [(o,) for o in outs])

    def get_scattered(self, keys: Sequence[str], outs: Sequence[Sequence[memoryview]]) -> list[KeyStatus]:
        """Each object straight into its buffers (``batch_get_into_multi_buffers``) when all are
        registered (the tier registers its host pool and header slabs), else through the bounce buffer."""
        self.stats.gets += len(keys)
        sizes = [[len(p) for p in parts] for parts in outs]
        totals = [sum(s) for s in sizes]
        ptrs = [self._direct(parts) for parts in outs]
        if all(p is not None for p in ptrs):
            return self._got(keys, self.store.batch_get_into_multi_buffers(list(keys), ptrs, sizes), totals)
        with self._bounce_lock:
            offs = self._bounce_offsets(totals, "get")
            statuses = self._got(keys, self.store.batch_get_into(list(keys), [self._bounce.ctypes.data + o for o in offs], totals), totals)
            for st, parts, o, n in zip(statuses, outs, offs, totals):
                if st is KeyStatus.OK:
                    scatter_into(self._bounce[o : o + n].data, parts)
        return statuses

    def _got(self, keys: Sequence[str], codes: Sequence[int], totals: Sequence[int]) -> list[KeyStatus]:
        """Per-key statuses of a batch get (a code is the bytes read, or an error). An object of another
        size fails its get -- fewer bytes read into a plain buffer, an error code for a registered one,
        or for a buffer too small (-600) -- so a failed key's size is asked: WRONG_SIZE where it differs."""
        out: list[KeyStatus] = []
        for key, c, size in zip(keys, codes, totals):
            if c == size:
                out.append(KeyStatus.OK)
                self.stats.get_hits += 1
                self.stats.bytes_read += size
            elif c == _NOT_FOUND:
                out.append(KeyStatus.MISS)
            elif c >= 0 or self._holds_another_size(key, size):
                out.append(KeyStatus.WRONG_SIZE)
            else:
                out.append(KeyStatus.ERROR)
        if KeyStatus.ERROR in out:
            self._fault("mooncake get", codes)
        return out

    def _holds_another_size(self, key: str, size: int) -> bool:
        stored = self.store.get_size(key)  # (negative: an error code, e.g. not found)
        return stored >= 0 and stored != size

    def set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[KeyStatus]:
        return self.set_scattered(keys, [(v,) for v in values])

    def set_scattered(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[KeyStatus]:
        """Each object from its buffers back to back (``batch_put_from_multi_buffers``) when all are
        registered, else gathered into the bounce buffer."""
        self.stats.sets += len(keys)
        sizes = [[len(p) for p in bufs] for bufs in parts]
        totals = [sum(s) for s in sizes]
        ptrs = [self._direct(bufs) for bufs in parts]
        if all(p is not None for p in ptrs):
            codes = self.store.batch_put_from_multi_buffers(list(keys), ptrs, sizes)
        else:
            with self._bounce_lock:
                offs = self._bounce_offsets(totals, "set")
                for bufs, o in zip(parts, offs):
                    for b in bufs:
                        self._bounce[o : o + len(b)] = np.frombuffer(b, dtype=np.uint8)
                        o += len(b)
                codes = self.store.batch_put_from(list(keys), [self._bounce.ctypes.data + o for o in offs], totals)
        out = [KeyStatus.OK if c == 0 else KeyStatus.ERROR for c in codes]
        if KeyStatus.ERROR in out:
            self._fault("mooncake set", codes)
        else:
            self.stats.bytes_written += sum(totals)
        return out

    def _bounce_offsets(self, totals: Sequence[int], op: str) -> list[int]:
        if sum(totals) > self._bounce.nbytes:
            raise StorageError(
                f"mooncake {op} batch ({sum(totals)} bytes) larger than the bounce buffer ({self._bounce.nbytes}); "
                "raise bounce_mb or register the buffers"
            )
        return np.cumsum([0, *totals[:-1]]).tolist()

    def delete(self, keys: Sequence[str]) -> None:
        if keys:
            self.store.batch_remove(list(keys), True)

    def delete_namespace(self, namespace: str) -> int:
        """``remove_by_regex`` (std::regex, ECMAScript) on the escaped prefix; forced, as ``delete`` is."""
        escaped = "".join("\\" + c if c in _REGEX_META else c for c in namespace + "/")
        n = self.store.remove_by_regex("^" + escaped, True)
        if n < 0:
            self._fault("mooncake delete namespace", [n])
            return 0
        return n

    def close(self) -> None:
        self.store.close()
