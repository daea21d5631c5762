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

from kvtier.core.plans import (Completion, CutShort, Done, Failed, GroupRun, Reason, Tier, Transfer, completed_pages, plan_error,
                                pools_written, refused)
from kvtier.l3.base import KeyStatus
from kvtier.l3.tier import StorageJob, StorageTier
from kvtier.transfer.engine import TransferEngine, TransferJob

class LocalExecutor:
    def __init__(self, engine: TransferEngine, storage: StorageTier | None = None, groups: dict[str, TransferEngine] | None = None,
                 group_storage: dict[str, StorageTier] | None = None):
        self.engine = engine
        self.storage = storage
        self.groups = dict(groups or {})
        self.group_storage = dict(group_storage or {})
        self.has_storage = storage is not None
        self.can_wait = True
        self._device_pages = engine.device.num_pages
        #: which pools each group writes (its own, or the full pages' it shares): a plan writes each id of a pool once
        self._group_pools = pools_written((engine.device, engine.host), {name: (e.device, e.host) for name, e in self.groups.items()})
        self._jobs: dict[int, TransferJob | StorageJob] = {}
        #: a plan's group objects, moving as jobs of their own: op -> (run, its job or None if it could not start)
        self._parts: dict[int, list[tuple[GroupRun, TransferJob | StorageJob | None]]] = {}
        #: plans whose pages' job finished while group objects may still be moving: op -> that job
        self._main_done: dict[int, TransferJob | StorageJob] = {}
        #: completions decided at submission (a plan that could not start)
        self._ready: list[Completion] = []

    def submit(self, plan: Transfer, *, layered: bool = False) -> None:
        """Start ``plan``; one that names what it cannot (:func:`~kvtier.core.plans.plan_error`: a page
        outside its pool, a non-integer page, mismatched lengths, one destination written twice -- by its
        pages and a group sharing their pools, or by two group runs) completes as ``Failed(INVALID)``
        before any byte moves, and one the engine or tier refuses as ``Failed(ERROR)``, as it would
        across a pipe -- the core's bookkeeping never sees an exception mid-decision.

        ``layered`` (a copy out of device pages an engine is computing now): each layer
        is copied once :meth:`release_layer` says it is written (:meth:`release_rest`: all)."""
        # (host pools' sizes read now: a node service's region, pages and object pools alike, is mapped anew -- maybe of another
        # size -- when its engine attaches again, or for the first time after starting without it)
        group_pages = {name: (e.device.num_pages, e.host.num_pages) for name, e in self.groups.items()}
        why = plan_error(plan, self._device_pages, self.engine.host.num_pages, group_pages, self.group_storage, self._group_pools)
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
                job = self.storage.submit(kind, list(plan.keys), list(plan.host_pages), tag=plan.op, owners=list(plan.owners))
            if job is None:
                self._ready.append(Failed(plan.op, Reason.SKIPPED, "storage queue full" if self.storage is not None else "no storage tier"))
                return
            owners = plan.owners  # (a group's objects: their page's owner)
            parts = [(run, self.group_storage[run.group].submit(kind, list(run.keys), list(run.src_pages or run.dst_pages), tag=plan.op,
                                                                owners=[owners[i] for i in run.at] if owners else None))
                     for run in plan.groups]
        else:
            src, dst = plan.src, plan.dst
            # (a layered copy out: each group's objects are copied as that group's layers are written, release_layer)
            parts = [(run, self.groups[run.group].submit(src, dst, list(run.src_pages), list(run.dst_pages), tag=plan.op, layered=layered))
                     for run in plan.groups]
            if not plan.src_pages:  # objects alone: the plan completes with them
                self._parts[plan.op] = parts
                self._main_done[plan.op] = None
                return
            job = self.engine.submit(src, dst, list(plan.src_pages), list(plan.dst_pages), tag=plan.op, layered=layered)
        if parts:
            self._parts[plan.op] = parts
        self._jobs[plan.op] = job

    def poll(self) -> list[Completion]:
        out, self._ready = self._ready, []
        jobs, parts = self._jobs, self._parts
        for mover in [*self.groups.values(), *self.group_storage.values()]:
            mover.take_finished()  # (a plan's group jobs are read through their own finished flags)
        finished: list[TransferJob | StorageJob] = self.engine.take_finished()
        if self.storage is not None:
            finished += self.storage.take_finished()
        for job in finished:
            if jobs.pop(job.tag, None) is None:
                continue
            if job.tag in parts:  # group objects move too: the plan completes with the last of its jobs
                self._main_done[job.tag] = job
            else:
                out.append(storage_completion(job) if isinstance(job, StorageJob) else _copy_completion(job.tag, job.error))
        for op in [op for op in self._main_done if all(j is None or j.finished.is_set() for _, j in parts[op])]:
            out.append(_joined_completion(op, self._main_done.pop(op), parts.pop(op)))
        return out

    def wait(self, ops: Collection[int]) -> list[Completion]:
        for op in ops:
            job = self._jobs.get(op)
            if job is not None:
                job.finished.wait()
            for _, part in self._parts.get(op, ()):
                if part is not None:
                    part.finished.wait()
        return self.poll()

    def settle(self, op: int, policy: str, budget_s: float) -> int:
        # (a fetch whose pages' job finished while its group objects still move waits in _main_done)
        job = self._jobs.get(op) or self._main_done.get(op)
        if job is None:
            return 0
        job.settle(policy, budget_s)
        arrived = job.arrived
        for run, part in self._parts.get(op, ()):  # a page has arrived once its objects have too
            got = 0 if part is None else (part.settle(policy, budget_s), part.arrived)[1]
            if got < len(run.at):
                arrived = min(arrived, run.at[got])
        return arrived

    def wait_layer(self, op: int, layer: int, group: str | None = None) -> None:
        """Layer ``layer`` of a host->device plan's pages (``group``: of that KV group's objects) is in place."""
        job = self._jobs.get(op) if group is None else self._part(op, group)
        if job is not None:
            job.wait_layer(layer)

    def _part(self, op: int, group: str) -> TransferJob | None:
        return next((job for run, job in self._parts.get(op, ()) if run.group == group and isinstance(job, TransferJob)), None)

    def release_layer(self, op: int, layer: int, group: str | None = None) -> None:
        """Layer ``layer`` of a layered plan's device pages (``group``: of that KV group's objects, whose
        layers are its own) is written: its copy may start."""
        job = self._jobs.get(op) if group is None else self._part(op, group)
        if isinstance(job, TransferJob) and job.released is not None:
            (self.engine if group is None else self.groups[group]).release_layer(job, layer)

    def release_rest(self, op: int) -> None:
        """Every layer of a layered plan is written (every group's): the copies not started yet may start."""
        job = self._jobs.get(op)
        if isinstance(job, TransferJob):
            self.engine.release_rest(job)
        for run, part in self._parts.get(op, ()):
            if isinstance(part, TransferJob) and part.released is not None:
                self.groups[run.group].release_rest(part)

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        return self.storage.stored_prefix(list(keys)) if self.storage is not None else 0

    def run(self, fn, *args):
        """``fn(self, *args)``: an engine's worker-side step next to the bytes (as :class:`PipeExecutor` offers)."""
        return fn(self, *args)

    def close(self) -> None:
        self.engine.close()
        for engine in self.groups.values():
            engine.close()
        for tier in self.group_storage.values():
            tier.close()
        if self.storage is not None:
            self.storage.close()


