"""Percentiles of measured times, one way for every report (the runner's TTFTs, the benches' latencies)."""

from __future__ import annotations

import statistics


def percentiles(xs: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """``{"p50": ..., ...}`` of ``xs`` (inclusive method: the median is the sample median), unrounded;
    one sample is every percentile."""
    if len(xs) == 1:
        return {f"p{q}": xs[0] for q in qs}
    cuts = statistics.quantiles(xs, n=100, method="inclusive")
    return {f"p{q}": cuts[q - 1] for q in qs}
