"""An executor in another process, driven over a pipe: the core's plans and completions pickled.

The process that owns the policy core holds a :class:`PipeExecutor`; the
process that holds the bytes runs :func:`serve` with a :class:`WorkerSpec`,
builds its own pools, transfer engine and L3 tier there (a
:class:`~kvtier.executors.local.LocalExecutor`) and answers. Nothing but
plans, completions and the answers of the port's queries crosses the pipe.

Plans are one-way (``submit`` does not wait for the other side); queries wait
for their answer under a deadline, and a worker that died is a
:class:`~kvtier.errors.ExecutorError`, never a hang. :meth:`PipeExecutor.run`
runs a picklable function next to the worker's executor (an engine's own
worker-side step; the tests fill and read pages with it).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from kvtier.config import StorageConfig
from kvtier.core.plans import Completion, Transfer
from kvtier.errors import ExecutorError, SpecError
from kvtier.groups import ModelSpec
from kvtier.hashing import Namespace
from kvtier.layout import DEFAULT_HOST_LAYOUT
from kvtier.spec import KVSpec


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process builds: its pools (page ids as the core allocates them) and L3."""

    spec: KVSpec
    device_pages: int
    host_pages: int
    host_layout: str = DEFAULT_HOST_LAYOUT
    device: str = "cpu"
    io_backend: str = "direct"
    storage: StorageConfig = StorageConfig()
    #: the L3 namespace; give the core the same one (both default to ``Namespace("default", fingerprint)``)
    namespace: Namespace | None = None
    #: a hybrid model: its other KV groups' pools, (device objects, host objects) per group name
    model: ModelSpec | None = None
    group_pages: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: groups whose objects live in the full pages' own pools (one budget per tier: their ids are the pages')
    shared_groups: tuple[str, ...] = ()

    def build(self):
        """The worker's :class:`LocalExecutor` (called in the worker's process)."""
        from kvtier.executors.local import LocalExecutor, group_movers
        from kvtier.l3.tier import open_storage_tier
        from kvtier.pools import DevicePool, HostPool
        from kvtier.transfer.engine import TransferEngine

        device = DevicePool(self.spec, self.device_pages, self.device)
        host = HostPool(self.spec, self.host_pages, self.host_layout)
        hybrid = self.model is not None and self.model.is_hybrid
        # the core's default namespace too
        namespace = self.namespace or Namespace("default", (self.model if hybrid else self.spec).fingerprint())
        tier = open_storage_tier(self.storage, host, namespace)
        pools = {name: (DevicePool(self.model.group(name).object_spec(), dev, self.device),
                        HostPool(self.model.group(name).object_spec(), hst, self.host_layout))
                 for name, (dev, hst) in self.group_pages.items()} if self.group_pages else {}
        for name in self.shared_groups:
            if self.model.group(name).object_spec() != self.spec:
                raise SpecError(f"KV group {name!r} shares the full pages' pools, but its objects are not full pages: give it "
                                "group_pages of its own")
            pools[name] = (device, host)
        return LocalExecutor(TransferEngine(host, device, self.io_backend), tier, *group_movers(pools, self.io_backend, tier))


#: what the owner may ask of the worker (``submit`` is one-way)
_CALLS = frozenset({"poll", "wait", "settle", "wait_layer", "stored_prefix", "run", "close"})


