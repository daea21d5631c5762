"""The Mooncake trace format: one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids`` (one id per 512-token block;
equal ids mean equal prefix blocks).

Requests map to deterministic token ids: block id ``h`` is the tokens
``h*512 .. h*512+511``, cut to ``input_length`` — so equal hash ids give equal
tokens, and a trace replays the same way in every process.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import numpy as np
import xxhash

from kvtier.errors import ConfigError

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


#: the FAST'25 Mooncake synthetic trace (3,993 requests, Apache-2.0), shipped inside the package
SHIPPED_TRACE = "mooncake_synthetic_trace.jsonl.gz"

#: hash ids become token ids ``h * 512 + i`` in int64: larger ids would overflow
_MAX_HASH_ID = (2**63 - 1) // MOONCAKE_BLOCK_TOKENS - MOONCAKE_BLOCK_TOKENS


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _parse(r: object) -> TraceRequest:
    """One record, every field checked: a trace is user input."""
    if not isinstance(r, dict):
        raise ValueError(f"a record is a JSON object, got {type(r).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in r]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    ints = {}
    for k in ("timestamp", "input_length", "output_length"):
        v = r[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")) or int(v) != v:
            raise ValueError(f"{k} must be a whole number, got {v!r}")
        ints[k] = int(v)
    if ints["input_length"] < 1:
        raise ValueError(f"input_length must be >= 1, got {ints['input_length']}")
    if ints["output_length"] < 0 or ints["timestamp"] < 0:
        raise ValueError(f"timestamp and output_length must be >= 0, got {ints['timestamp']} and {ints['output_length']}")
    ids = r["hash_ids"]
    if not isinstance(ids, list) or not all(type(h) is int and 0 <= h <= _MAX_HASH_ID for h in ids):
        bad = ids if not isinstance(ids, list) else next(h for h in ids if not (type(h) is int and 0 <= h <= _MAX_HASH_ID))
        raise ValueError(f"hash_ids must be a list of integers in [0, {_MAX_HASH_ID}], got {bad!r}")
    if len(ids) * MOONCAKE_BLOCK_TOKENS < ints["input_length"]:
        raise ValueError(f"{len(ids)} hash_ids cover fewer than input_length={ints['input_length']} tokens")
    return TraceRequest(ints["timestamp"], ints["input_length"], ints["output_length"], tuple(ids))


#: the longest trace line read (a record of 100k hash ids is ~0.8 MB); longer is an error naming the line
MAX_LINE_CHARS = 1 << 20


def load_mooncake_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Requests of a Mooncake-format JSONL trace (``.gz`` read as gzip). Any bad record, a missing
    file or a trace with no request is a :class:`ConfigError` naming the file and line."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise ConfigError(f"the request limit must be >= 1, got {limit}")
    out: list[TraceRequest] = []
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE_CHARS + 1), ""), 1):
                if limit is not None and len(out) >= limit:
                    break
                if len(line) > MAX_LINE_CHARS:  # /dev/zero, a binary file: never read whole into memory
                    raise ConfigError(f"{path}:{lineno}: a line longer than {MAX_LINE_CHARS} characters is not a Mooncake trace record "
                                      "(one JSON object per line)")
                if not line.strip():
                    continue
                try:
                    out.append(_parse(json.loads(line)))
                except (ValueError, TypeError) as e:
                    raise ConfigError(f"{path}:{lineno}: not a Mooncake trace record: {e} "
                                      "(expected timestamp, input_length, output_length, hash_ids)") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"cannot read trace {path}: {reason}; pass --trace PATH to a Mooncake-format JSONL file") from None
    if not out:
        raise ConfigError(f"trace {path} has no requests; a Mooncake trace has one JSON object per line")
    return out


def default_trace_path() -> Path:
    """``$KVTIER_TRACE``, else the trace shipped inside the package (nothing outside it is read)."""
    env = os.environ.get("KVTIER_TRACE")
    if env:
        return Path(env)
    return Path(str(files("kvtier.app.workloads") / "data" / SHIPPED_TRACE))


_OFFSETS = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.int64)


def trace_tokens(req: TraceRequest, scale: float = 1.0) -> np.ndarray:
    """Token ids of a request (int64). ``scale`` < 1 shrinks every block (and the length) for small models."""
    block = MOONCAKE_BLOCK_TOKENS if scale == 1.0 else max(1, int(MOONCAKE_BLOCK_TOKENS * scale))
    n = req.input_length if scale == 1.0 else max(1, int(req.input_length * scale))
    ids = np.asarray(req.hash_ids, dtype=np.int64)
    toks = (ids[:, None] * MOONCAKE_BLOCK_TOKENS + _OFFSETS[None, :block]).reshape(-1)
    return toks[:n]


def tenant_scoped(requests: list[TraceRequest], tenants: int) -> list[TraceRequest]:
    """``requests`` spread over ``tenants`` tenants, request ``i`` tenant ``i mod tenants``, each block id scoped by its
    tenant (a 64-bit digest of both, within the ids a trace may hold): two tenants' requests share no block, as a
    tenant-scoped cache keys them. One tenant: the trace as it is."""
    if tenants == 1:
        return requests
    scoped = []
    for i, r in enumerate(requests):
        tag = (i % tenants).to_bytes(8, "little")
        ids = tuple(xxhash.xxh3_64_intdigest(tag + h.to_bytes(16, "little")) % _MAX_HASH_ID for h in r.hash_ids)
        scoped.append(TraceRequest(r.timestamp_ms, r.input_length, r.output_length, ids))
    return scoped
