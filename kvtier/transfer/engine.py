"""Asynchronous page movement: one worker, handlers keyed by ``(src_medium, dst_medium)``.

Contract:

* Submitting returns a :class:`TransferJob` at once; the bytes move on a worker
  thread, in submission order (FIFO), so a load queued after a backup of the
  same host page reads the finished backup.
* Loads signal each layer as it lands: ``wait_layer(i)`` returns once every
  buffer of layer ``i`` is on the device, before layer ``i+1`` is copied, so
  attention of layer ``i`` overlaps the rest of the load.
* On CUDA, copies run on a dedicated stream and each layer records a CUDA
  event; ``wait_layer`` makes the *current stream* wait on it (no host stall)
  and ``wait`` synchronises. On CPU the worker thread sets a threading event per
  layer. The API is the same.
* Finished jobs are collected with :meth:`take_finished` by the one thread
  that owns the cache bookkeeping; the worker never touches bookkeeping.
* A device->host job may be *layered* (``submit(..., layered=True)``): it copies
  layer ``i`` only once the caller says layer ``i`` is written
  (:meth:`TransferEngine.release_layer`; :meth:`TransferEngine.release_rest` for
  every layer not released yet), so saving the pages an engine computes in this
  forward overlaps its remaining layers. Each released layer is queued as a
  piece of its own (FIFO with everything else), so a job waiting for its next
  layer never holds up the worker. On CUDA the release records an event on the
  caller's current stream, and the copy stream waits on it before reading.
* A job that fails records its exception (``job.error``) and is still finished;
  nothing is retried here.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.core.plans import Tier
from kvtier.jobs import JobWorker
from kvtier.transfer.backends import IOBackend, get_io_backend
from kvtier.transfer.ops import backup_pages_all_layers, backup_pages_one_layer, load_pages_one_layer

log = logging.getLogger(__name__)




@dataclass(eq=False)
class TransferJob:
    job_id: int
    src: Tier
    dst: Tier
    src_pages: torch.Tensor
    dst_pages: torch.Tensor
    num_layers: int
    tag: object = None
    layer_ready: list[threading.Event] = field(default_factory=list)
    cuda_events: list = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    #: a layered job: 1 per layer once released (see TransferEngine.release_layer); None otherwise
    released: bytearray | None = None
    #: a layered job: layers not copied (or skipped after an error) yet
    layers_left: int = 0
    #: a layered job's copy plan, made by its first piece and reused by the others
    copy_plan: object = None

    @property
    def num_pages(self) -> int:
        return len(self.src_pages)

    def wait_layer(self, layer: int) -> None:
        """Block until layer ``layer`` of a load is usable (CUDA: ordered on the current stream)."""
        if self.layer_ready:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(self.layer_ready):
                from kvtier.errors import PageIndexError

                raise PageIndexError(f"wait_layer({layer!r}): a load has layers 0..{len(self.layer_ready) - 1}")
            self.layer_ready[layer].wait()
            if self.cuda_events:
                torch.cuda.current_stream().wait_event(self.cuda_events[layer])
        else:
            self.finished.wait()
        if self.error is not None:
            raise self.error

    def wait(self) -> None:
        self.finished.wait()
        if self.cuda_events:
            self.cuda_events[-1].synchronize()
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return self.finished.is_set()


#: handler(engine, job, layer_done) moves a job's bytes; layer_done(i) after each layer for loads.
Handler = Callable[["TransferEngine", TransferJob, Callable[[int], None]], None]


def _device_to_host(engine: TransferEngine, job: TransferJob, layer_done: Callable[[int], None]) -> None:
    backup_pages_all_layers(engine.host, engine.device, job.dst_pages, job.src_pages, engine.backend)


def _host_to_device(engine: TransferEngine, job: TransferJob, layer_done: Callable[[int], None]) -> None:
    plan = engine.backend.transfer_plan(engine.host, engine.device, job.src_pages, job.dst_pages)
    for layer in range(job.num_layers):
        load_pages_one_layer(engine.host, engine.device, job.src_pages, job.dst_pages, layer, engine.backend, plan)
        layer_done(layer)



def _name(tier: object) -> str:
    """A tier as messages name it (``host``); anything else as it is (a caller's wrong value)."""
    return tier.name.lower() if isinstance(tier, Tier) else repr(tier)

class TransferEngine:
    def __init__(self, host_pool, device_pool, io_backend: str | IOBackend = "direct", *, name: str = "kvtier-transfer"):
        self.host = host_pool
        self.device = device_pool
        self.backend = get_io_backend(io_backend).configured()  # (its settings read once: a bad one fails here)
        self.num_layers = host_pool.spec.num_layers
        self.backend.check_runs_on(device_pool.device)
        self.cuda = device_pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(device_pool.device) if self.cuda else None
        self.handlers: dict[tuple[Tier, Tier], Handler] = {}
        self.register_handler(Tier.DEVICE, Tier.HOST, _device_to_host)
        self.register_handler(Tier.HOST, Tier.DEVICE, _host_to_device)
        self._ids = itertools.count(1)
        self._finished: queue.SimpleQueue[TransferJob] = queue.SimpleQueue()
        self._closed = False
        #: layered jobs with layers not released yet (close() releases them); like submit and release,
        #: touched only by the thread that owns the engine
        self._layered: dict[int, TransferJob] = {}
        #: seconds the worker spent moving bytes, per (src, dst): bytes / busy = achieved GB/s
        self.busy_s: dict[tuple[Tier, Tier], float] = {}
        #: jobs, and released layers of layered jobs, run in order
        self._worker = JobWorker(self._run, name=name)

    def register_handler(self, src: Tier, dst: Tier, handler: Handler) -> None:
        self.handlers[(src, dst)] = handler

    # ---- submission ----------------------------------------------------------------
    def submit(self, src: Tier, dst: Tier, src_pages: list[int] | torch.Tensor, dst_pages: list[int] | torch.Tensor, tag: object = None,
               *, layered: bool = False) -> TransferJob:
        from kvtier.errors import InvalidStateError, UnknownNameError

        if self._closed:
            raise InvalidStateError("transfer engine is closed")
        if (src, dst) not in self.handlers:
            raise UnknownNameError("transfer direction", f"{_name(src)}->{_name(dst)}",
                                   [f"{_name(a)}->{_name(b)}" for a, b in self.handlers])
        if layered and (src, dst) != (Tier.DEVICE, Tier.HOST):
            raise InvalidStateError(f"a layered job copies device pages out as their layers are written; "
                                    f"{_name(src)}->{_name(dst)} cannot be layered")
        src_t, dst_t = self._checked(src, src_pages), self._checked(dst, dst_pages)
        if src_t.numel() != dst_t.numel():
            from kvtier.errors import PageAlignmentError

            raise PageAlignmentError(
                f"{_name(src)}->{_name(dst)} transfer: {src_t.numel()} source pages but {dst_t.numel()} destination pages; "
                "pass one destination page per source page"
            )
        job = TransferJob(next(self._ids), src, dst, src_t, dst_t, self.num_layers, tag)
        if dst is Tier.DEVICE or layered:
            job.layer_ready = [threading.Event() for _ in range(self.num_layers)]
        if layered:
            job.released = bytearray(self.num_layers)
            job.layers_left = self.num_layers
            self._layered[job.job_id] = job
        else:
            self._worker.put(job)
        return job

    def release_layer(self, job: TransferJob, layer: int) -> None:
        """Layer ``layer`` of a layered job's source pages is written: queue its copy (once; a repeat is ignored)."""
        from kvtier.errors import InvalidStateError, PageIndexError

        if job.released is None:
            raise InvalidStateError(f"release_layer on job {job.job_id}, which is not layered (submit it with layered=True)")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise PageIndexError(f"release_layer({layer!r}): a job has layers 0..{self.num_layers - 1}")
        if job.released[layer]:
            return
        job.released[layer] = 1
        if 0 not in job.released:
            self._layered.pop(job.job_id, None)
        ready = None
        if self.cuda:  # the copy stream reads the layer only after the caller's stream wrote it
            ready = torch.cuda.Event()
            ready.record()
        self._worker.put((job, layer, ready))

    def release_rest(self, job: TransferJob) -> None:
        """Every layer of a layered job not released yet is written: queue their copies."""
        if job.released is None:
            return
        for layer in range(self.num_layers):
            if not job.released[layer]:
                self.release_layer(job, layer)

    def _checked(self, medium: Tier, pages) -> torch.Tensor:
        """Whole request validated before it is queued: a bad page must not fail after others moved."""
        from kvtier.pages import checked_pages

        pool = self.host if medium is Tier.HOST else self.device
        return checked_pages(pages, pool.num_pages, pool=pool.name, side=medium)

    def load(self, host_pages, device_pages, tag: object = None) -> TransferJob:
        return self.submit(Tier.HOST, Tier.DEVICE, host_pages, device_pages, tag)

    def backup(self, device_pages, host_pages, tag: object = None) -> TransferJob:
        return self.submit(Tier.DEVICE, Tier.HOST, device_pages, host_pages, tag)

    def take_finished(self) -> list[TransferJob]:
        out = []
        while True:
            try:
                out.append(self._finished.get_nowait())
            except queue.Empty:
                return out

    # ---- worker --------------------------------------------------------------------
    def _run(self, job: TransferJob | tuple) -> None:
        if type(job) is tuple:
            self._execute_layer(*job)
        else:
            self._execute(job)

    def _execute_layer(self, job: TransferJob, layer: int, ready) -> None:
        """One released layer of a layered device->host job; the last one finishes the job."""
        t0 = time.perf_counter()
        try:
            if job.error is None:  # after a failed layer the rest are not copied
                if job.copy_plan is None:
                    job.copy_plan = self.backend.transfer_plan(self.device, self.host, job.src_pages, job.dst_pages)
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        if ready is not None:
                            self.stream.wait_event(ready)
                        backup_pages_one_layer(self.host, self.device, job.dst_pages, job.src_pages, layer, self.backend, job.copy_plan)
                else:
                    backup_pages_one_layer(self.host, self.device, job.dst_pages, job.src_pages, layer, self.backend, job.copy_plan)
        except BaseException as e:
            log.warning("transfer job %s (device->host, %s pages) failed at layer %d: %s", job.job_id, job.num_pages, layer, e)
            job.error = e
        job.layer_ready[layer].set()
        job.layers_left -= 1
        last = job.layers_left == 0
        if last and self.cuda and job.error is None:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            job.cuda_events.append(ev)
            ev.synchronize()
        self._busy(job, t0)
        if last:
            self._finish(job)

    def _execute(self, job: TransferJob) -> None:
        def layer_done(i: int) -> None:
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record(self.stream)
                job.cuda_events.append(ev)
            job.layer_ready[i].set()

        t0 = time.perf_counter()
        try:
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    self.handlers[(job.src, job.dst)](self, job, layer_done)
                    if not job.cuda_events:
                        ev = torch.cuda.Event()
                        ev.record(self.stream)
                        job.cuda_events.append(ev)
                job.cuda_events[-1].synchronize()
            else:
                self.handlers[(job.src, job.dst)](self, job, layer_done)
        except BaseException as e:  # recorded for the owner; the worker keeps serving
            log.warning("transfer job %s (%s->%s, %s pages) failed: %s", job.job_id, _name(job.src), _name(job.dst), job.num_pages, e)
            job.error = e
        finally:
            self._busy(job, t0)
            for ev in job.layer_ready:
                ev.set()
            self._finish(job)

    def _busy(self, job: TransferJob, since: float) -> None:
        key = (job.src, job.dst)
        self.busy_s[key] = self.busy_s.get(key, 0.0) + time.perf_counter() - since

    def _finish(self, job: TransferJob) -> None:
        self._finished.put(job)  # before finished.set(): a waiter that then polls must see the job
        job.finished.set()

    def drain(self) -> None:
        """Block until every queued job has finished (of a layered job: the layers released so far)."""
        self._worker.wait_idle()

    def close(self) -> None:
        """Finish queued jobs, then stop the worker. Idempotent."""
        if self._closed:
            return
        for job in list(self._layered.values()):  # their waiters must not hang: copy what the caller never released
            self.release_rest(job)
        self._closed = True
        self._worker.stop()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
