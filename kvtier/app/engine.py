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


class ReferenceEngine:
    def __init__(self, model: ReferenceModel, cache):
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.ps = model.cfg.page_size

    def prefill(self, token_ids: list[int] | torch.Tensor) -> RequestResult:
        tokens = torch.as_tensor(token_ids, dtype=torch.int64)
        n = tokens.numel()
        ps = self.ps
        cache = self.cache
        t0 = time.perf_counter()
        req = cache.begin(tokens.tolist(), usable_pages=(n - 1) // ps)
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
