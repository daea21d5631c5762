"""``file://`` backend: one file per page under a directory; the embedded default.

* Atomic: a page is written to a temporary name in the same directory and
  ``os.replace``d into place, so a reader sees a whole object or none, also
  across processes sharing the directory.
* Bounded: ``?max_bytes=`` (or ``max_gb=``) caps the store's objects; when a
  write passes the cap, the least recently used ones (by mtime, refreshed on
  every hit) are deleted until usage is 90% of the cap. The same scan deletes
  its temp files older than ``stale_temp_s`` (10 minutes): a writer that died
  between create and rename leaves one, and it would otherwise hold its disk
  forever. Both touch only what the store wrote (its directory and file name
  patterns, and the page object's magic at the start of the file): a root
  that already holds a user's files keeps them.
* Zero-copy reads: ``readinto`` the caller's buffer.
* Confined: a key's namespace never becomes a path as given. It maps to one
  directory name strictly under the root: a readable prefix of its safe
  characters plus the xxh3-128 of the whole namespace (``../../x``, an
  absolute path or a NUL cannot escape, and two namespaces never share a
  directory). Writes and deletes go through directory file descriptors opened
  with ``O_NOFOLLOW`` from the root, so a symlink planted in place of a
  namespace or shard directory is refused, never followed.
* Per tenant (:mod:`kvtier.l3.tenant_bounds`): ``tenant_min_gb`` (a tenant's objects the store's
  cap never deletes), ``tenant_max_gb`` (a tenant's cap: its own least recently used objects go) and
  ``tenant_ttl_s`` (a tenant's objects unused that long are deleted; a sweeper thread looks every
  eighth of it, and within a second for a cap a write passed while its sweep had to wait), by the
  owner tag in each object's header. A store whose cap holds only guaranteed
  bytes refuses new objects until a sweep finds room. A sweep scans the whole store, so a tenant's
  bound sweeps at most once a second, or ten times as seldom as a scan takes.
* Several writers on one capped store: each process re-scans the directory
  after writing ``rescan_fraction`` (5%) of the cap since its last scan, so the
  store stays within ``cap * (1 + rescan_fraction * writers)`` plus one object.

URL: ``file:///abs/path?max_gb=100`` (per tenant: ``&tenant_min_gb=1&tenant_max_gb=10&tenant_ttl_s=86400``).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import xxhash

from kvtier.errors import StorageError
from kvtier.l3.base import BackendStats, Capabilities, KeyStatus, StorageURL, map_storage_errors, positive_option, redact_url
from kvtier.l3.page import MAGIC, tag_of, tag_of_parts
from kvtier.l3.tenant_bounds import StoredObject, Sweep, TenantBounds, is_tenant, plan_sweep

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9_.]")
_HEX_NAME = re.compile(r"[0-9a-f]{2,64}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def dir_name(namespace: str) -> str:
    """The one directory name under the root that holds ``namespace``'s pages (see the module docstring)."""
    readable = _UNSAFE.sub("_", namespace).lstrip(".")[:48]
    return f"{readable}-{xxhash.xxh3_128_hexdigest(namespace.encode('utf-8', 'surrogatepass'))}"


def file_name(page: str) -> str:
    """A page's file name: its hex hash as is; anything else hashed (keys may come from a caller)."""
    return page if _HEX_NAME.fullmatch(page) else "x" + xxhash.xxh3_128_hexdigest(page.encode("utf-8", "surrogatepass"))


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


#: what this store writes, and nothing else is touched by its cap or its temp sweep
_NS_DIR = re.compile(r"[A-Za-z0-9_.]{0,48}-[0-9a-f]{32}")
_SHARD = re.compile(r"[0-9a-fx][0-9a-f]")
_PAGE_FILE = re.compile(r"[0-9a-f]{2,64}|x[0-9a-f]{32}")
_TEMP = re.compile(r"\.tmp-[0-9]+-[0-9]+-[0-9]+")


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


_HEAD_BYTES = 16  # the magic to the owner tag (:mod:`kvtier.l3.page`)


