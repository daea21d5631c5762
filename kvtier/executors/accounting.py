"""An executor with no bytes: what ``kvtier plan`` runs the policy core on.

Copies between device and host complete as soon as they are planned. Storage
is an :class:`AccountingStore`: a bounded LRU set of page keys, shared by every
node's executor as one L3 is shared by a cluster. It behaves as the
``memory://`` backend does under the storage tier, batch for batch: a save
skips the leading keys already held and inserts the rest in batches, evicting
the least recently used keys after each batch; a fetch reads batch by batch
(every present key of a batch is touched) and stops at the first missing key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvtier.core.plans import STORAGE, Completion, CutShort, Done, Reason, Transfer


class AccountingStore:
    def __init__(self, max_objects: int | None = None, batch_pages: int = 8):
        self.max_objects = max_objects
        self.batch_pages = batch_pages
        self.keys: OrderedDict[bytes, None] = OrderedDict()
        self.evicted = 0

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        held = self.keys
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def save(self, keys: Sequence[bytes]) -> int:
        """Store ``keys``; returns how many leading keys were held already."""
        have = self.stored_prefix(keys)
        held, cap, step = self.keys, self.max_objects, self.batch_pages
        to_end = held.move_to_end
        for start in range(have, len(keys), step):
            for k in keys[start : start + step]:
                held[k] = None
                to_end(k)  # a key held already becomes the most recent
            if cap is not None:
                while len(held) > cap:
                    held.popitem(last=False)
                    self.evicted += 1
        return have

    def fetch(self, keys: Sequence[bytes]) -> int:
        """Leading keys present (each present key of a batch read is touched)."""
        held, step = self.keys, self.batch_pages
        arrived = 0
        for start in range(0, len(keys), step):
            missed = False
            for k in keys[start : start + step]:
                if k in held:
                    held.move_to_end(k)
                    if not missed:
                        arrived += 1
                else:
                    missed = True
            if missed:
                break
        return arrived


class AccountingExecutor:
    """Completes every plan at once; ``store`` (shared or own) accounts L3 keys, ``None``: no L3."""

    def __init__(self, store: AccountingStore | None = None):
        self.store = store
        self.has_storage = store is not None
        self.can_wait = True
        self._done: list[Completion] = []
        #: fetches answered at submission: op -> pages arrived (read by :meth:`settle`)
        self._arrived: dict[int, int] = {}

    def submit(self, plan: Transfer) -> None:
        if plan.dst is STORAGE:
            existing = self.store.save(plan.keys)
            for run in plan.groups:  # a hybrid model's objects, under their own keys
                self.store.save(run.keys)
            self._done.append(Done(plan.op, existing))
        elif plan.src is STORAGE:
            n = self.store.fetch(plan.keys)
            for run in plan.groups:  # a page counts as arrived once its objects did too
                got = self.store.fetch(run.keys)
                if got < len(run.keys):
                    n = min(n, run.at[got])
            self._arrived[plan.op] = n
            self._done.append(Done(plan.op) if n == len(plan.keys) else CutShort(plan.op, n, Reason.MISS))
        else:
            self._done.append(Done(plan.op))

    def poll(self) -> list[Completion]:
        done, self._done = self._done, []
        if self._arrived:
            self._arrived.clear()
        return done

    def wait(self, ops: Collection[int]) -> list[Completion]:
        return self.poll()

    def settle(self, op: int, policy: str, budget_s: float) -> int:
        return self._arrived.get(op, 0)

    def wait_layer(self, op: int, layer: int) -> None:
        pass

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        return self.store.stored_prefix(keys) if self.store is not None else 0

    def close(self) -> None:
        pass
