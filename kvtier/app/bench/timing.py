"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[int], object], reps: int, warmup: int = 1) -> float:
    """Median wall time of ``fn(i)`` over ``reps`` calls (``i`` lets callers rotate inputs)."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
