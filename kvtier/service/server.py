"""``kvtier serve``'s process: one listening Unix socket, one region, one :class:`~kvtier.service.index.HostIndex`.

A single thread runs a selector over the listening socket, every connection, the L3 tier's completions
and the orphans' processes; each frame is one batch of ops, applied to the index in order and answered
in one frame. The connections -- accepting (who may attach, how many), reading, the fair turns that
bound what one peer holds and how long it delays the others, sending, and dropping a peer that breaks
the protocol or leaves its answers unread -- are :mod:`kvtier.service.connections`' business; it calls
:meth:`NodeService._apply_frame` for what a frame means and tells the service of each closed
connection. So a client that floods the service with the largest legal frames delays another's lookup
by about one of them (~20 ms), not by its whole backlog.

The service makes the region, names its pages, and removes it on close; it touches the region's bytes
only with an L3 tier (:mod:`kvtier.service.storage`: published pages saved, pages fetched from the
store), on that tier's worker threads, never on the selector thread. A lookup's answer may then wait,
at most the ``wait_s`` it names, for the pages after its run to come in from the store; the
connection's next frames wait behind it (answers go out in order), the other connections do not.

What a closed connection held -- released, or kept as an orphan while its process lives or a writer of
it is connected -- is :mod:`kvtier.service.sessions`' business (as are its orphans, bounded per
process); each message's handler is the ``_on_<name>`` method its definition in
:mod:`kvtier.service.messages` names (checked at import). The L3 tier's threads are a fixed few,
whatever the namespaces (:mod:`kvtier.service.storage`).
"""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.config import check_number
from kvtier.errors import ConfigError, KVTierError, ServiceError, ServiceProtocolError
from kvtier.pools.memory import DEFAULT_RESERVE_BYTES, host_memory_available
from kvtier.service.connections import Connection, Connections
from kvtier.service.index import HostIndex
from kvtier.service.metrics import namespace_label
from kvtier.service.messages import (MAX_WAIT_S, Find, Hello, Join, Lookup, Message, Publish, Release, Reserve, check_handlers,
                                     check_object_names, parse_batch)
from kvtier.service.peer import claim_socket_path, group_id, private_socket_dir, share_with_group
from kvtier.service.records import QUARANTINE_S, PageRecords, session_digest
from kvtier.service.region import (Owner, Region, RegionFormat, adoptable_region, claim_region, create_region, find_adoptable, map_region,
                                   release_region, remove_region, remove_stale_regions, write_format)
from kvtier.service.sessions import Orphan, Sessions
from kvtier.service.storage import Load, ServiceStorage, shard_prefixes
from kvtier.service.tenants import WORDS, RegionBounds, RegionTenants, l3_tag, owner_id
from kvtier.service.wire import decode

log = logging.getLogger(__name__)

#: the longest path a Unix socket address holds (sun_path's 108 bytes, less the terminating NUL)
MAX_SOCKET_PATH = 107
#: how often the loop checks that its region file is still there, whole (seconds)
REGION_CHECK_S = 1.0