def serve(conn, worker: WorkerSpec) -> None:
    """The worker process's loop: build the executor, then answer until ``close``."""
    executor = None
    try:
        executor = worker.build()
        conn.send((0, "ok", executor.has_storage))
    except BaseException as e:  # the owner gets the reason, typed, instead of a dead pipe
        conn.send((0, "error", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the owner is gone
            executor.close()
            return
        seq, name, args = msg if type(msg) is tuple and len(msg) == 3 and type(msg[2]) is tuple else (-1, None, ())
        if name == "submit":  # one-way; a plan the executor refuses (malformed included) comes back Failed from its poll
            if len(args) == 1:
                executor.submit(args[0])
            continue
        try:
            if name not in _CALLS:
                raise ValueError(f"not a call of the executor port: {str(name)[:40]!r}")
            if name == "run":
                fn, fargs = args
                result = fn(executor, *fargs)
            else:
                result = getattr(executor, name)(*args)
            conn.send((seq, "ok", result))
        except BaseException as e:
            conn.send((seq, "error", f"{type(e).__name__}: {e}"))
        if name == "close":
            return


class PipeExecutor:
    """The core's side: an :class:`~kvtier.core.port.ExecutorPort` whose executor runs in a
    spawned process. ``deadline_s`` bounds every query that does not wait on bytes;
    ``wait_deadline_s`` bounds every call that does (a wait, a settle, a layer, a ``run``) -- the
    worker's own L3 calls have deadlines, so only a wedged worker reaches it. A call past its
    deadline is an :class:`ExecutorError`, the worker is stopped and the port stays broken: an
    answer that arrives late must never be read as the answer to a later call."""

    def __init__(self, worker: WorkerSpec, *, deadline_s: float = 60.0, wait_deadline_s: float = 600.0, start_timeout_s: float = 120.0):
        ctx = mp.get_context("spawn")  # the worker imports torch afresh: no forked threads or CUDA state
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(child, worker), name="kvtier-executor", daemon=True)
        self._proc.start()
        child.close()
        self.deadline_s = deadline_s
        self.wait_deadline_s = wait_deadline_s
        self._closed = False
        #: why the port can no longer be used (the worker died, broke the protocol, or a call ran past
        #: its deadline), or None
        self._broken: str | None = None
        #: each call's number; its answer must carry it (an extra or stray message never answers a later call)
        self._seq = 0
        self.has_storage = bool(self._answer("start", start_timeout_s, 0))
        self.can_wait = True

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # ---- the wire --------------------------------------------------------------------
    def _break(self, why: str) -> ExecutorError:
        """The port is unusable from now on: every later call is refused (an answer read out of turn
        would be taken for the wrong call's)."""
        self._broken = why
        return ExecutorError(f"executor process {self._proc.pid}: {why}; the port refuses further work, start a new one")

    def _answer(self, what: str, timeout_s: float | None, seq: int):
        start = time.monotonic()
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                raise self._break(f"exited (code {self._proc.exitcode}) during {what}")
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                self._proc.kill()  # wedged: its late answer must not be taken for another call's
                raise self._break(f"no answer to {what} within {timeout_s:g} s (the worker was stopped)")
        try:
            msg = self._conn.recv()
        except (EOFError, OSError) as e:  # the worker died: its end of the pipe is closed or reset
            raise self._break(f"gone ({type(e).__name__}) during {what}") from None
        except Exception as e:  # not a pickle it can read
            raise self._break(f"sent an unreadable answer to {what} ({type(e).__name__})") from None
        if not (type(msg) is tuple and len(msg) == 3 and msg[0] == seq and msg[1] in ("ok", "error")):
            raise self._break(f"answered {what} (call {seq}) out of protocol with {str(msg)[:80]!r}")
        _seq, status, value = msg
        if status != "ok":
            raise ExecutorError(f"executor process {self._proc.pid}: {what} failed: {value}")
        return value

    def _call(self, name: str, *args, timeout_s: float | None = -1.0):
        if self._closed:
            raise ExecutorError(f"executor port is closed: cannot {name}")
        if self._broken is not None:
            raise ExecutorError(f"executor port is broken ({self._broken}): cannot {name}; start a new one")
        self._seq += 1
        try:
            self._conn.send((self._seq, name, args))
        except (BrokenPipeError, OSError) as e:
            raise self._break(f"gone ({e}); cannot {name}") from None
        return self._answer(name, self.deadline_s if timeout_s == -1.0 else timeout_s, self._seq)

    # ---- the port --------------------------------------------------------------------
    def submit(self, plan: Transfer) -> None:
        if self._closed or self._broken is not None:
            state = "closed" if self._closed else f"broken ({self._broken})"
            raise ExecutorError(f"executor port is {state}: cannot submit plan {plan.op}")
        try:
            self._conn.send((0, "submit", (plan,)))
        except (BrokenPipeError, OSError) as e:
            raise self._break(f"gone ({e}); cannot submit plan {plan.op}") from None

    def poll(self) -> list[Completion]:
        return self._call("poll")

    def wait(self, ops: Collection[int]) -> list[Completion]:
        return self._call("wait", list(ops), timeout_s=self.wait_deadline_s)

    def settle(self, op: int, policy: str, budget_s: float) -> int:
        return self._call(
            "settle", op, policy, budget_s, timeout_s=self.wait_deadline_s if policy == "wait_complete" else self.deadline_s + budget_s
        )

    def wait_layer(self, op: int, layer: int) -> None:
        self._call("wait_layer", op, layer, timeout_s=self.wait_deadline_s)

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        return self._call("stored_prefix", list(keys))

    def run(self, fn: Callable, *args):
        """``fn(executor, *args)`` in the worker's process (``fn`` and its result pickle)."""
        return self._call("run", fn, args, timeout_s=self.wait_deadline_s)

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._proc.is_alive() and self._broken is None:
                self._call("close")
        except ExecutorError:
            pass  # a worker that died has nothing left to finish; the join below reaps it
        finally:
            self._closed = True
            self._conn.close()
            self._proc.join(10.0)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5.0)