def group_movers(pools: dict[str, tuple[object, object]], io_backend: str, storage: StorageTier | None
                 ) -> tuple[dict[str, TransferEngine], dict[str, StorageTier]]:
    """A hybrid model's other groups' movers over their (device pool, host pool): a transfer engine
    each, and an L3 tier each on ``storage``'s store (none without it)."""
    engines = {name: TransferEngine(host, dev, io_backend, name=f"kvtier-{name}") for name, (dev, host) in pools.items()}
    tiers = {} if storage is None else {name: storage.sharing(host) for name, (_dev, host) in pools.items()}
    return engines, tiers


def _copy_completion(op: int, error: BaseException | str | None) -> Completion:
    return Done(op) if error is None else Failed(op, Reason.ERROR, error if isinstance(error, str) else repr(error))


def _objects_done(job: TransferJob | StorageJob | None) -> int:
    """Leading objects a group's job moved (a copy: all or none)."""
    if job is None:
        return 0
    if isinstance(job, TransferJob):
        return job.num_pages if job.error is None else 0
    return job.arrived if job.kind == "prefetch" else _leading_ok(job.statuses)


def _joined_completion(op: int, main: TransferJob | StorageJob | None,
                       parts: list[tuple[GroupRun, TransferJob | StorageJob | None]]) -> Completion:
    """A plan's completion from its pages' job (None: a plan of objects alone) and its group objects'
    jobs: a page is done once it and every object that moves with it are."""
    if main is None or isinstance(main, TransferJob):
        error = (main.error if main is not None else None) or next((p.error for _, p in parts if p is not None and p.error is not None),
                                                                    None)
        if error is None and any(p is None for _, p in parts):
            error = "a KV group's copy could not start"
        return _copy_completion(op, error)
    base = storage_completion(main)
    n = len(main.keys)
    k = completed_pages(base, n)
    corrupt = base.corrupt if type(base) is CutShort else 0
    group_reason = None
    for run, part in parts:
        got = _objects_done(part)
        if got < len(run.at) and run.at[got] < k:
            k = run.at[got]
            group_reason = Reason.SKIPPED if part is None else storage_completion(part).reason
        corrupt += part.corrupt if part is not None else 0
    if k == n and type(base) is Done:
        return base
    reason = base.reason if type(base) is CutShort and group_reason is None else group_reason or Reason.ERROR
    existing = base.existing if type(base) is not Failed else 0
    return CutShort(op, k, reason, corrupt, existing)


def _leading_ok(statuses: list[KeyStatus]) -> int:
    done = 0
    for st in statuses:
        if st is not KeyStatus.OK:
            break
        done += 1
    return done


def storage_completion(job: StorageJob) -> Completion:
    """A finished storage job as a completion: the leading pages that succeeded, and why the rest did not."""
    n = len(job.keys)
    done = job.arrived if job.kind == "prefetch" else _leading_ok(job.statuses)
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