def _page_head(path: str, allow_empty: bool = False) -> bytes | None:
    """The first 16 bytes of a file that starts with the page object's magic (:mod:`kvtier.l3.page`), else None (with
    ``allow_empty``, an empty file's b""); never follows a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        head = os.pread(fd, _HEAD_BYTES, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return head if head[: len(MAGIC)] == MAGIC or (allow_empty and head == b"") else None


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


class FileBackend:
    name = "file"
    #: batches: no round trips to amortize, so calls of a few MB (one 5 MB deepseek page, three
    #: 1.2 MB ones): each I/O thread checks pages it just read, and small pages do not pay per-call
    #: overhead. Threads: the kernel copies in the calling thread, so two keep two cores copying
    capabilities = Capabilities(scattered=True, batch_bytes=4 << 20, io_threads=2)

    def __init__(self, root: str | Path, max_bytes: int | None = None, stale_temp_s: float = 600.0, rescan_fraction: float = 0.05,
                 tenants: TenantBounds | None = None):
        self.root = Path(root)
        self.stale_temp_s = stale_temp_s  # far above any write's lifetime (ms), so never a live one
        if max_bytes is not None and max_bytes <= 0:
            raise StorageError(f"file store cap must be > 0 bytes, got {max_bytes}; leave max_gb out for no cap")
        self.tenants = tenants if tenants is not None and tenants.any else None
        if self.tenants is not None:  # (before anything is made)
            self.tenants.check_store_cap(max_bytes, "file")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise StorageError(f"file store root {str(self.root)!r} is not a usable directory ({e.strerror}); "
                               "pass file:///absolute/path/to/a/directory") from None
        self._root = str(self.root)
        self.max_bytes = max_bytes
        self.stats = BackendStats()
        self._approx_bytes: int | None = None
        #: bytes this process wrote since its last scan; past ``rescan_fraction`` of the cap it scans again,
        #: so other processes' writes are seen before the store overshoots by more than that
        self.rescan_fraction = rescan_fraction
        self._written_since_scan = 0
        #: namespace -> its directory's fd (O_NOFOLLOW from the root), opened on first write
        self._ns_fds: dict[str, int] = {}
        self._ns_names: dict[str, str] = {}
        self._fd_lock = threading.Lock()
        self._tmp_ids = itertools.count()  # with pid and thread: unique temp names, no retry loop
        self.stale_temps_removed = 0
        #: times the root was found removed and made again (an operator wiped the store under a running engine)
        self.roots_recreated = 0
        #: objects deleted by each bound (:mod:`kvtier.l3.tenant_bounds`), and writes refused while only guaranteed bytes
        #: were left above the cap
        self.evicted_objects = 0
        self.expired_objects = 0
        self.capped_objects = 0
        self.refused_full = 0
        #: scans of the whole store (each a stat and a 16-byte read per object)
        self.sweeps = 0
        #: bytes per owner tag at the last sweep, plus this process's writes since (tenant bounds only)
        self.tag_bytes: dict[int, int] = {}
        self._full = False
        self._tenant_over = False
        self._swept_at = 0.0
        self._scan_s = 0.0  # how long the last sweep took
        self._sweep_lock = threading.Lock()
        self._closing = threading.Event()
        self._sweeper: threading.Thread | None = None
        if self.tenants is not None and (self.tenants.ttl_s is not None or self.tenants.max_bytes is not None):
            ttl, cap = self.tenants.ttl_s, self.tenants.max_bytes
            step = min(ttl / 8 if ttl is not None else 1.0, 1.0 if cap is not None else ttl / 8)
            self._sweeper = threading.Thread(target=self._sweep_every, args=(step,), name="kvtier-file-sweeper", daemon=True)
            self._sweeper.start()

    @classmethod
    def from_url(cls, u: StorageURL) -> FileBackend:
        netloc = u.url.split("://", 1)[1].split("/", 1)[0] if "://" in u.url else ""
        if netloc not in ("", "localhost"):
            shown = redact_url(u.url)
            raise StorageError(
                f"file URL {shown!r} names host {redact_url('file://' + netloc)[7:]!r}: a file store takes an absolute path, "
                f"file:///absolute/path (three slashes), e.g. file:///var/cache/kvtier"
            )
        if not u.path.startswith("/"):
            raise StorageError(f"file URL {redact_url(u.url)!r} has no absolute path; use file:///absolute/path")
        cap = None
        for name, scale in (("max_bytes", 1), ("max_gb", 1 << 30)):
            if name in u.query:
                cap = int(positive_option(u.query, name, "file", "max_gb=100", scale))
                break
        return cls(u.path, cap, tenants=TenantBounds.from_query(u.query, "file"))

    def _names(self, key: str) -> tuple[str, str, str]:
        """(namespace directory, shard directory, file name) of a key: never the raw strings."""
        ns, _, h = key.rpartition("/")
        d = self._ns_names.get(ns)
        if d is None:
            d = self._ns_names.setdefault(ns, dir_name(ns))
        name = file_name(h)
        return d, name[:2], name

    def _path(self, key: str) -> str:
        d, shard, name = self._names(key)
        return os.path.join(self._root, d, shard, name)  # str, not Path: this runs once per page read

    def _open_dir(self, parent_fd: int, name: str, create: bool) -> int:
        """``name`` under ``parent_fd`` as a directory fd, never through a symlink (ELOOP/ENOTDIR)."""
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, 0o700, dir_fd=parent_fd)
            except FileExistsError:
                pass
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)

    def _shard_fd(self, key: str, create: bool) -> tuple[int, str]:
        """An fd of the key's shard directory (the caller closes it) and the file name in it."""
        d, shard, name = self._names(key)
        try:
            return self._open_dir(self._ns_fd(d, create), shard, create), name
        except FileNotFoundError:
            if not create:
                raise
        # the namespace directory, or the whole root, was removed under us (an operator wiped the
        # store): open them again, the root recreated where it was gone, and write on
        with self._fd_lock:
            fd = self._ns_fds.pop(d, None)
            if fd is not None:
                os.close(fd)
            if not os.path.isdir(self._root):
                self._reopen_root()
                self.roots_recreated += 1
                log.warning("file store root %s was removed under a running store; recreated it", self._root)
        return self._open_dir(self._ns_fd(d, create), shard, create), name

    def _ns_fd(self, d: str, create: bool) -> int:
        ns_fd = self._ns_fds.get(d)
        if ns_fd is None:
            with self._fd_lock:
                ns_fd = self._ns_fds.get(d)
                if ns_fd is None:
                    ns_fd = self._ns_fds[d] = self._open_dir(self._root_fd, d, create)
        return ns_fd

    def _reopen_root(self) -> None:
        """Recreate the root and reopen every fd under it (called with ``_fd_lock`` held)."""
        for fd in self._ns_fds.values():
            os.close(fd)
        self._ns_fds.clear()
        self.root.mkdir(parents=True, exist_ok=True)
        old, self._root_fd = self._root_fd, os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        if old >= 0:
            os.close(old)
        self._approx_bytes = None  # the usage is whatever is there now: scan at the next capped write

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
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                except FileNotFoundError:
                    fd = -1
                if fd >= 0:
                    try:
                        st = os.fstat(fd)
                        regular, size = stat.S_ISREG(st.st_mode), st.st_size
                        got = os.preadv(fd, parts, 0) if regular and size == want else -1
                        if got == want:
                            os.utime(fd)  # LRU: a hit is a use
                    finally:
                        os.close(fd)
                    if got == want:
                        status[0] = KeyStatus.OK
                        self.stats.get_hits += 1
                        self.stats.bytes_read += got
                    elif regular and size != want:
                        status[0] = KeyStatus.WRONG_SIZE  # not read: the reader deletes it, so the next save writes it again
                    else:  # not a file (never an object of this store: left alone), or a short read (changed in place)
                        status[0] = KeyStatus.ERROR
            result.append(status[0])
        return result

    def set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[KeyStatus]:
        return self.set_scattered(keys, [(v,) for v in values])

    def set_scattered(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[KeyStatus]:
        """Write each object from its buffers (one ``writev``), to a temp name, then rename it into place."""
        if self._full and not self._room_after_sweep():  # only guaranteed bytes above the cap: nothing may make room
            self.refused_full += len(keys)
            return [KeyStatus.ERROR] * len(keys)
        result = []
        for key, bufs in zip(keys, parts):
            status = [KeyStatus.ERROR]
            self.stats.sets += 1

            def failed(_e: BaseException) -> None:
                pass

            with map_storage_errors(self.stats, f"file set {key}", failed):
                dir_fd, name = self._shard_fd(key, create=True)
                try:
                    tmp = f".tmp-{os.getpid()}-{threading.get_ident()}-{next(self._tmp_ids)}"
                    fd = os.open(tmp, _CREATE, 0o600, dir_fd=dir_fd)
                    try:
                        try:
                            _write_all(fd, bufs)
                        finally:
                            os.close(fd)
                        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                    except BaseException:
                        try:
                            os.unlink(tmp, dir_fd=dir_fd)
                        except FileNotFoundError:
                            pass
                        raise
                finally:
                    os.close(dir_fd)
                status[0] = KeyStatus.OK
                size = sum(len(p) for p in bufs)
                self.stats.bytes_written += size
                self._written_since_scan += size
                if self._approx_bytes is not None:
                    self._approx_bytes += size
                if self.tenants is not None:
                    self._count_tag(tag_of_parts(bufs), size)
            result.append(status[0])
        self._enforce_cap()
        return result

    def _count_tag(self, tag: int, size: int) -> None:
        n = self.tag_bytes[tag] = self.tag_bytes.get(tag, 0) + size
        cap = self.tenants.max_bytes
        if cap is not None and n > cap and is_tenant(tag):
            self._tenant_over = True

    def delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            with map_storage_errors(self.stats, f"file delete {k}", lambda _e: None):
                try:
                    dir_fd, name = self._shard_fd(k, create=False)
                except FileNotFoundError:
                    continue
                try:
                    os.unlink(name, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
                finally:
                    os.close(dir_fd)

    def delete_namespace(self, namespace: str) -> int:
        """Remove the namespace's directory tree (never following a symlink: fds from the root)."""
        d = dir_name(namespace)
        removed = 0
        with map_storage_errors(self.stats, f"file delete namespace {namespace}", lambda _e: None):
            try:
                ns_fd = self._open_dir(self._root_fd, d, create=False)
            except FileNotFoundError:
                return 0
            try:
                for shard in os.listdir(ns_fd):
                    try:
                        shard_fd = self._open_dir(ns_fd, shard, create=False)
                    except (FileNotFoundError, NotADirectoryError, OSError):
                        continue
                    try:
                        for name in os.listdir(shard_fd):
                            try:
                                os.unlink(name, dir_fd=shard_fd)
                                removed += 0 if name.startswith(".tmp-") else 1
                            except FileNotFoundError:
                                pass
                    finally:
                        os.close(shard_fd)
            finally:
                os.close(ns_fd)
            self._approx_bytes = None  # rescan at the next capped write
        return removed

    def usage_bytes(self) -> int:
        return sum(os.stat(path).st_size for path, _head in self._files())

    def _files(self, sweep_temps: bool = False):
        """This store's committed page objects (path, first 16 bytes); with ``sweep_temps``, its stale temp files met on the
        way are deleted. Only what this store writes is ever looked at: ``<root>/<namespace dir>/
        <shard>/<page file>`` with every name in the store's own pattern and the object's magic at
        its start. A directory the user shares with the store keeps everything else, whatever its age
        (a file named like a page that is not one included)."""
        stale_before = time.time_ns() - int(self.stale_temp_s * 1e9)
        for ns in _scandir(self._root):
            if not (ns.is_dir(follow_symlinks=False) and _NS_DIR.fullmatch(ns.name)):
                continue
            for shard in _scandir(ns.path):
                if not (shard.is_dir(follow_symlinks=False) and _SHARD.fullmatch(shard.name)):
                    continue
                for f in _scandir(shard.path):
                    name = f.name
                    if name.startswith(".tmp-"):
                        if sweep_temps and _TEMP.fullmatch(name) and _page_head(f.path, allow_empty=True) is not None:
                            self._remove_if_stale(f.path, stale_before)
                    elif name[:2] == shard.name and _PAGE_FILE.fullmatch(name):
                        head = _page_head(f.path)
                        if head is not None:
                            yield f.path, head

    def _remove_if_stale(self, tmp: str, stale_before_ns: int) -> None:
        try:
            if os.stat(tmp).st_mtime_ns < stale_before_ns:
                os.unlink(tmp)
                self.stale_temps_removed += 1
        except FileNotFoundError:
            pass  # renamed into place or swept by another process meanwhile

    def _enforce_cap(self) -> None:
        """After writes: sweep when this process's count passes the store's cap, when others may have passed it (every
        ``rescan_fraction`` of it written since the last scan; the first write scans), or when its count passes a
        tenant's cap -- at most as often as :meth:`_sweep_spacing_s` allows: a sweep scans the whole store."""
        cap, seen = self.max_bytes, self._swept_at
        if cap is not None and (self._approx_bytes is None or self._approx_bytes > cap
                                or self._written_since_scan > self.rescan_fraction * cap):
            self.sweep(unless_since=seen)
        elif self._tenant_over and time.monotonic() - seen >= self._sweep_spacing_s():
            self.sweep(unless_since=seen)

    def _sweep_spacing_s(self) -> float:
        """The least time between sweeps a tenant's cap or lifetime asks for: a second, or ten times the last sweep's
        scan, so that sweeping takes at most a tenth of one thread however large the store (a tenant passes its cap by
        at most what it writes meanwhile, on every writer)."""
        return max(1.0, 10.0 * self._scan_s)

    def _room_after_sweep(self) -> bool:
        """A full store looks again at most once a second (another process, an expiry or an operator may have made room)."""
        seen = self._swept_at
        if time.monotonic() - seen >= 1.0:
            self.sweep(unless_since=seen)
        return not self._full

    def sweep(self, unless_since: float | None = None) -> Sweep | None:
        """Scan the store once: delete stale temp files, then what the store's cap and the tenants' bounds say
        (:func:`~kvtier.l3.tenant_bounds.plan_sweep`), and count it. ``unless_since``: skip it (None) if another
        thread swept since that :attr:`_swept_at` (a writer that waited for the sweeper's lock needs no second scan)."""
        with self._sweep_lock:
            if unless_since is not None and self._swept_at != unless_since:
                return None
            started = time.monotonic()
            self._written_since_scan = 0
            self._tenant_over = False
            objects = []
            for path, head in self._files(sweep_temps=True):
                try:
                    st = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                objects.append(StoredObject(st.st_mtime_ns, st.st_size, tag_of(head), path))
            plan = plan_sweep(objects, self.tenants or TenantBounds(), self.max_bytes, time.time_ns())
            for o in plan.deleted:
                try:
                    os.unlink(o.ref)
                except FileNotFoundError:
                    pass
            self.sweeps += 1
            self.expired_objects += len(plan.expired)
            self.capped_objects += len(plan.capped)
            self.evicted_objects += len(plan.evicted)
            self._approx_bytes = plan.total
            self.tag_bytes = plan.by_tag if self.tenants is not None else {}
            was_full, self._full = self._full, plan.full
            self._swept_at = time.monotonic()
            self._scan_s = self._swept_at - started
            if plan.full and not was_full:  # (said once as it fills, not at each look while full)
                log.warning("file store %s: %d bytes above its cap of %d are tenants' guaranteed bytes; new objects are refused "
                            "until a sweep finds room", self._root, plan.total - self.max_bytes, self.max_bytes)
            return plan

    def _sweep_every(self, step_s: float) -> None:
        """Sweep every ``step_s`` (or ten times the last scan's time, if longer) while a lifetime is set; with a tenants'
        cap alone, only when a write passed it and its own sweep had to wait (a tenant that stops writing past its
        cap is still brought under it)."""
        while not self._closing.wait(max(step_s, 10.0 * self._scan_s)):
            if self.tenants.ttl_s is None and not self._tenant_over:
                continue
            try:
                self.sweep()
            except Exception as e:  # never kill the sweeper: the next step tries again
                log.warning("file store %s: sweep failed: %s", self._root, e)

    def close(self) -> None:
        self._closing.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=10.0)
        with self._fd_lock:
            for fd in self._ns_fds.values():
                os.close(fd)
            self._ns_fds.clear()
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1
