"""Run plans in this process: device<->host on a TransferEngine, host<->storage on a StorageTier.

It keeps one job per plan in flight, by the plan's op, and turns each finished
job into a typed completion. It never decides anything: which pages, which
keys and what a failure means for the cache are the core's business.

A hybrid model's other KV groups (``groups``: a transfer engine over each
group's own device and host pools) ride on the plans that move their pages
(:class:`~kvtier.core.plans.GroupRun`): a plan completes once its pages and
every group's objects are moved, ``Done`` only if all of them were.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvtier.core.plans import Completion, CutShort, Done, Failed, Reason, Tier, Transfer, plan_error, refused
from kvtier.l3.base import KeyStatus
from kvtier.l3.tier import StorageJob, StorageTier
from kvtier.transfer.engine import TransferEngine, TransferJob

_MEDIUM = {Tier.DEVICE: "device", Tier.HOST: "host"}


class LocalExecutor:
    def __init__(self, engine: TransferEngine, storage: StorageTier | None = None, groups: dict[str, TransferEngine] | None = None):
        self.engine = engine
        self.storage = storage
        self.groups = dict(groups or {})
        self.has_storage = storage is not None
        self.can_wait = True
        self._device_pages = engine.device.num_pages
        self._host_pages = engine.host.num_pages
        self._group_pages = {name: (e.device.num_pages, e.host.num_pages) for name, e in self.groups.items()}
        self._jobs: dict[int, TransferJob | StorageJob] = {}
        #: a plan's group objects still moving: op -> their jobs; and the first error among them
        self._parts: dict[int, list[TransferJob]] = {}
        self._part_errors: dict[int, str] = {}
        #: plans whose pages are moved while group objects still are: op -> the pages' error (or None)
        self._main_done: dict[int, str | None] = {}
        #: completions decided at submission (a plan that could not start)
        self._ready: list[Completion] = []

    def submit(self, plan: Transfer, *, layered: bool = False) -> None:
        """Start ``plan``; one that names what it cannot (:func:`~kvtier.core.plans.plan_error`: a page
        outside its pool, a non-integer page, mismatched lengths) completes as ``Failed(INVALID)``
        before any byte moves, and one the engine or tier refuses as ``Failed(ERROR)``, as it would
        across a pipe -- the core's bookkeeping never sees an exception mid-decision.

        ``layered`` (a copy out of device pages an engine is computing now): each layer
        is copied once :meth:`release_layer` says it is written (:meth:`release_rest`: all)."""
        why = plan_error(plan, self._device_pages, self._host_pages, self._group_pages)
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
            src, dst = _MEDIUM[plan.src], _MEDIUM[plan.dst]
            parts = [self.groups[run.group].submit(src, dst, list(run.src_pages), list(run.dst_pages), tag=plan.op) for run in plan.groups]
            job = self.engine.submit(src, dst, list(plan.src_pages), list(plan.dst_pages), tag=plan.op, layered=layered)
            if parts:
                self._parts[plan.op] = parts
        self._jobs[plan.op] = job

    def poll(self) -> list[Completion]:
        out, self._ready = self._ready, []
        jobs = self._jobs
        for engine in self.groups.values():
            for part in engine.take_finished():
                self._part_finished(part, out)
        for job in self.engine.take_finished():
            if jobs.pop(job.tag, None) is not None:
                error = None if job.error is None else repr(job.error)
                if job.tag in self._parts:  # group objects still moving: complete with the last of them
                    self._main_done[job.tag] = error
                else:
                    out.append(self._copy_completion(job.tag, error))
        if self.storage is not None:
            for sjob in self.storage.take_finished():
                if jobs.pop(sjob.tag, None) is not None:
                    out.append(storage_completion(sjob))
        return out

    def _part_finished(self, part: TransferJob, out: list[Completion]) -> None:
        op = part.tag
        parts = self._parts.get(op)
        if parts is None:
            return
        parts.remove(part)
        if part.error is not None:
            self._part_errors.setdefault(op, repr(part.error))
        if not parts:
            del self._parts[op]
            if op in self._main_done:
                out.append(self._copy_completion(op, self._main_done.pop(op)))

    def _copy_completion(self, op: int, error: str | None) -> Completion:
        error = error or self._part_errors.pop(op, None)
        self._part_errors.pop(op, None)
        return Done(op) if error is None else Failed(op, Reason.ERROR, error)

    def wait(self, ops: Collection[int]) -> list[Completion]:
        for op in ops:
            job = self._jobs.get(op)
            if job is not None:
                job.finished.wait()
            for part in list(self._parts.get(op, ())):
                part.finished.wait()
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
        for engine in self.groups.values():
            engine.close()
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