@dataclass(frozen=True)
class ServeConfig:
    """``kvtier serve``'s settings."""

    host_gb: float = field(metadata={"help": "host tier size in GB: the shared region every attached engine maps"})
    socket: str = field(metadata={"help": "Unix socket path; its directory is made with mode 0700 (or must be so)"})
    send_deadline_s: float = field(default=5.0, metadata={"help": "a client that leaves answers unread this long is dropped"})
    allow_group: str | None = field(default=None, metadata={
        "help": "a group (name or gid) whose members of other uids may attach: the socket's directory 0750 and the region 0660 "
                "of that group; they can read and write every page of the region"})
    metrics_port: int | None = field(default=None, metadata={
        "help": "serve Prometheus metrics over HTTP on this port (0: a free one, named in the banner)"})
    metrics_host: str = field(default="127.0.0.1", metadata={"help": "the address the metrics are served on"})
    storage_url: str | None = field(default=None, metadata={"help": "the L3 tier below the region (any kvtier storage URL); None: none"})
    drain_timeout_s: float = field(default=30.0, metadata={"help": "on SIGTERM, how long pending L3 saves may take before the "
                                                                   "service stops without them"})
    verify_sample: float = field(default=0.01, metadata={
        "help": "the fraction of host hits whose bytes are verified against their page's checksum before they are offered (a "
                "page that fails is dropped: a miss); 1.0 verifies every hit"})
    fresh_region: bool = field(default=False, metadata={
        "help": "start with an empty region even where a killed service left one on this socket (default: adopt it, offering "
                "again the pages whose bytes verify)"})
    zero_evicted_pages: bool = field(default=False, metadata={
        "help": "zero a region page's bytes when it is evicted or its write is dropped, before any engine reserves it again: "
                "an engine never reads a page another engine (another tenant) wrote there"})
    tenant_host_pages: int = field(default=0, metadata={
        "help": "pages of the region guaranteed to each tenant (an engine labels its pages by tenant): no reservation "
                "evicts a tenant's pages below this"})
    tenant_max_host_pages: int | None = field(default=None, metadata={
        "help": "the most pages of the region a tenant may hold: at it, its own least recently released pages make room; "
                "None: no cap"})
    tenant_ttl_s: float | None = field(default=None, metadata={
        "help": "a page nobody has held this long leaves the region (zeroed with --zero-evicted-pages); None: no lifetime"})
    tenant_accounting: bool = field(default=False, metadata={
        "help": "count each tenant's pages, hits and losses in --status and the metrics even with no tenant bound set"})
    keep_region: bool = field(default=False, metadata={
        "help": "on SIGTERM, leave the region (and its page records) for the next service on this socket to adopt -- an "
                "upgrade keeps the host tier -- instead of removing it"})

    def __post_init__(self) -> None:
        check_number(self, "host_gb", above=0)
        check_number(self, "send_deadline_s", above=0)
        check_number(self, "metrics_port", at_least=0, at_most=65535, integer=True)
        check_number(self, "drain_timeout_s", at_least=0)
        check_number(self, "verify_sample", at_least=0, at_most=1)
        if not isinstance(self.socket, str) or not self.socket:
            raise ConfigError(f"ServeConfig.socket (--socket) must be a path; got {self.socket!r}")
        if len(os.fsencode(self.socket)) > MAX_SOCKET_PATH:
            raise ConfigError(f"--socket {self.socket[:60]}...: a Unix socket's path holds at most {MAX_SOCKET_PATH} bytes, this one "
                              f"{len(os.fsencode(self.socket))}; choose a shorter path (e.g. /run/kvtier/node.sock)")
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ConfigError(f"ServeConfig.metrics_host must be an address; got {self.metrics_host!r}")
        if self.allow_group is not None and (not isinstance(self.allow_group, str) or not self.allow_group):
            raise ConfigError(f"ServeConfig.allow_group must be a group name or gid; got {self.allow_group!r}")
        check_number(self, "tenant_host_pages", at_least=0, integer=True)
        check_number(self, "tenant_max_host_pages", at_least=1, integer=True)
        check_number(self, "tenant_ttl_s", above=0)
        RegionBounds(self.tenant_host_pages, self.tenant_max_host_pages)  # (the guarantee within the cap)
        if self.storage_url is not None and (not isinstance(self.storage_url, str) or not self.storage_url):
            raise ConfigError(f"ServeConfig.storage_url must be a storage URL (e.g. file:///var/cache/kvtier); got {self.storage_url!r}")

    @property
    def host_bytes(self) -> int:
        return int(self.host_gb * (1 << 30))

    @property
    def tenant_bounds(self) -> RegionBounds:
        return RegionBounds(self.tenant_host_pages, self.tenant_max_host_pages, self.tenant_ttl_s, self.tenant_accounting)


@dataclass(eq=False)
class _Deferred:
    """A batch's answer held back while its lookups' L3 loads run, until they are done or ``deadline``;
    ``waits``: (the op's index in the answer, the op -- a lookup or a find -- and the load)."""

    answer: dict
    waits: list[tuple[int, Message, Load]]
    deadline: float

    def ready(self, now: float) -> bool:
        return now >= self.deadline or all(load.done for _i, _op, load in self.waits)


