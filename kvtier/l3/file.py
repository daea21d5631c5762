"""``file://`` backend: one file per page under a directory; the embedded default.

* Atomic: a page is written to a temporary name in the same directory and
  ``os.replace``d into place, so a reader sees a whole object or none, also
  across processes sharing the directory.
* Bounded: ``?max_bytes=`` (or ``max_gb=``) caps the directory; when a write
  passes the cap, the least recently used files (by mtime, refreshed on every
  hit) are deleted until usage is 90% of the cap. The same scan deletes temp
  files older than ``stale_temp_s`` (10 minutes): a writer that died between
  create and rename leaves one, and it would otherwise hold its disk forever.
* Zero-copy reads: ``readinto`` the caller's buffer.

URL: ``file:///abs/path?max_gb=100``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from kvtier.l3.base import BackendStats, KeyStatus, StorageURL, map_storage_errors


def _write_all(fd: int, parts: Sequence[memoryview]) -> None:
    """``writev`` until every byte of ``parts`` is written (a regular file may take fewer per call)."""
    pending = [memoryview(p).cast("B") for p in parts if len(p)]
    while pending:
        n = os.writev(fd, pending)
        while pending and n >= len(pending[0]):
            n -= len(pending[0])
            pending.pop(0)
        if n:
            pending[0] = pending[0][n:]


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


class FileBackend:
    name = "file"
    #: no round trips to amortize: calls of a few MB (one 5 MB deepseek page, three 1.2 MB ones),
    #: so each I/O thread checks pages it just read, and small pages do not pay per-call overhead
    preferred_batch_bytes = 4 << 20
    #: the kernel copies in the calling thread, so two threads keep two cores copying
    preferred_io_threads = 2

    def __init__(self, root: str | Path, max_bytes: int | None = None, stale_temp_s: float = 600.0):
        self.root = Path(root)
        self.stale_temp_s = stale_temp_s  # far above any write's lifetime (ms), so never a live one
        self.root.mkdir(parents=True, exist_ok=True)
        self._root = str(self.root)
        self.max_bytes = max_bytes
        self.stats = BackendStats()
        self._approx_bytes: int | None = None
        self._dirs: set[str] = set()
        self._tmp_ids = itertools.count()  # with pid and thread: unique temp names, no retry loop
        self.stale_temps_removed = 0

    @classmethod
    def from_url(cls, u: StorageURL) -> FileBackend:
        cap = u.query.get("max_bytes")
        if cap is None and "max_gb" in u.query:
            cap = float(u.query["max_gb"]) * (1 << 30)
        return cls(u.path or ".", int(cap) if cap is not None else None)

    def _path(self, key: str) -> str:
        ns, _, h = key.rpartition("/")
        return os.path.join(self._root, ns, h[:2], h)  # str, not Path: this runs once per page read

    def exists(self, keys: Sequence[str]) -> int:
        n = 0
        for k in keys:
            if not os.path.isfile(self._path(k)):
                break
            n += 1
        return n

    def get(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[KeyStatus]:
        return self.get_scattered(keys, [(o,) for o in outs])

    def get_scattered(self, keys: Sequence[str], outs: Sequence[Sequence[memoryview]]) -> list[KeyStatus]:
        """One ``preadv`` per object, straight into its buffers (header, then each buffer of a host page)."""
        result = []
        for key, parts in zip(keys, outs):
            status = [KeyStatus.MISS]
            self.stats.gets += 1
            path = self._path(key)

            def failed(_e: BaseException, status=status) -> None:
                status[0] = KeyStatus.ERROR

            with map_storage_errors(self.stats, f"file get {key}", failed):
                want = sum(len(p) for p in parts)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    fd = -1
                if fd >= 0:
                    try:
                        size = os.fstat(fd).st_size
                        got = os.preadv(fd, parts, 0) if size == want else -1
                        if got == want:
                            os.utime(fd)  # LRU: a hit is a use
                    finally:
                        os.close(fd)
                    if got == want:
                        status[0] = KeyStatus.OK
                        self.stats.get_hits += 1
                        self.stats.bytes_read += got
                    else:
                        status[0] = KeyStatus.ERROR  # wrong size: reported, the tier treats it as a miss
            result.append(status[0])
        return result

    def set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[KeyStatus]:
        return self.set_scattered(keys, [(v,) for v in values])

    def set_scattered(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[KeyStatus]:
        """Write each object from its buffers (one ``writev``), to a temp name, then rename it into place."""
        result = []
        for key, bufs in zip(keys, parts):
            status = [KeyStatus.ERROR]
            self.stats.sets += 1
            path = self._path(key)

            def failed(_e: BaseException) -> None:
                pass

            with map_storage_errors(self.stats, f"file set {key}", failed):
                tmp = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}-{threading.get_ident()}-{next(self._tmp_ids)}")
                fd = self._create(tmp)
                try:
                    try:
                        _write_all(fd, bufs)
                    finally:
                        os.close(fd)
                    os.replace(tmp, path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
                status[0] = KeyStatus.OK
                size = sum(len(p) for p in bufs)
                self.stats.bytes_written += size
                if self._approx_bytes is not None:
                    self._approx_bytes += size
            result.append(status[0])
        self._enforce_cap()
        return result

    def _create(self, tmp: str) -> int:
        """Open a new temp file, making its directory the first time this process writes there.

        Known directories are cached: ``makedirs`` per page cost ~0.2 ms, most of it waiting for
        the GIL behind the other I/O thread. A directory removed by someone else is made again."""
        parent = os.path.dirname(tmp)
        if parent not in self._dirs:
            os.makedirs(parent, exist_ok=True)
            self._dirs.add(parent)
        try:
            return os.open(tmp, _CREATE, 0o600)
        except FileNotFoundError:
            os.makedirs(parent, exist_ok=True)
            return os.open(tmp, _CREATE, 0o600)

    def delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            Path(self._path(k)).unlink(missing_ok=True)

    def usage_bytes(self) -> int:
        return sum(p.stat().st_size for p in self._files())

    def _files(self, sweep_temps: bool = False):
        """Committed page files; with ``sweep_temps``, stale temp files met on the way are deleted."""
        stale_before = time.time_ns() - int(self.stale_temp_s * 1e9)
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if not name.startswith(".tmp-"):
                    yield Path(dirpath) / name
                elif sweep_temps:
                    self._remove_if_stale(os.path.join(dirpath, name), stale_before)

    def _remove_if_stale(self, tmp: str, stale_before_ns: int) -> None:
        try:
            if os.stat(tmp).st_mtime_ns < stale_before_ns:
                os.unlink(tmp)
                self.stale_temps_removed += 1
        except FileNotFoundError:
            pass  # renamed into place or swept by another process meanwhile

    def _enforce_cap(self) -> None:
        if self.max_bytes is None:
            return
        if self._approx_bytes is None or self._approx_bytes > self.max_bytes:
            entries = []
            for p in self._files(sweep_temps=True):
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime_ns, st.st_size, p))
            total = sum(e[1] for e in entries)
            if total > self.max_bytes:
                target = int(self.max_bytes * 0.9)
                for _mtime, size, p in sorted(entries, key=lambda e: e[0]):
                    if total <= target:
                        break
                    p.unlink(missing_ok=True)
                    total -= size
            self._approx_bytes = total

    def close(self) -> None:
        pass
