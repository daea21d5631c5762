"""The planner's TTFT error split by cause: its service model, its queue model, and the two together.

A predicted TTFT is, per request, the planner's queueing delay plus its service time (what
:func:`~kvtier.app.plan.timing.simulate` books: ``ttft = queue + service``, exactly). Each part is
checked on its own against what the engine measured, pooled over the trials:

* **service model**: each request's predicted service (its prefill with its hits and loads, and the
  wake-up of an idle engine where the planner's queue finds it idle) against the same request's
  measured service (the engine's own seconds from its start to the first token: no queueing); and
  the drain after it (the commit, backups and L3 saves that hold the engine before the next
  request) against the measured drain. Per request: median absolute and median signed error; and each
  part's median per trial, judged against the predicted median (:class:`TrialSpread`): the drain's level
  moves from one replay to the next on a busy machine by as much as its bias (docs/planner.md);
* **queue model**: the planner's own queue (:func:`~kvtier.app.plan.timing.simulate`) run on the
  *measured* service and drain times at the same arrivals, against the measured TTFT (p50, p90):
  what the queue model alone gets wrong;
* **end to end**: the predicted TTFT against the measured one (p50, p90).

An engine that does not time its service (vLLM's: its requests are batched) has the end-to-end row only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.app.plan.config import PlanConfig
from kvtier.app.plan.timing import Timing, simulate
from kvtier.app.plan.trials import Verdict, judge, rounded_pct
from kvtier.app.workloads.mooncake import TraceRequest

PERCENTILES = ("p50", "p90")


@dataclass(frozen=True)
class PerRequestError:
    """Predicted against measured, request by request (pooled over trials): medians of the error."""

    requests: int
    median_abs_ms: float
    #: the bias: negative when the planner predicts less than the engine took
    median_signed_ms: float
    median_abs_pct: float | None
    median_signed_pct: float | None


def per_request_error(predicted: np.ndarray, measured: np.ndarray) -> PerRequestError:
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    diff = p - m
    pct = diff[m > 0] / m[m > 0] * 100
    return PerRequestError(int(p.size), round(float(np.median(np.abs(diff))) * 1e3, 4), round(float(np.median(diff)) * 1e3, 4),
                           round(float(np.median(np.abs(pct))), 2) if pct.size else None,
                           round(float(np.median(pct)), 2) if pct.size else None)


@dataclass(frozen=True)
class PercentileError:
    """TTFT percentiles (seconds) of one side against the measured ones, and the per-request error."""

    predicted: dict[str, float]
    measured: dict[str, float]
    error_pct: dict[str, float | None]
    per_request: PerRequestError


def percentile_error(predicted: np.ndarray, measured: np.ndarray, trials: int = 1) -> PercentileError:
    """``predicted`` (one value per request, or per request and trial where ``trials`` is 1) against ``measured``
    (per request and trial, trial after trial): the percentiles of each as they are, the per-request error with
    the prediction once per trial."""
    q = [float(k[1:]) for k in PERCENTILES]
    p = dict(zip(PERCENTILES, (float(v) for v in np.percentile(predicted, q))))
    m = dict(zip(PERCENTILES, (float(v) for v in np.percentile(measured, q))))
    return PercentileError(p, m, {k: rounded_pct(p[k], m[k]) for k in PERCENTILES},
                           per_request_error(np.tile(predicted, trials), measured))


@dataclass(frozen=True)
class TrialSpread:
    """One part's median per request, predicted and in each trial (ms), and where the prediction falls against the
    trials' range: a bias smaller than the trials' own spread is not told apart from the machine's drift."""

    predicted_ms: float
    trial_medians_ms: list[float]
    verdict: Verdict


def trial_spread(predicted: np.ndarray, per_trial: Sequence[Sequence[float]]) -> TrialSpread:
    medians = [round(float(np.median(np.asarray(t, dtype=float))) * 1e3, 4) for t in per_trial]
    p = round(float(np.median(np.asarray(predicted, dtype=float))) * 1e3, 4)
    return TrialSpread(p, medians, judge(p, min(medians), max(medians)))


@dataclass(frozen=True)
class ErrorSplit:
    """The TTFT error by cause (see the module); ``None`` where the engine does not time its service."""

    service: PerRequestError | None
    drain: PerRequestError | None
    queue: PercentileError | None
    end_to_end: PercentileError
    note: str = ""
    #: the service's and the drain's medians per trial against the predicted ones
    service_trials: TrialSpread | None = None
    drain_trials: TrialSpread | None = None


class MeasuredCosts:
    """A cost model that answers each request with its measured (service, drain) seconds, in the order
    :func:`~kvtier.app.plan.timing.simulate` asks (once per request, in trace order): the planner's queue on
    the engine's own times. No wake-up cost: a measured service already holds it. One use only."""

    def __init__(self, times: Sequence[tuple[float, float]]) -> None:
        self._next = iter(times).__next__

    def request(self, prompt: int, served, moves) -> tuple[float, float]:
        return self._next()

    def wake(self, idle_s: float, service_s: float) -> float:
        return 0.0


def queue_on_measured(requests: Sequence[TraceRequest], time_scale: float, service_s: Sequence[float], drain_s: Sequence[float]) -> Timing:
    """The planner's queue at the slice's arrivals (``time_scale`` machine seconds per trace second) with each
    request's measured service and drain."""
    n = len(requests)
    cfg = PlanConfig(arrival_speedup=1.0 / time_scale)
    return simulate(requests, [0] * n, [(0, 0, 0)] * n, cfg, MeasuredCosts(list(zip(service_s, drain_s))))


def split_error(requests: Sequence[TraceRequest], time_scale: float, predicted: Timing, measured_ttft: Sequence[Sequence[float]],
                measured_service: Sequence[Sequence[float]], measured_drain: Sequence[Sequence[float]]) -> ErrorSplit:
    """The split for one configuration: ``predicted`` the planner's timing of the slice, the rest per trial
    (each a list per request; service and drain empty where the engine does not time them)."""
    trials = len(measured_ttft)
    tile = lambda a: np.tile(np.asarray(a, dtype=float), trials)  # noqa: E731 -- the prediction, once per trial
    ttft = np.concatenate([np.asarray(t, dtype=float) for t in measured_ttft])
    e2e = percentile_error(np.asarray(predicted.per_request_ttft_s, dtype=float), ttft, trials)
    if not all(len(s) for s in measured_service) or not all(len(d) for d in measured_drain):
        return ErrorSplit(None, None, None, e2e, "the engine does not time each request's service: end to end only")
    service = np.concatenate([np.asarray(s, dtype=float) for s in measured_service])
    drain = np.concatenate([np.asarray(d, dtype=float) for d in measured_drain])
    replayed = np.concatenate([queue_on_measured(requests, time_scale, s, d).per_request_ttft_s
                               for s, d in zip(measured_service, measured_drain)])
    return ErrorSplit(per_request_error(tile(predicted.per_request_service_s), service),
                      per_request_error(tile(predicted.per_request_after_s), drain),
                      percentile_error(replayed, ttft), e2e,
                      service_trials=trial_spread(predicted.per_request_service_s, measured_service),
                      drain_trials=trial_spread(predicted.per_request_after_s, measured_drain))
