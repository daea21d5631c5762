"""The Mooncake trace format: one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids`` (one id per 512-token block;
equal ids mean equal prefix blocks).

Requests map to deterministic token ids: block id ``h`` is the tokens
``h*512 .. h*512+511``, cut to ``input_length`` — so equal hash ids give equal
tokens, and a trace replays the same way in every process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.errors import ConfigError

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_mooncake_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                req = TraceRequest(int(r["timestamp"]), int(r["input_length"]), int(r["output_length"]), tuple(r["hash_ids"]))
            except (KeyError, ValueError, TypeError) as e:
                raise ConfigError(f"{path}:{lineno}: not a Mooncake trace record ({e}); expected timestamp, input_length, output_length, hash_ids") from None
            if len(req.hash_ids) * MOONCAKE_BLOCK_TOKENS < req.input_length:
                raise ConfigError(f"{path}:{lineno}: {len(req.hash_ids)} hash_ids cover fewer than input_length={req.input_length} tokens")
            out.append(req)
    return out


def default_trace_path() -> Path:
    """``$KVTIER_TRACE``, else the shipped trace in ``shared/traces`` beside (or inside) the checkout."""
    import os

    env = os.environ.get("KVTIER_TRACE")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    for base in (repo / "shared", repo.parent / "shared", Path.cwd() / "shared", Path.cwd().parent / "shared"):
        candidate = base / "traces" / "mooncake_synthetic_trace.jsonl"
        if candidate.exists():
            return candidate
    raise ConfigError("no Mooncake trace found: pass --trace PATH or set KVTIER_TRACE (the shipped one lives in shared/traces/)")


_OFFSETS = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.int64)


def trace_tokens(req: TraceRequest, scale: float = 1.0) -> np.ndarray:
    """Token ids of a request (int64). ``scale`` < 1 shrinks every block (and the length) for small models."""
    block = MOONCAKE_BLOCK_TOKENS if scale == 1.0 else max(1, int(MOONCAKE_BLOCK_TOKENS * scale))
    n = req.input_length if scale == 1.0 else max(1, int(req.input_length * scale))
    ids = np.asarray(req.hash_ids, dtype=np.int64)
    toks = (ids[:, None] * MOONCAKE_BLOCK_TOKENS + _OFFSETS[None, :block]).reshape(-1)
    return toks[:n]
