"""A measured statistic over repeated trials, and where a prediction falls in it.

``kvtier plan --validate --trials N`` serves the same slice N times per configuration. For each TTFT
statistic (p50, p90, p99, mean) this module gives:

* the **point estimate**: the statistic of every trial's requests pooled (N x requests values);
* the **trial range**: the lowest and highest of the trials' own values of it (run-to-run spread);
* a **bootstrap interval** over requests (sampling spread): the slice's requests resampled with
  replacement, a request bringing its TTFT from every trial (a request slow in one trial tends to be
  slow in all: resampling it whole keeps that), the statistic of the pooled resample; the
  ``confidence`` share of :data:`RESAMPLES` resamples around it, from a generator seeded with ``seed``
  (the same numbers give the same interval);
* the **judgement**: the prediction ``below``, ``inside`` or ``above`` the measured spread, the
  span from the lower to the higher end of the trial range and the interval together;
* the **bias**: the median over trials of the prediction's signed error against each trial's value,
  in percent (negative: the planner predicts less than the engine took).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

#: the statistics a spread is given for
STATISTICS = ("p50", "p90", "p99", "mean")
#: bootstrap resamples per interval
RESAMPLES = 1000
CONFIDENCE = 0.95
SEED = 0

Verdict = Literal["below", "inside", "above"]


def statistic(values: np.ndarray, name: str) -> np.ndarray:
    """``name`` (:data:`STATISTICS`) of ``values`` along its last axis."""
    if name == "mean":
        return values.mean(axis=-1)
    return np.percentile(values, float(name[1:]), axis=-1)


def signed_pct(predicted: float, measured: float) -> float | None:
    """(predicted - measured) / measured, in percent; None where nothing was measured."""
    return (predicted - measured) / measured * 100 if measured else None


def rounded_pct(predicted: float, measured: float) -> float | None:
    """:func:`signed_pct` to two decimals, as reports print it."""
    e = signed_pct(predicted, measured)
    return None if e is None else round(e, 2)


def span_of(trial_range: tuple[float, float], interval: tuple[float, float]) -> tuple[float, float]:
    """The measured spread a prediction is judged against: from the lower to the higher end of both."""
    return min(trial_range[0], interval[0]), max(trial_range[1], interval[1])


@dataclass(frozen=True)
class Spread:
    """One measured statistic over the trials, against its prediction (seconds; errors in percent)."""

    statistic: str
    predicted: float
    #: the statistic of every trial's requests pooled
    measured: float
    #: each trial's own value, in the order the trials ran
    trials: tuple[float, ...]
    #: (lowest, highest) of :attr:`trials`
    trial_range: tuple[float, float]
    #: the bootstrap interval over requests of :attr:`measured`, at :attr:`confidence`
    interval: tuple[float, float]
    confidence: float
    #: the prediction against (min of range and interval, max of them)
    verdict: Verdict
    #: the prediction's signed error against each trial, and their median (the bias)
    trial_errors_pct: tuple[float | None, ...]
    bias_pct: float | None

    @property
    def span(self) -> tuple[float, float]:
        return span_of(self.trial_range, self.interval)


def judge(predicted: float, low: float, high: float) -> Verdict:
    """Where ``predicted`` falls against the measured span ``[low, high]``."""
    return "below" if predicted < low else "above" if predicted > high else "inside"


def bootstrap(measured: np.ndarray, names: tuple[str, ...] = STATISTICS, *, resamples: int = RESAMPLES, confidence: float = CONFIDENCE,
              seed: int = SEED) -> dict[str, tuple[float, float]]:
    """Bootstrap intervals of each of ``names`` for ``measured`` (trials x requests), resampling requests
    (columns) whole; one set of resamples serves every statistic."""
    trials, n = measured.shape
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    pooled = measured[:, idx].transpose(1, 0, 2).reshape(resamples, trials * n)  # resample b: its requests from every trial
    tail = (1 - confidence) / 2 * 100
    out = {}
    for name in names:
        lo, hi = np.percentile(statistic(pooled, name), [tail, 100 - tail])
        out[name] = (float(lo), float(hi))
    return out


def spreads(predicted: Mapping[str, float], measured: np.ndarray, *, resamples: int = RESAMPLES, confidence: float = CONFIDENCE,
            seed: int = SEED) -> dict[str, Spread]:
    """A :class:`Spread` per statistic of ``predicted`` (name -> seconds) for ``measured`` (trials x requests)."""
    measured = np.asarray(measured, dtype=float)
    if measured.ndim != 2 or not measured.size:
        raise ValueError(f"measured must be trials x requests with at least one of each; got shape {measured.shape}")
    names = tuple(predicted)
    intervals = bootstrap(measured, names, resamples=resamples, confidence=confidence, seed=seed)
    out = {}
    for name in names:
        p = float(predicted[name])
        per_trial = tuple(float(v) for v in statistic(measured, name))
        errors = tuple(signed_pct(p, v) for v in per_trial)
        known = [e for e in errors if e is not None]
        rng = (min(per_trial), max(per_trial))
        interval = intervals[name]
        out[name] = Spread(name, p, float(statistic(measured.reshape(-1), name)), per_trial, rng, interval, confidence,
                           judge(p, *span_of(rng, interval)), errors, float(np.median(known)) if known else None)
    return out
