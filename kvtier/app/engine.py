"""A minimal paged engine around :class:`~kvtier.app.model.ReferenceModel`: it drives a prefix
cache exactly as a serving engine would, one request at a time.

Per request (:mod:`kvtier.core.request`): begin (match, lock, L3 prefetch, load back)
-> allocate the rest -> prefill page by page, waiting for layer ``i``'s restored
pages before attending layer ``i`` -> commit (insert the full pages, free the
tail page, unlock). The last token is always computed (its logits are the output), so at
most ``(len - 1) // page_size`` cached pages are used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError
from kvtier.app.model import ReferenceModel
from kvtier.app.model.hybrid import FULL


@dataclass(frozen=True)
class RequestResult:
    tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    storage_hit_tokens: int
    computed_tokens: int
    ttft_s: float
    logits: torch.Tensor
    selections: list[torch.Tensor]

    @property
    def hit_tokens(self) -> int:
        """Tokens served from the cache, any tier."""
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens


class ReferenceEngine:
    def __init__(self, model: ReferenceModel, cache):
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.ps = model.cfg.page_size

    def prefill(self, token_ids: list[int] | torch.Tensor, tenant: object = None) -> RequestResult:
        """Prefill ``token_ids`` as ``tenant``'s request (None: the cache's own scope): its pages a hit for that tenant only."""
        tokens = torch.as_tensor(token_ids, dtype=torch.int64)
        n = tokens.numel()
        ps = self.ps
        cache = self.cache
        t0 = time.perf_counter()
        req = cache.begin(tokens.tolist(), usable_pages=(n - 1) // ps, tenant=tenant)
        usable = req.usable((n - 1) // ps)
        total_pages = -(-n // ps)
        new = req.alloc(total_pages - usable)
        if not new.ok:
            req.abort()
            raise ConfigError(
                f"device pool too small: a {n}-token request needs {total_pages - usable} free pages after eviction; "
                "raise the device pool size"
            )
        pages = torch.tensor(req.cached_pages[:usable] + new.pages, dtype=torch.int64)
        while True:
            logits, selections = None, []
            for p in range(usable, total_pages):
                end = min(n, (p + 1) * ps)
                logits, sel = self.model.prefill_page(
                    self.device, tokens[p * ps : end], p * ps, pages[: p + 1], req.wait_layer, want_logits=end == n
                )
                selections.append(sel)
            if req.wait() >= usable:
                break
            # a load of the cached prefix failed: it shrank to its last good page; recompute from there
            lost = req.alloc(usable - req.num_cached)
            if not lost.ok:
                req.abort()
                raise ConfigError(
                    f"device pool too small to recompute {usable - req.num_cached} pages a failed load lost; raise the device pool size"
                )
            usable = req.num_cached
            pages = torch.tensor(req.cached_pages + lost.pages + new.pages, dtype=torch.int64)
        ttft = time.perf_counter() - t0
        req.commit(pages.tolist())
        dev_hit, host_hit, from_storage = req.served(usable)
        return RequestResult(n, dev_hit * ps, host_hit * ps, from_storage * ps, n - usable * ps, ttft, logits, selections)


@dataclass(frozen=True)
class HybridObjects:
    """What a hybrid request allocates beside its pages, and hands over with them at commit: a window
    page for every page it computes (the partial tail's included), a state snapshot at each page the
    cache wants one at (``req.handed_places``). :class:`HybridEngine` and the planner's replay of it
    (``kvtier plan --validate run-hybrid``) both allocate through :meth:`alloc`: the same calls, the
    same hits."""

    sliding: str | None
    state: str | None
    #: window page ids of pages ``usable .. total``
    window: list[int]
    #: place (the full page whose end it is kept at) -> snapshot id
    slots: dict[int, int]

    @classmethod
    def alloc(cls, req, usable: int, total: int, sliding: str | None, state: str | None) -> HybridObjects | None:
        """The request's window pages and snapshot slots past its ``usable`` cached pages of ``total``; None
        when the window pool could not give a page for each page to compute."""
        window = req.alloc_group(sliding, total - usable) if sliding else []
        if len(window) < (total - usable if sliding else 0):
            return None
        places = req.handed_places(state) if state else []  # the pages whose end the cache keeps a snapshot at
        return cls(sliding, state, window, dict(zip(places, req.alloc_group(state, len(places)))) if places else {})

    def handover(self, usable: int, full: int) -> dict[str, list[int | None]]:
        """``commit``'s groups: the window pages of the full pages computed, and a snapshot id where one was kept."""
        groups: dict[str, list[int | None]] = {}
        if self.sliding:
            groups[self.sliding] = [None] * usable + self.window[: full - usable]
        if self.state:
            groups[self.state] = [self.slots.get(p) for p in range(full)]
        return groups


class HybridEngine:
    """The same request loop for :class:`~kvtier.app.model.hybrid.HybridReferenceModel`: besides its
    full pages, a request continues from the window pages and the state snapshot the cache gives it
    (``req.groups``), computes window pages for every page it computes, keeps its state at the
    boundaries the cache asks for (``snapshot_boundaries``) and hands all of them over at commit.

    The window pages and the snapshot arrive with the load of the full pages (one plan); the engine
    waits for that load before its first page (no per-layer overlap for hybrid requests)."""

    def __init__(self, model, cache, pools: dict):
        from kvtier.app.model.hybrid import SLIDING, STATE

        self.model = model
        self.cache = cache
        self.pools = pools
        self.ps = model.cfg.base.page_size
        self.sliding = SLIDING if SLIDING in pools else None
        self.state = STATE if STATE in pools else None

    def _state_rows(self, slot: int) -> torch.Tensor:
        """The snapshot ``slot`` as ``[state layers, heads, dim, dim]`` fp32 views of the state pool."""
        c = self.model.cfg
        pool = self.pools[self.state]
        return torch.stack([pool.buffer("state", i)[slot].view(torch.float32).view(c.state_heads, c.state_dim, c.state_dim)
                            for i in range(pool.spec.num_layers)])

    def _write_state(self, slot: int, state: torch.Tensor) -> None:
        pool = self.pools[self.state]
        for i in range(pool.spec.num_layers):
            pool.buffer("state", i)[slot].view(torch.float32).copy_(state[i].reshape(-1))

    def prefill(self, token_ids: list[int] | torch.Tensor, tenant: object = None) -> RequestResult:
        """Prefill ``token_ids`` as ``tenant``'s request (None: the cache's own scope): its pages a hit for that tenant only."""
        tokens = torch.as_tensor(token_ids, dtype=torch.int64)
        n, ps, cache, c = tokens.numel(), self.ps, self.cache, self.model.cfg
        t0 = time.perf_counter()
        req = cache.begin(tokens.tolist(), usable_pages=(n - 1) // ps, tenant=tenant)
        req.wait()  # its window pages and its snapshot land with the load of its pages (a failed load shrank it)
        usable = req.usable((n - 1) // ps)
        total_pages, full = -(-n // ps), n // ps
        new = req.alloc(total_pages - usable)
        objects = HybridObjects.alloc(req, usable, total_pages, self.sliding, self.state) if new.ok else None
        if objects is None:
            req.abort()
            raise ConfigError(f"device pools too small: a {n}-token request needs {total_pages - usable} free pages (and as many "
                              "sliding-window pages) after eviction; raise the device pool size")
        window, slots = objects.window, objects.slots
        tables = {FULL: torch.tensor(req.cached_pages[:usable] + new.pages, dtype=torch.int64)}
        if self.sliding:
            given = req.groups.get(self.sliding, {})
            tables[self.sliding] = torch.tensor([given.get(i, -1) for i in range(usable)] + window, dtype=torch.int64)
        n_state = len(c.layers("state"))
        if self.state and usable:
            state = self._state_rows(req.groups[self.state][usable - 1]).clone()
        else:
            state = torch.zeros(n_state, c.state_heads, c.state_dim, c.state_dim)
        logits, selections = None, []
        for p in range(usable, total_pages):
            end = min(n, (p + 1) * ps)
            logits, sel = self.model.prefill_page(self.pools, tokens[p * ps : end], p * ps, tables, state, want_logits=end == n)
            selections.append(sel)
            if p in slots:
                self._write_state(slots[p], state)
        ttft = time.perf_counter() - t0
        req.commit(tables[FULL].tolist(), objects.handover(usable, full))
        dev_hit, host_hit, from_storage = req.served(usable)
        return RequestResult(n, dev_hit * ps, host_hit * ps, from_storage * ps, n - usable * ps, ttft, logits, selections)