class NodeService:
    """Binds ``config.socket`` (its directory private, a stale socket replaced), removes the regions its
    user's killed services left, and serves until :meth:`serve`'s ``stop`` says so; :meth:`close`
    removes the socket and the region. ``uid``: the one uid admitted (default: the service's own;
    ``config.allow_group`` admits that group's members too). ``lock`` is held while the loop acts on
    what it selected (a metrics scrape reads the service under it)."""

    def __init__(self, config: ServeConfig, *, uid: int | None = None):
        self.config = config
        self.uid = os.getuid() if uid is None else uid
        self.gid = None if config.allow_group is None else group_id(config.allow_group)
        available = host_memory_available()
        if config.host_bytes > available - DEFAULT_RESERVE_BYTES:
            raise ConfigError(f"--host-gb {config.host_gb:g} is more than the {max(available - DEFAULT_RESERVE_BYTES, 0) / (1 << 30):.2f} "
                              "GB of host memory available (minus a 1 GB reserve); lower --host-gb")
        self.region: Region | None = None
        self.index: HostIndex | None = None
        self.records: PageRecords | None = None
        self.sessions = Sessions(watch=lambda fd, orphan: self._sel.register(fd, selectors.EVENT_READ, orphan),
                                 unwatch=lambda fd: self._sel.unregister(fd))
        self.lock = threading.Lock()
        #: the L3 tier below the region and the metrics server (first: a bad URL, a busy port or a bad address
        #: fails before the socket is made, so before anyone attaches)
        self.storage = self.metrics = None
        try:
            self.storage = ServiceStorage(config.storage_url) if config.storage_url else None
            if config.metrics_port is not None:
                from kvtier.service.metrics import serve_metrics

                self.metrics = serve_metrics(self, config.metrics_host, config.metrics_port)
            #: when an adopted region's grace period ends (time.monotonic()), its parked pages (and who was writing each)
            self._unpark_at: float | None = None
            self._parked: dict = {}
            self._adopted_unclaimed = False
            #: what adopting a killed service's region found (status's ``adopted``)
            self.adopted: dict | None = None
            # (locked before the socket is claimed: from the stale socket's removal on, no other service takes the region)
            found = None if config.fresh_region else find_adoptable(config.socket)
            try:
                self.listener = self._listen()
            except BaseException:
                if found is not None:
                    os.close(found[2])  # (not ours to adopt: a live service listens there)
                raise
            if found is not None:
                self._adopt(*found)
            remove_stale_regions(socket=config.socket)  # (what its user's killed services left, and will not adopt)
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            if self.storage is not None:
                self.storage.close(0.0)
            raise
        self._sel = selectors.DefaultSelector()
        self.connections = Connections(self._sel, self.listener, uid=self.uid, gid=self.gid, send_deadline_s=config.send_deadline_s,
                                       apply_frame=self._apply_frame, closed=self._closed)
        if self.storage is not None:
            self._sel.register(self.storage, selectors.EVENT_READ, self.storage)
        #: connections whose answer waits for L3 loads (:class:`_Deferred`)
        self._deferred: set[Connection] = set()
        #: what happened to the region file under the running service (removed, truncated, replaced), if anything
        self.region_problem: str | None = None
        self._region_id: tuple[int, int] | None = None
        self._region_checked_at = 0.0
        if self.region is not None:
            self._bound(self.region)

    # ---- the region: made at the first hello, or adopted from a killed service ----------------------
    def _adopt(self, folder: str, doc: dict, lock: int) -> None:
        """Take over the region a killed (or ``--keep-region``) service left on this socket, if any: the pages whose
        bytes verify are offered again (READY; not evicted for :data:`~kvtier.service.records.QUARANTINE_S`), those
        being written at the crash are parked (for as long, and then while their writer lives). A region this service
        cannot adopt (another version, --host-gb or group, not a region file of ours) is removed, and said so; it is
        never misread. ``folder``, ``doc``, ``lock``: :func:`~kvtier.service.region.find_adoptable`'s (locked: no other
        service removes or adopts it meanwhile)."""
        started = time.monotonic()
        try:
            claim_region(folder)  # (its owner from now on: no other starting service takes it for stale)
            region = adoptable_region(folder, doc, self.config.host_bytes, self.gid, lock)
            if self.storage is not None and not region.format.stores_objects:
                raise ServiceError("its format names no spec nor its rows' objects, which this service's L3 tier (--storage-url) needs "
                                   "to store its pages")
            records = self._records(region, fresh=False)
            adopted = records.adopt()
        except (OSError, KVTierError) as e:
            shutil.rmtree(folder, ignore_errors=True)
            os.close(lock)
            log.warning("removed %s, the region a service left on this socket, without adopting it: %s", folder, e)
            return
        self.region, self.records = region, records
        self.index = self._index(region.num_pages, records, region.format.pools)
        self.index.adopt(adopted.pages, list(adopted.quarantined))
        self._parked = adopted.quarantined
        self._unpark_at = time.monotonic() + QUARANTINE_S
        self._adopted_unclaimed = True
        self.adopted = {"region": region.path, "pages": len(adopted.pages), "parked_pages": len(adopted.quarantined),
                        "dropped_pages": adopted.dropped, "seconds": round(time.monotonic() - started, 3)}
        log.info("adopted %s: %d pages verified and offered again, %d dropped (bytes changed after their write), %d parked for "
                 "%g s (being written when the service died), in %.2f s", region.path, len(adopted.pages), adopted.dropped,
                 len(adopted.quarantined), QUARANTINE_S, self.adopted["seconds"])

    def _records(self, region: Region, *, fresh: bool) -> PageRecords:
        memory = map_region(region.path, region.size, pin=False)
        return PageRecords(region, memory.numpy(), verify_sample=self.config.verify_sample, fresh=fresh, keep=memory,
                           writer_of=self.sessions.writer_of, zero_freed=self.config.zero_evicted_pages)

    def _make_region(self, fmt: RegionFormat) -> None:
        """A fresh region for the first engine's format, with its records and index; nothing is kept of a failure."""
        region = create_region(fmt, self.config.host_bytes, gid=self.gid, socket=self.config.socket)
        try:
            records = self._records(region, fresh=True)
        except (OSError, KVTierError) as e:
            remove_region(region)
            raise ServiceError(f"cannot map the region {region.path} the service made ({e}); restart kvtier serve") from None
        self.region, self.records, self.index = region, records, self._index(region.num_pages, records, fmt.pools)
        self._bound(region)
        log.info("region %s: %d pages of %d bytes", region.path, region.num_pages, fmt.page_bytes)

    def _index(self, num_pages: int, records: PageRecords, pools: int) -> HostIndex:
        bounds = self.config.tenant_bounds
        return HostIndex(num_pages, records, pools, tenants=RegionTenants(bounds) if bounds.enabled else None)

    def _bound(self, region: Region) -> None:
        """The parts that follow the region: the sessions' index, the file's identity (and the L3 tier's mapping,
        bound once an engine attached: an adopted region the first engine cannot use is dropped unbound)."""
        self.sessions.bind(self.index)
        st = os.stat(region.path)
        self._region_id = (st.st_dev, st.st_ino)

    def _drop_adopted(self, why: str) -> None:
        """The adopted region, which no engine attached to yet, given up (the first engine is of another format)."""
        log.warning("removed the adopted region %s: %s", self.region.path, why)
        self.records.close()
        remove_region(self.region)
        self.region = self.index = self.records = None
        self._unpark_at = None
        self._parked = {}
        self._adopted_unclaimed = False

    def _unpark_quiesced(self, conn: Connection, previous: str) -> None:
        """``conn``'s process attaches naming ``previous`` as quiesced (its copies done): the pages it was writing
        in that session when the old service died are free now -- only that process's (a session id alone is not
        proof: the pid and start time recorded with the page must be the caller's)."""
        digest = session_digest(previous)
        me = Owner.of(conn.pid)
        mine = [page for page, w in self._parked.items() if w is not None and w.session == digest and w.process == me]
        if mine:
            self.index.unpark(mine)
            for page in mine:
                del self._parked[page]
            log.info("%d parked pages free: the process that was writing them (%d) attached again, its copies done", len(mine), conn.pid)

    def _unpark_due(self) -> None:
        """The adoption's grace period is over: its holds end, and the parked pages whose writer is gone are free
        again (the others are checked again a grace period later)."""
        released = self.index.release_adopted()
        gone = [page for page, writer in self._parked.items() if writer is None or not writer.process.alive()]
        self.index.unpark(gone)
        for page in gone:
            del self._parked[page]
        self._unpark_at = time.monotonic() + QUARANTINE_S if self._parked else None
        log.info("the adopted region's %d pages are evictable again, %d parked pages free (%d wait on their writer's exit)", released,
                 len(gone), len(self._parked))

    # (the transport's counters, read by status and the metrics)
    @property
    def refused(self) -> int:
        """Peers refused at the door."""
        return self.connections.refused

    @property
    def protocol_errors(self) -> int:
        """Connections refused for a message that broke the protocol (or closed on an internal error)."""
        return self.connections.protocol_errors

    @property
    def unread_drops(self) -> int:
        """Clients dropped for leaving their answers unread."""
        return self.connections.unread_drops

    @property
    def fd_limit_hits(self) -> int:
        """Times accept found no file descriptor left (the service paused accepting, and served on)."""
        return self.connections.fd_limit_hits

    def _listen(self) -> socket.socket:
        """The listening socket at ``config.socket``: its directory private (or the allowed group's), a stale
        socket replaced, the socket itself 0600 (0660 of the group)."""
        path = self.config.socket
        private_socket_dir(path, os.getuid(), self.gid)
        claim_socket_path(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        if self.gid is None:
            os.chmod(path, 0o600)
        else:
            share_with_group(path, self.gid, 0o660, "the socket")
        listener.listen(64)
        listener.setblocking(False)
        return listener

    # ---- the loop --------------------------------------------------------------------------------
    def serve(self, stop: Callable[[], bool], tick_s: float = 0.1) -> None:
        while not stop():
            events = self._sel.select(self._wait_s(tick_s))
            with self.lock:
                self._handle(events)
                self.connections.apply_turn()
                self._answer_deferred()
                self.connections.drop_stalled_readers()
                self.connections.resume_accepting()
                self.sessions.watch_unwatched()
                if time.monotonic() - self._region_checked_at >= REGION_CHECK_S:
                    self._check_region()
                if self._unpark_at is not None and time.monotonic() >= self._unpark_at:
                    self._unpark_due()
                if self.index is not None and self.config.tenant_ttl_s is not None:
                    self.index.expire()
                self.connections.drop_unfinished_frames()

    def _handle(self, events: list) -> None:
        for key, mask in events:
            if key.data is None:  # the listener
                self.connections.accept()
            elif key.data is self.storage:  # an L3 worker finished something
                self.storage.poll()
            elif type(key.data) is Orphan:  # its process exited
                self.sessions.orphan_exited(key.data)
            else:
                self.connections.handle(key.data, mask)

    def _wait_s(self, tick_s: float) -> float:
        """The selector's wait: none while frames wait to be applied; else a tick, or less when a deferred
        answer's deadline comes sooner."""
        if self.connections.busy:
            return 0.0
        if not self._deferred:
            return tick_s
        return max(0.0, min(tick_s, min(c.deferred.deadline for c in self._deferred) - time.monotonic()))

    def _apply_frame(self, conn: Connection, body: bytes) -> int:
        """Decode, check and apply one frame, and answer it (or defer its answer); the pages it named."""
        seq = 0
        waits: list[tuple[int, list[bytes], Load]] = []
        wait_s = MAX_WAIT_S
        try:
            frame = decode(body)
            seq = frame.get("seq") if type(frame.get("seq")) is int else 0
            batch = parse_batch(frame)
            results = []
            for op in batch.ops:
                results.append(self._apply(conn, op))
                load = (self._load_after(conn, op, results[-1]) if type(op) is Lookup else
                        self._objects_after(conn, op, results[-1]) if type(op) is Find else None)
                if load is not None and op.wait_s > 0:
                    waits.append((len(results) - 1, op, load))
                    wait_s = min(wait_s, op.wait_s)
        except ServiceError as e:  # (a protocol error is one)
            self.connections.refuse(conn, seq, e)
            return 0
        if batch.note:
            return batch.pages
        answer = {"seq": batch.seq, "results": results}
        if waits:
            conn.deferred = _Deferred(answer, waits, time.monotonic() + wait_s)
            self._deferred.add(conn)
        else:
            self.connections.send(conn, answer)
        return batch.pages

    def _load_after(self, conn: Connection, op: Lookup, pages: list[int]) -> Load | None:
        """The L3 load of the keys after a lookup's run in the region (None: no L3, the run is whole, or
        the store has nothing to add)."""
        if self.storage is None or len(pages) == len(op.keys):
            return None
        return self.storage.load(conn.namespace, op.keys[len(pages):], self._names(op.names, len(pages)))

    def _objects_after(self, conn: Connection, op: Find, found: list[int]) -> Load | None:
        """The L3 load of the objects a find missed in the region (None: no L3, or nothing to fetch)."""
        if self.storage is None or op.pool == 0 or -1 not in found:  # (pool 0's pages come from L3 by a lookup's run)
            return None
        missed = [i for i, p in enumerate(found) if p < 0]
        names = self._names(op.names, 0)
        return self.storage.load_objects(conn.namespace, op.pool, [op.keys[i] for i in missed],
                                         None if names is None else [names[i] for i in missed])

    def _answer_deferred(self) -> None:
        """Send the deferred answers that are ready: each lookup's run extended by what its load brought
        into the region by now (held for the client as any lookup's pages)."""
        now = time.monotonic()
        for conn in [c for c in self._deferred if c.deferred.ready(now)]:
            self._deferred.discard(conn)
            deferred, conn.deferred = conn.deferred, None
            if conn not in self.connections:
                continue
            try:
                results = deferred.answer["results"]
                if conn.attached:  # (a bye later in the batch detached it: nothing more is held for it)
                    for i, op, _load in deferred.waits:
                        if type(op) is Find:  # (each key it missed, found again: what the load brought is held now)
                            missed = [j for j, p in enumerate(results[i]) if p < 0]
                            for j, p in zip(missed, self.index.find(conn.id, [op.keys[j] for j in missed], op.pool, again=True)):
                                results[i][j] = p
                        else:
                            results[i] = results[i] + self.index.extend(conn.id, op.keys[len(results[i]):])
                self.connections.send(conn, deferred.answer)
            except Exception:
                self.connections.fault(conn)
                continue
            self.connections.answered(conn)

    # ---- ops: one handler per message (messages.py's definitions; check_handlers below) --------------
    def _apply(self, conn: Connection, op: Message) -> object:
        if op.ATTACHED and not conn.attached:
            raise ServiceProtocolError(f"{op.NAME} before hello (or after bye): a connection's first op is hello")
        return getattr(self, "_on_" + op.NAME)(conn, op)

    def _on_status(self, conn: Connection, op: Message) -> dict:
        return self.status()

    def _on_hello(self, conn: Connection, op: Hello) -> dict:
        if conn.attached or conn.joined is not None or conn.session:
            raise ServiceProtocolError("hello on a connection that said hello or join already: a connection attaches once")
        fmt = RegionFormat.from_wire(op.format)
        if self.storage is not None and not fmt.stores_objects:
            # (a kvtier spec, its ranks' shards, or rows of an engine's own pools whose objects it describes: SGLang's)
            raise ServiceError("hello's format names no spec nor its rows' objects, which this service's L3 tier (--storage-url) needs "
                               "to store its pages (an older kvtier, or an SGLang pool whose shard is not the engine's rank); attach "
                               "this engine to a service without --storage-url")
        if self.storage is not None:
            shard_prefixes(op.namespace, fmt)  # (each shard's L3 namespace follows from it: else refused now)
        if self._adopted_unclaimed and not _same_pages(fmt, self.region.format):
            self._drop_adopted(f"it holds pages of {self.region.format.fingerprint}, and the first engine attached is of "
                               f"{fmt.fingerprint}")
        claiming = self._adopted_unclaimed
        if self.region is None:
            self._make_region(fmt)
            claiming = True
        elif self._check_region():
            raise ServiceError(f"the node service's region {self.region.path} {self.region_problem}: it cannot give a new engine "
                               "its pages; restart kvtier serve (its engines keep what they mapped, and attach again)")
        elif not _same_pages(fmt, self.region.format):
            raise ServiceError(f"this service's region holds pages of another format ({self.region.format}, rows "
                               f"{self.region.format.rows}); an engine of {fmt} (rows {fmt.rows}) needs a service of its own (one page "
                               "format per service)")
        if claiming and self.storage is not None:
            self.storage.bind(self.region, self.index)
        if op.previous is not None and self._parked:
            self._unpark_quiesced(conn, op.previous)
        self._adopted_unclaimed = False
        stale = self.sessions.attach(conn, op.namespace, op.previous)
        conn.share = op.share
        if stale is not None:
            self.connections.drop(stale)
        return {"region": self.region.path, "size": self.region.size, "num_pages": self.region.num_pages, "session": conn.session}

    def _on_join(self, conn: Connection, op: Join) -> dict:
        if conn.attached or conn.joined is not None or conn.session:
            raise ServiceProtocolError("join on a connection that said hello or join already")
        self.sessions.join(conn, op.session)
        return {"session": op.session}

    def _on_bye(self, conn: Connection, op: Message) -> None:
        if conn.joined is not None:
            self.sessions.leave(conn)
        elif not conn.attached:
            raise ServiceProtocolError("bye before hello (or after bye): a connection's first op is hello")
        else:
            self.sessions.detach(conn)

    def _on_lookup(self, conn: Connection, op: Lookup) -> list[int]:
        return self.index.lookup(conn.id, op.keys)

    def _on_reserve(self, conn: Connection, op: Reserve) -> list[int]:
        return self.index.reserve(conn.id, op.n, self._pool(op.pool, "reserve"))

    def _on_find(self, conn: Connection, op: Find) -> list[int]:
        pool = self._pool(op.pool, "find")
        check_object_names(op.names, op.keys, "find", lambda _i, name: self.region.format.key_of(pool, name))
        return self.index.find(conn.id, op.keys, pool)

    def _pool(self, pool: int, what: str) -> int:
        if pool >= self.region.format.pools:
            raise ServiceProtocolError(f"{what}: pool {pool} is not one of the region's {self.region.format.pools} (its pages, and "
                                       f"{len(self.region.format.objects)} object pools)")
        return pool

    def _on_publish(self, conn: Connection, op: Publish) -> None:
        fmt, n = self.region.format, self.region.num_pages

        def key_of(i: int, name: str) -> bytes:  # (each name against its page's pool's key; a page out of the region -- a
            pool = op.pages[i] // n  # negative one too -- is checked as a page's, then refused by the index, next)
            return fmt.key_of(pool if 0 <= pool < fmt.pools else 0, name)

        check_object_names(op.names, op.keys, "publish", key_of)
        indexed = self.index.publish(conn.id, op.pages, op.keys, op.owners)
        if self.storage is not None:  # write-through: what it indexed now is saved, and what its tenant's cap left unindexed
            if len(indexed) < len(op.pages):  # (a duplicate's key is indexed, on its first page; a capped page's is not)
                done = set(indexed)
                indexed += [p for p, k in zip(op.pages, op.keys) if p not in done and not self.index.has(conn.namespace, k)]
            at = {p: i for i, p in enumerate(op.pages)}
            names = self._names(op.names, 0)
            tags = None if op.owners is None else [l3_tag(op.owners[at[p]]) for p in indexed]
            self.storage.published(conn.namespace, indexed, [op.keys[at[p]] for p in indexed],
                                   None if names is None else [names[at[p]] for p in indexed], tags)

    def _names(self, names: list[str] | None, start: int) -> list[str] | None:
        """An op's object names from ``start`` on, where the region's format names its objects by them (else the
        names an engine gives say nothing the service's L3 uses)."""
        return None if names is None or self.region.format.rows is None else names[start:]

    def _on_release(self, conn: Connection, op: Release) -> None:
        self.index.release(conn.id, op.pages)

    def _check_region(self) -> bool:
        """Whether the region file is gone or changed under the service (removed, truncated, replaced by another
        file); the first time, say so in the log, and in :meth:`status` from then on."""
        self._region_checked_at = time.monotonic()
        if self.region is None or self.region_problem is not None:
            return self.region_problem is not None
        try:
            st = os.lstat(self.region.path)
        except FileNotFoundError:
            problem = "was removed under the running service"
        else:
            problem = (None if (st.st_dev, st.st_ino) == self._region_id and st.st_size == self.region.size else
                       f"is {st.st_size} bytes, not the region's {self.region.size} (truncated under the running service)"
                       if (st.st_dev, st.st_ino) == self._region_id else "was replaced by another file under the running service")
        if problem is not None:
            self.region_problem = problem
            log.error("the region %s %s: new engines are refused; restart kvtier serve", self.region.path, problem)
        return problem is not None

    @property
    def attached_clients(self) -> int:
        return len(self.sessions.attached)

    @property
    def orphaned_clients(self) -> int:
        return len(self.sessions.orphans)

    @property
    def joined_writers(self) -> int:
        """Connections of processes that joined a session as its writers (``join``)."""
        return self.sessions.joined_writers

    def status(self) -> dict:
        out = {"socket": self.config.socket, "refused": self.refused, "region": self.region.path if self.region else None,
               "writers": self.joined_writers}
        if self.region_problem is not None:
            out["region_problem"] = self.region_problem
        if self.index is not None:
            out |= self.index.status().as_dict()
            if self.region.format.objects:  # (the counts above are of every pool's ids: the pages', then each object pool's)
                out["region_pages"] = self.region.num_pages
                out["object_pools"] = [o.name for o in self.region.format.objects]
            # (a namespace names its salt, a secret of its engines: shown as a digest, as the metrics' labels do)
            out["pages_per_namespace"] = {namespace_label(ns): n for ns, n in out["pages_per_namespace"].items()}
            # (ready counts every written page; a page written again under a key published already is held by its
            # writer but offered to nobody: ready == sum(pages_per_namespace) + duplicates)
            out["duplicates"] = out["ready"] - sum(out["pages_per_namespace"].values())
            out["engines"] = self.engines()
            if self.index.tenants is not None:  # (each tenant a digest, each namespace as the engines' rows show it)
                out["tenants"], out["tenants_not_shown"] = self.tenant_usage()
        if self.records is not None:
            out["verify"] = {"sample": self.records.verify_sample, "verified_pages": self.records.verified_pages,
                             "failed_pages": self.records.verify_failed_pages}
            out["zeroed_pages"] = self.records.zeroed_pages if self.records.zero_freed else None
        if self.adopted is not None:
            out["adopted"] = self.adopted
        if self.storage is not None:
            out["l3"] = self.storage.status()
        # (the index counts an orphaned session as a client: here, the attached ones and the orphans apart)
        return out | {"clients": self.attached_clients, "orphaned": self.orphaned_clients, "protocol_errors": self.protocol_errors,
                      "unread_drops": self.unread_drops, "fd_limit_hits": self.fd_limit_hits}

    def tenant_usage(self) -> tuple[list[dict], int]:
        """The tenant rows ``--status`` and the metrics show, and how many more there are. Where the service's L3 keeps
        bytes per owner tag (a file store with tenant bounds), a tenant's row has ``l3_bytes``: what the store held of
        its objects at its last sweep, plus what this service wrote since."""
        rows, more = self.index.tenants.usage(namespace_label)
        held = self.storage.tag_bytes() if self.storage is not None else None
        if held is not None:
            for row in rows:
                if row["tenant"] not in WORDS:
                    row["l3_bytes"] = held.get(l3_tag(owner_id(row["tenant"])), 0)
        return rows, more

    def engines(self) -> list[dict]:
        """The per-engine view: each attached session's process, namespace (as :func:`namespace_label` shows it),
        the share it asked for (None: the region) against the region, and the pages it holds, writes and was offered."""
        out = []
        for conn in self.sessions.attached.values():
            c = self.index.clients[conn.id]
            share = self.region.num_pages if conn.share is None else conn.share
            out.append({"client": conn.id, "pid": conn.pid, "namespace": namespace_label(conn.namespace), "share_pages": share,
                        "share_short_pages": max(0, share - self.region.num_pages), "held": len(c.held), "leased": len(c.writing),
                        "hit_pages": c.hit_pages})
        return out

    def _closed(self, conn: Connection) -> None:
        """``conn`` was dropped: what it held is released now, or kept as an orphan while its process lives."""
        self._deferred.discard(conn)
        self.sessions.closed(conn)

    def close(self) -> None:
        """Stop accepting (and serving metrics), close every connection, let the L3 saves under way finish (at
        most ``drain_timeout_s``), then remove the socket file and the region."""
        if self.metrics is not None:
            self.metrics.close()
        if self.index is not None:
            # (the sessions ended now are of live engines whose copies may still be landing: their pages' records stay
            # WRITING, so the next service on a kept region parks them -- cleared, it handed them out while those copies
            # wrote, and an engine that had not yet seen this service go read another's bytes as its own: the soak's find)
            self.index.watcher = None
        self.connections.close()
        self.sessions.end_all()
        self._sel.close()
        if self.storage is not None:
            self._close_storage()
        try:
            os.unlink(self.config.socket)
        except FileNotFoundError:
            pass
        if self.records is not None:
            self.records.close()
        if self.region is not None and not self.config.keep_region:
            remove_region(self.region)
        elif self.region is not None:
            try:
                write_format(self.region, self.config.socket, self.gid, kept=True)
                log.info("left the region %s for the next service on %s to adopt (--keep-region)", self.region.path, self.config.socket)
            except OSError as e:  # (its directory removed under the service: nothing to keep)
                log.warning("could not keep the region %s for the next service (%s)", self.region.path, e)
            release_region(self.region)

    def _close_storage(self) -> None:
        drained = self.storage.close(self.config.drain_timeout_s)
        c = self.storage.counters
        log.log(logging.INFO if drained else logging.WARNING, "L3 %s: %d pages saved, %d failed%s", self.storage.status()["url"],
                c.saved_pages, c.save_failed_pages, "" if drained else f"; saves still under way after {self.config.drain_timeout_s:g} s "
                "were dropped")



def _same_pages(fmt: RegionFormat, region: RegionFormat) -> bool:
    """Whether an engine of ``fmt`` may use a region of ``region``'s pages: the same format, and where both say how their
    rows are objects, the same rows (rows framed otherwise -- another page size -- would have this engine's objects
    saved as the region's first engine frames them)."""
    return fmt == region and (fmt.rows is None or region.rows is None or fmt.rows == region.rows)

check_handlers(NodeService)
