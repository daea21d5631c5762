"""Plans that follow other plans: ``Transfer.after``, run by a wrapper around any executor.

A core whose executor runs in another process cannot wait for one plan
before planning the next (a scheduler hands a whole step's plans to its
workers at once), so it names the order instead: a plan with ``after=op``
starts when plan ``op`` finished, and what it does depends on how that went:

* a copy out of host pages that a storage fetch fills (L3 -> host -> engine
  blocks) copies only the pages that arrived, in order, and completes
  :class:`CutShort` at the first page that did not (with the fetch's reason);
  one that carries a hybrid model's objects (read for its end boundary) copies
  all of it or nothing (``CutShort`` at 0);
* any other plan (a save after the copy that fills its host pages) runs only
  if the plan it follows completed in full, else completes
  :class:`Failed` (``Reason.SKIPPED``) without touching a byte.

:class:`ChainedExecutor` does this in front of any :class:`ExecutorPort`; the
executor behind it never sees ``after``. Completions still come back exactly
once each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from kvtier.core.plans import Completion, CutShort, Done, Failed, Reason, Tier, Transfer, completed_pages, plan_shape_error, refused
from kvtier.core.port import ExecutorPort


class ChainedExecutor:
    def __init__(self, inner: ExecutorPort):
        self.inner = inner
        self.has_storage = inner.has_storage
        self.can_wait = inner.can_wait
        #: plans submitted and not yet complete (a later plan may follow them)
        self._plans: dict[int, Transfer] = {}
        #: op -> plans waiting for it
        self._held: dict[int, list[Transfer]] = {}
        #: outcomes of finished plans a held plan may still name (dropped once nothing can follow them)
        self._outcome: dict[int, Completion] = {}
        #: copies cut to the pages a fetch delivered: op -> (pages, reason)
        self._cut: dict[int, tuple[int, Reason]] = {}
        self._out: list[Completion] = []
        #: plans whose completion must come back Failed, whatever it is (see :meth:`abandon`)
        self._abandoned: dict[int, str] = {}

    # ---- submission ------------------------------------------------------------------------
    def submit(self, plan: Transfer, *, layered: bool = False) -> None:
        """``layered``: see :meth:`LocalExecutor.submit` (only for a plan that follows none)."""
        why = plan_shape_error(plan)  # (its pages are checked where the pools are)
        if why is not None:
            self._out.append(refused(plan, why))
            return
        if layered:
            if plan.after:
                self._out.append(Failed(plan.op, Reason.ERROR, "a layered copy cannot follow another plan"))
                return
            self._start(plan, layered=True)
            return
        if plan.after:
            parent = self._plans.get(plan.after)
            if parent is not None and plan.after not in self._outcome:
                self._held.setdefault(plan.after, []).append(plan)
                return
            if plan.after in self._outcome:
                self._release(plan, self._plans[plan.after], self._outcome[plan.after])
                return
            self._out.append(Failed(plan.op, Reason.ERROR, f"plan {plan.after} it follows is unknown to this executor"))
            return
        self._start(plan)

    def _start(self, plan: Transfer, layered: bool = False) -> None:
        self._plans[plan.op] = plan
        if layered:
            self.inner.submit(plan, layered=True)
        else:
            self.inner.submit(dataclasses.replace(plan, after=0) if plan.after else plan)

    def _release(self, plan: Transfer, parent: Transfer, outcome: Completion) -> None:
        """``plan`` may start now that ``parent`` finished with ``outcome``."""
        fetch_fills = parent.src is Tier.STORAGE and parent.dst is Tier.HOST and plan.src is Tier.HOST
        if fetch_fills:
            arrived = completed_pages(outcome, parent.num_pages)
            lost = set(parent.dst_pages[arrived:])
            keep = next((i for i, p in enumerate(plan.src_pages) if p in lost), plan.num_pages)
            if keep < plan.num_pages and plan.groups:  # a hybrid copy reads its objects for its end boundary: whole or nothing
                keep = 0
            if keep < plan.num_pages:
                reason = outcome.reason if type(outcome) is not Done else Reason.ERROR
                if keep == 0:
                    self._out.append(CutShort(plan.op, 0, reason))
                    self._plans[plan.op] = plan
                    self._outcome[plan.op] = self._out[-1]
                    self._release_held(plan.op)
                    return
                self._cut[plan.op] = (keep, reason)
                plan = dataclasses.replace(plan, src_pages=plan.src_pages[:keep], dst_pages=plan.dst_pages[:keep],
                                           keys=plan.keys[:keep] if plan.keys else ())
            self._start(plan)
            return
        if type(outcome) is not Done:
            failed = Failed(plan.op, Reason.SKIPPED, f"plan {parent.op} it follows did not complete")
            self._out.append(failed)
            self._plans[plan.op] = plan
            self._outcome[plan.op] = failed
            self._release_held(plan.op)
            return
        self._start(plan)

    def _release_held(self, op: int) -> None:
        for plan in self._held.pop(op, []):
            self._release(plan, self._plans[op], self._outcome[op])

    # ---- completions -----------------------------------------------------------------------
    def abandon(self, op: int, why: str) -> None:
        """Whatever ``op`` does from now on does not count: its completion comes back ``Failed`` (so
        nothing that follows it runs). A copy out of blocks the engine took back uses this: its
        bytes may no longer be the pages'."""
        if op in self._plans and op not in self._outcome:
            self._abandoned[op] = why

    def _collect(self, done: list[Completion]) -> None:
        for c in done:
            why = self._abandoned.pop(c.op, None)
            if why is not None:
                c = Failed(c.op, Reason.ERROR, why)
            cut = self._cut.pop(c.op, None)
            if cut is not None and type(c) is Done:
                c = CutShort(c.op, cut[0], cut[1])
            self._out.append(c)
            self._outcome[c.op] = c
            self._release_held(c.op)

    def _take(self) -> list[Completion]:
        out, self._out = self._out, []
        for c in out:  # nothing can follow a plan once its completion is handed out and nothing waits on it
            if c.op not in self._held:
                self._plans.pop(c.op, None)
                self._outcome.pop(c.op, None)
        return out

    def poll(self) -> list[Completion]:
        self._collect(self.inner.poll())
        return self._take()

    def _held_op(self, op: int) -> int | None:
        """The plan ``op`` waits for, when it has not started yet."""
        for parent, plans in self._held.items():
            if any(p.op == op for p in plans):
                return parent
        return None

    def wait(self, ops: Collection[int]) -> list[Completion]:
        pending = set(ops)
        while True:
            self._collect(self.inner.poll())
            pending -= {c.op for c in self._out}
            # what is still running here, or waiting for the plan it follows
            parents = {op: self._held_op(op) for op in pending}
            pending = {op for op in pending if op in self._plans or parents[op] is not None}
            if not pending:
                return self._take()
            self._collect(self.inner.wait([parents[op] if parents[op] is not None else op for op in pending]))

    def settle(self, op: int, policy: str, budget_s: float) -> int:
        return self.inner.settle(op, policy, budget_s)

    def wait_layer(self, op: int, layer: int, group: str | None = None) -> None:
        parent = self._held_op(op)
        while parent is not None:  # not started yet: its fetch decides what it copies
            self._collect(self.inner.wait([parent]))
            parent = self._held_op(op)
        if op in self._plans and op not in self._outcome:
            if group is None:
                self.inner.wait_layer(op, layer)
            else:
                self.inner.wait_layer(op, layer, group)

    def release_layer(self, op: int, layer: int, group: str | None = None) -> None:
        if group is None:
            self.inner.release_layer(op, layer)
        else:
            self.inner.release_layer(op, layer, group)

    def release_rest(self, op: int) -> None:
        self.inner.release_rest(op)

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        return self.inner.stored_prefix(keys)

    def close(self) -> None:
        self.inner.close()
