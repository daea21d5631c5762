"""A policy core with a hybrid model (support.hybrid_models) over an executor that records its plans and
completes them at once (no bytes), and a request that computes a whole prompt and hands its objects over."""

from __future__ import annotations

from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig
from kvtier.core import CacheCore
from kvtier.executors.accounting import AccountingExecutor
from kvtier.groups import ModelSpec
from support.hybrid_models import hybrid_model


class Recorder(AccountingExecutor):
    """Completes every plan at once (no bytes) and keeps it, to read what each plan moved."""

    def __init__(self):
        super().__init__(None)
        self.plans = []

    def submit(self, plan):
        self.plans.append(plan)
        super().submit(plan)


def make(window: int | None, state: bool, *, every: int = 1, dev: int = 16, host: int = 16, objects: int = 16,
         write_policy: str = "write_back") -> tuple[CacheCore, ModelSpec, Recorder]:
    model, full = hybrid_model(window, state)
    pools = {g.name: (PageAllocator(objects, f"{g.name} device"), PageAllocator(objects, f"{g.name} host"))
             for g in model.groups if g.kind != "full"}
    port = Recorder()
    core = CacheCore(full, PageAllocator(dev, "device"), PageAllocator(host, "host"), port, CacheConfig(write_policy=write_policy),
                     model=model, group_pools=pools, state_every=every)
    return core, model, port


def commit_all(core: CacheCore, tokens: list[int], *, windows: list[int] | None = None, snapshots: list[int] | None = None):
    """One request that computes every page of ``tokens`` and hands over window objects at ``windows``
    (default: all) and snapshots at ``snapshots`` (default: where the core asks)."""
    req = core.begin(tokens)
    full = len(req.keys)
    new = req.alloc(full - req.num_cached)
    groups = {}
    for c in core.components:
        given = snapshots if c.group.kind == "state" else windows
        places = req.handed_places(c.name) if given is None else given
        ids: list[int | None] = [None] * full
        for place, gid in zip(places, req.alloc_group(c.name, len(places))):
            ids[place] = gid
        groups[c.name] = ids
    req.commit(req.cached_pages + new.pages, groups)
    return req
