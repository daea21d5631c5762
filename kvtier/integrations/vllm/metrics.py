"""kvtier's numbers in vLLM's conventions: connector stats from the workers, Prometheus on ``/metrics``.

Each worker counts what it moved in a step interval (:class:`KVTierConnectorStats`):
tokens and bytes per tier and direction --

============  =========  ================================
tier          direction  movement
============  =========  ================================
``host``      ``load``   host memory -> vLLM's KV blocks
``host``      ``store``  vLLM's KV blocks -> host memory
``storage``   ``load``   L3 -> host memory
``storage``   ``store``  host memory -> L3
============  =========  ================================

-- tokens that failed to load (vLLM recomputed them), and the seconds each
step's loads and stores took. vLLM ships the stats from the workers to its
logger process (``get_kv_connector_stats`` -> ``build_kv_connector_stats`` ->
``aggregate`` over ranks and steps -> ``reduce`` for the log line), and
:class:`KVTierPromMetrics` (``build_prom_metrics``) turns them into

* ``vllm:kvtier_tokens_total{tier,direction}`` and ``vllm:kvtier_bytes_total{tier,direction}``,
* ``vllm:kvtier_load_failed_tokens_total``,
* ``vllm:kvtier_load_seconds`` and ``vllm:kvtier_store_seconds`` (histograms, one
  observation per step that loaded, and per copy out of vLLM's blocks: from the
  end of its step until the worker saw it complete -- what the forward did not hide),

with vLLM's own engine labels, on the server's ``/metrics``. Tokens count once per
request (rank 0 counts them: a 992-token hit is 992 tokens at any TP size); bytes
are summed over tensor-parallel ranks (each rank moves its own shard). Failed
tokens are counted by each rank that failed them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

MOVEMENTS = (("host", "load"), ("host", "store"), ("storage", "load"), ("storage", "store"))
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _empty() -> dict[str, Any]:
    return {"tokens": {}, "bytes": {}, "load_failed_tokens": 0, "copies_abandoned": 0, "load_seconds": [], "store_seconds": []}


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        for k, v in _empty().items():
            self.data.setdefault(k, v)

    def record(self, tier: str, direction: str, tokens: int, nbytes: int) -> None:
        key = f"{tier}|{direction}"
        self.data["tokens"][key] = self.data["tokens"].get(key, 0) + tokens
        self.data["bytes"][key] = self.data["bytes"].get(key, 0) + nbytes

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVTierConnectorStats:
        o = KVTierConnectorStats(dict(other.data)).data
        for part in ("tokens", "bytes"):
            for k, v in o[part].items():
                self.data[part][k] = self.data[part].get(k, 0) + v
        self.data["load_failed_tokens"] += o["load_failed_tokens"]
        self.data["copies_abandoned"] += o["copies_abandoned"]
        self.data["load_seconds"] += o["load_seconds"]
        self.data["store_seconds"] += o["store_seconds"]
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for tier, direction in MOVEMENTS:
            key = f"{tier}|{direction}"
            if self.data["tokens"].get(key):
                out[f"{tier}_{direction}_tokens"] = self.data["tokens"][key]
                out[f"{tier}_{direction}_GB"] = round(self.data["bytes"][key] / 1e9, 6)
        out["load_failed_tokens"] = self.data["load_failed_tokens"]
        out["copies_abandoned"] = self.data["copies_abandoned"]
        for kind in ("load_seconds", "store_seconds"):
            xs = self.data[kind]
            if xs:
                out[f"avg_{kind}"] = round(sum(xs) / len(xs), 6)
        return out

    def is_empty(self) -> bool:
        d = self.data
        return not (
            any(d["tokens"].values()) or any(d["bytes"].values()) or d["load_failed_tokens"] or d["copies_abandoned"]
            or d["load_seconds"] or d["store_seconds"]
        )


class KVTierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        moved = labelnames + ["tier", "direction"]
        self._tokens = self._counter_cls(
            name="vllm:kvtier_tokens_total",
            labelnames=moved,
            documentation="Tokens of KV kvtier moved, by tier (host, storage) and direction (load, store).",
        )
        self._bytes = self._counter_cls(
            name="vllm:kvtier_bytes_total",
            labelnames=moved,
            documentation="Bytes of KV kvtier moved (all tensor-parallel ranks), by tier and direction.",
        )
        self._failed = self._counter_cls(
            name="vllm:kvtier_load_failed_tokens_total",
            labelnames=labelnames,
            documentation="Tokens kvtier offered but could not load (vLLM recomputed them).",
        )
        self._abandoned = self._counter_cls(
            name="vllm:kvtier_copies_abandoned_total",
            labelnames=labelnames,
            documentation="Copies out of KV blocks a rank gave up after rank_timeout_s (blocks went back to vLLM).",
        )
        self._load_s = self._histogram_cls(
            name="vllm:kvtier_load_seconds",
            labelnames=labelnames,
            buckets=_SECONDS_BUCKETS,
            documentation="Seconds a step's kvtier loads (L3 fetch and copy into KV blocks) took, per rank.",
        )
        self._store_s = self._histogram_cls(
            name="vllm:kvtier_store_seconds",
            labelnames=labelnames,
            buckets=_SECONDS_BUCKETS,
            documentation="Seconds a step's copies out of KV blocks into host memory took, per rank.",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = KVTierConnectorStats(dict(transfer_stats_data)).data
        engine = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for key, n in data["tokens"].items():
            tier, direction = key.split("|")
            self._tokens.labels(*engine, tier, direction).inc(n)
            self._bytes.labels(*engine, tier, direction).inc(data["bytes"].get(key, 0))
        if data["load_failed_tokens"]:
            self._failed.labels(*engine).inc(data["load_failed_tokens"])
        if data["copies_abandoned"]:
            self._abandoned.labels(*engine).inc(data["copies_abandoned"])
        for s in data["load_seconds"]:
            self._load_s.labels(*engine).observe(s)
        for s in data["store_seconds"]:
            self._store_s.labels(*engine).observe(s)
