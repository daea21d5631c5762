"""What ``kvtier plan --validate`` reports of one configuration -- each side's hits, bytes and TTFT, and the errors
between them -- and of a what-if: the change each side sees, trial by trial (:mod:`~kvtier.app.plan.validate` runs them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from kvtier.app.plan.profile import median_abs_pct_error
from kvtier.app.plan.timing import spread
from kvtier.app.plan.trials import judge, rounded_pct
from kvtier.app.workloads.mooncake import TraceRequest

TIERS = ("device", "host", "storage")


def side_of(served: Sequence[tuple[int, int, int]], ttft: Sequence[float], queue: Sequence[float], moved: dict[str, int],
          requests: Sequence[TraceRequest], page_tokens: int) -> dict:
    tokens = sum(r.input_length for r in requests)
    pages = {t: sum(s[i] for s in served) for i, t in enumerate(TIERS)}
    ratio = {t: round(pages[t] * page_tokens / tokens, 4) for t in TIERS}
    ratio["total"] = round(sum(pages.values()) * page_tokens / tokens, 4)
    return {"hit_ratio": ratio, "hit_pages": pages, "bytes_moved": dict(moved), "ttft_s": spread(np.asarray(ttft)),
            "queue_s": spread(np.asarray(queue)) if len(queue) else None}


def compare(predicted: dict, measured: dict, pred_ttft: Sequence[float], meas_ttft: Sequence[float],
            pred_served: Sequence[tuple[int, int, int]], meas_served: Sequence[tuple[int, int, int]]) -> dict:
    """Errors: hit ratios in percentage points, TTFT percentiles and bytes in percent, per-request TTFT as a median
    absolute percentage error; and how many requests were served the same pages per tier."""
    same = sum(tuple(a) == tuple(b) for a, b in zip(pred_served, meas_served))
    return {
        "hit_ratio_pp": {t: round((predicted["hit_ratio"][t] - measured["hit_ratio"][t]) * 100, 2) for t in (*TIERS, "total")},
        "ttft_pct": {k: rounded_pct(predicted["ttft_s"][k], measured["ttft_s"][k]) for k in ("p50", "p90", "p99", "mean")},
        "ttft_per_request_mape_pct": round(median_abs_pct_error(pred_ttft, meas_ttft), 2),
        "bytes_pct": {k: rounded_pct(predicted["bytes_moved"][k], v) for k, v in measured["bytes_moved"].items()},
        "requests_served_alike": same,
        "hit_pages_equal": predicted["hit_pages"] == measured["hit_pages"],
    }


@dataclass
class ConfigResult:
    setup: dict
    predicted: dict
    #: every trial's requests pooled (TTFT statistics); hits, bytes and the engine's facts from the first trial
    measured: dict
    error: dict
    #: per request: pages predicted and measured (first trial), TTFT, queueing, service and drain predicted and measured
    #: (the median of the trials; ``ttft_measured_trials_s``: each trial's)
    per_request: list[dict] = field(default_factory=list)
    #: each trial: its hits, requests served alike, TTFT statistics and wall time
    trials: list[dict] = field(default_factory=list)
    #: per TTFT statistic: prediction, pooled measurement, trial range, bootstrap interval, verdict, bias
    #: (:class:`~kvtier.app.plan.trials.Spread`)
    spread: dict = field(default_factory=dict)
    #: the TTFT error by cause (:class:`~kvtier.app.plan.split.ErrorSplit`)
    split: dict = field(default_factory=dict)


@dataclass
class ValidationReport:
    engine: str
    workload: str
    requests: int
    start: int
    page_tokens: int
    time_scale: float
    target_load: float | None
    profile: dict
    configurations: list[ConfigResult]
    what_if: dict | None = None
    machine: dict = field(default_factory=dict)
    trials: int = 1
    #: the runs in the order they ran: trial (0: a discarded warm-up), configuration, wall seconds, discarded
    runs: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def change(base: ConfigResult, other: ConfigResult) -> dict:
    """The what-if: each side's change from ``base`` to ``other`` (TTFT in percent, hit ratio in points) and
    the prediction's error against the measured change, in percentage points; with trials, the measured change
    of each trial (its what-if against its own base run), their range, and the prediction judged against it."""
    out: dict = {"from": base.setup["name"], "to": other.setup["name"]}
    for k in ("p50", "p90", "mean"):
        pred = rounded_pct(other.predicted["ttft_s"][k], base.predicted["ttft_s"][k])
        meas = rounded_pct(other.measured["ttft_s"][k], base.measured["ttft_s"][k])
        per_trial = [rounded_pct(o["ttft_s"][k], b["ttft_s"][k]) for b, o in zip(base.trials, other.trials)]
        known = [v for v in per_trial if v is not None]
        rng = [min(known), max(known)] if known else None
        out[f"ttft_{k}"] = {"predicted_change_pct": pred, "measured_change_pct": meas,
                            "error_pp": round(pred - meas, 2) if pred is not None and meas is not None else None,
                            "measured_change_trials_pct": per_trial, "measured_change_range_pct": rng,
                            "verdict": judge(pred, *rng) if pred is not None and rng else None}
    for t in (*TIERS, "total"):
        pred = round((other.predicted["hit_ratio"][t] - base.predicted["hit_ratio"][t]) * 100, 2)
        meas = round((other.measured["hit_ratio"][t] - base.measured["hit_ratio"][t]) * 100, 2)
        out[f"hit_{t}"] = {"predicted_change_pp": pred, "measured_change_pp": meas, "error_pp": round(pred - meas, 2)}
    return out
