"""A trace slice as an engine sees it: one trace block per engine page, real token ids, machine time.

The planner keys a block by its trace id; an engine keys a page by its chained token hash. Both
see the same hits when (1) a block id names its whole prefix -- :func:`prefix_ids` renumbers the
ids so that it does, whatever the trace -- (2) one block is one engine page of tokens, cut the
same way on both sides (:func:`engine_requests` shrinks every length by ``page / 512``, so a
request keeps its full blocks, and its partial tail shrinks with it), and (3) equal ids give
equal tokens and different ids different ones (:func:`block_tokens`: a seeded 64-bit mix of the
id and the offset, never the folded ``h * 512 + i`` of :func:`~kvtier.app.workloads.mooncake.trace_tokens`,
which a small vocabulary maps to a handful of distinct blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.app.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest
from kvtier.errors import ConfigError

#: token ids below this are left out (a real tokenizer's special tokens live there)
FIRST_TOKEN_ID = 100

_MASK = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64: equal inputs, equal outputs; others spread."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def prefix_ids(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    """The requests with block ids renumbered so that an id names its block *and its whole prefix*
    (``(parent id, trace id) -> id``): a trace whose ids repeat under different prefixes would
    otherwise give the planner hits an engine's chained keys cannot have."""
    ids: dict[tuple[int, int], int] = {}
    out = []
    for i, r in enumerate(requests):
        parent, chain = -1, []
        for h in r.hash_ids:
            parent = ids.setdefault((parent, h), len(ids))
            chain.append(parent)
        if len(chain) * MOONCAKE_BLOCK_TOKENS < r.input_length:  # a tail block with no id (a generated trace): one of its own
            chain.append(ids.setdefault((-2, i), len(ids)))
        out.append(TraceRequest(r.timestamp_ms, r.input_length, r.output_length, tuple(chain)))
    return out


def engine_requests(requests: Sequence[TraceRequest], page_tokens: int) -> list[TraceRequest]:
    """Each request with its length shrunk so that one trace block is one ``page_tokens``-token page:
    its full blocks stay full pages, its tail page shrinks with it (at least one token)."""
    if not 0 < page_tokens <= MOONCAKE_BLOCK_TOKENS:
        raise ConfigError(f"an engine page of {page_tokens} tokens cannot stand for a trace block of {MOONCAKE_BLOCK_TOKENS}: "
                          f"give a page size in 1..{MOONCAKE_BLOCK_TOKENS}")
    return [TraceRequest(r.timestamp_ms, max(1, r.input_length * page_tokens // MOONCAKE_BLOCK_TOKENS), r.output_length, r.hash_ids)
            for r in prefix_ids(requests)]


def block_tokens(block_id: int, page_tokens: int, vocab: int, seed: int = 0) -> np.ndarray:
    """The ``page_tokens`` token ids of block ``block_id`` (int64, in ``[FIRST_TOKEN_ID, vocab)``)."""
    base = np.uint64(((block_id * 0x9E3779B97F4A7C15) ^ (seed * 0xD1B54A32D192ED03)) & _MASK)
    mixed = _mix(base + np.arange(page_tokens, dtype=np.uint64))
    return (mixed % np.uint64(vocab - FIRST_TOKEN_ID)).astype(np.int64) + FIRST_TOKEN_ID


def prompt_tokens(request: TraceRequest, page_tokens: int, vocab: int, seed: int = 0) -> list[int]:
    """Token ids of an :func:`engine_requests` request: its blocks' tokens, cut to its length."""
    pages = -(-request.input_length // page_tokens)
    toks = np.concatenate([block_tokens(h, page_tokens, vocab, seed) for h in request.hash_ids[:pages]])
    return toks[: request.input_length].tolist()


@dataclass(frozen=True)
class EngineSlice:
    """The requests an engine replays, and their arrivals in the machine's seconds."""

    #: the trace's requests (for the planner), shrunk to the engine's page (:func:`engine_requests`)
    requests: list[TraceRequest]
    #: each request's token ids
    prompts: list[list[int]]
    #: seconds after the first request, on this machine
    arrivals_s: list[float]
    #: the engine's seconds per trace second (``1 / speedup``)
    time_scale: float


def make_slice(requests: Sequence[TraceRequest], page_tokens: int, vocab: int, time_scale: float) -> EngineSlice:
    """``requests`` (a trace slice) as ``page_tokens``-token pages of ``vocab`` token ids, arriving
    ``time_scale`` machine seconds per trace second apart."""
    scaled = engine_requests(requests, page_tokens)
    t0 = scaled[0].timestamp_ms if scaled else 0
    return EngineSlice(scaled, [prompt_tokens(r, page_tokens, vocab) for r in scaled],
                       [(r.timestamp_ms - t0) / 1000.0 * time_scale for r in scaled], time_scale)


def take_slice(requests: Sequence[TraceRequest], start: int, count: int, source: str) -> list[TraceRequest]:
    """Requests ``start .. start + count`` of ``source``'s ``requests``, or a :class:`ConfigError`
    naming both sizes when the slice runs past its end."""
    if start < 0 or count < 1:
        raise ConfigError(f"a validation slice starts at request 0 or later and holds 1 or more requests; got start {start}, "
                          f"{count} requests")
    if start + count > len(requests):
        raise ConfigError(f"a slice of {count} requests from request {start} runs past the end of {source} ({len(requests)} requests); "
                          f"give --limit {max(1, len(requests) - start)} or less")
    return list(requests[start : start + count])


def probe_arrivals(services: list[float], load: float, seed: int = 0) -> list[float]:
    """Poisson arrivals (seconds from the first) that keep an engine serving ``services`` busy ``load`` of the time
    (calibration's load probe, on ``kvtier run``'s engine and on vLLM's alike)."""
    import random

    rng = random.Random(seed)
    mean_gap = sum(services) / len(services) / load
    t, out = 0.0, []
    for _ in services:
        out.append(t)
        t += rng.expovariate(1.0 / mean_gap)
    return out
