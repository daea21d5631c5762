"""Run plans in this process: device<->host on a TransferEngine, host<->storage on a StorageTier.

It keeps one job per plan in flight, by the plan's op, and turns each finished
job into a typed completion. It never decides anything: which pages, which
keys and what a failure means for the cache are the core's business.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvtier.core.plans import Completion, CutShort, Done, Failed, Reason, Tier, Transfer, plan_error, refused
from kvtier.l3.base import KeyStatus
from kvtier.l3.tier import StorageJob, StorageTier
from kvtier.transfer.engine import TransferEngine, TransferJob

_MEDIUM = {Tier.DEVICE: "device", Tier.HOST: "host"}


class LocalExecutor:
    def __init__(self, engine: TransferEngine, storage: StorageTier | None = None):
        self.engine = engine
        self.storage = storage
        self.has_storage = storage is not None
        self.can_wait = True
        self._device_pages = engine.device.num_pages
        self._host_pages = engine.host.num_pages
        self._jobs: dict[int, TransferJob | StorageJob] = {}
        #: completions decided at submission (a plan that could not start)
        self._ready: list[Completion] = []

    def submit(self, plan: Transfer, *, layered: bool = False) -> None:
        """Start ``plan``; one that names what it cannot (:func:`~kvtier.core.plans.plan_error`: a page
        outside its pool, a non-integer page, mismatched lengths) completes as ``Failed(INVALID)``
        before any byte moves, and one the engine or tier refuses as ``Failed(ERROR)``, as it would
        across a pipe -- the core's bookkeeping never sees an exception mid-decision.

        ``layered`` (a copy out of device pages an engine is computing now): each layer
        is copied once :meth:`release_layer` says it is written (:meth:`release_rest`: all)."""
        why = plan_error(plan, self._device_pages, self._host_pages)
        if why is not None:  # before any byte moves, whatever sent it
            self._ready.append(refused(plan, why))
            return
        try:
            self._start(plan, layered)
        except Exception as e:
            self._ready.append(Failed(plan.op, Reason.ERROR, f"{type(e).__name__}: {e}"))

    def _start(self, plan: Transfer, layered: bool = False) -> None:
        if plan.src is Tier.STORAGE or plan.dst is Tier.STORAGE:
            job = None
            if self.storage is not None:
                kind = "save" if plan.dst is Tier.STORAGE else "prefetch"
                job = self.storage.submit(kind, list(plan.keys), list(plan.host_pages), tag=plan.op)
            if job is None:
                self._ready.append(Failed(plan.op, Reason.SKIPPED, "storage queue full" if self.storage is not None else "no storage tier"))
                return
        else:
            job = self.engine.submit(_MEDIUM[plan.src], _MEDIUM[plan.dst], list(plan.src_pages), list(plan.dst_pages), tag=plan.op,
                                     layered=layered)
        self._jobs[plan.op] = job

    def poll(self) -> list[Completion]:
        out, self._ready = self._ready, []
        jobs = self._jobs
        for job in self.engine.take_finished():
            if jobs.pop(job.tag, None) is not None:
                out.append(Done(job.tag) if job.error is None else Failed(job.tag, Reason.ERROR, repr(job.error)))
        if self.storage is not None:
            for sjob in self.storage.take_finished():
                if jobs.pop(sjob.tag, None) is not None:
                    out.append(storage_completion(sjob))
        return out

    def wait(self, ops: Collection[int]) -> list[Completion]:
        for op in ops:
            job = self._jobs.get(op)
            if job is not None:
                job.finished.wait()
        return self.poll()

    def settle(self, op: int, policy: str, budget_s: float) -> int:
        job = self._jobs.get(op)
        if job is None:
            return 0
        job.settle(policy, budget_s)
        return job.arrived

    def wait_layer(self, op: int, layer: int) -> None:
        job = self._jobs.get(op)
        if job is not None:
            job.wait_layer(layer)

    def release_layer(self, op: int, layer: int) -> None:
        """Layer ``layer`` of a layered plan's device pages is written: its copy may start."""
        job = self._jobs.get(op)
        if isinstance(job, TransferJob) and job.released is not None:
            self.engine.release_layer(job, layer)

    def release_rest(self, op: int) -> None:
        """Every layer of a layered plan is written: the copies not started yet may start."""
        job = self._jobs.get(op)
        if isinstance(job, TransferJob):
            self.engine.release_rest(job)

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        return self.storage.stored_prefix(list(keys)) if self.storage is not None else 0

    def run(self, fn, *args):
        """``fn(self, *args)``: an engine's worker-side step next to the bytes (as :class:`PipeExecutor` offers)."""
        return fn(self, *args)

    def close(self) -> None:
        self.engine.close()
        if self.storage is not None:
            self.storage.close()


def storage_completion(job: StorageJob) -> Completion:
    """A finished storage job as a completion: the leading pages that succeeded, and why the rest did not."""
    n = len(job.keys)
    if job.kind == "prefetch":
        done = job.arrived
    else:
        done = 0
        for st in job.statuses:
            if st is not KeyStatus.OK:
                break
            done += 1
    if done == n:
        return Done(job.tag, job.skipped_existing)
    statuses = job.statuses
    if job.corrupt:  # (a corrupt page's status is ERROR too)
        reason = Reason.CORRUPT
    elif KeyStatus.ERROR in statuses:
        reason = Reason.ERROR
    elif KeyStatus.MISS in statuses:
        reason = Reason.MISS
    elif job.cancelled:
        reason = Reason.CANCELLED
    else:
        reason = Reason.ERROR
    return CutShort(job.tag, done, reason, job.corrupt, job.skipped_existing)
