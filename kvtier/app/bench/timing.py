"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager


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


def interleaved_times(fns: dict[str, object], rounds: int, after=None) -> dict[str, list[float]]:
    """Seconds of each ``fn(i)`` in each of ``rounds`` rounds, the functions taking turns within a round.

    Taking turns puts kvtier's path and the plain client under the same machine
    conditions (on 2 shared cores the server, page cache and CPU clock drift
    within seconds); separate blocks of repetitions turned drift into ratio noise.
    ``after(name, i)``, untimed, runs after each call (puts delete what they wrote). An untimed
    warm-up round comes first: the first writes of a run fault fresh memory into the page cache
    (or the server), which on a VM made whichever side went first look slow."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():
        fn(0)  # type: ignore[operator]
        if after is not None:
            after(name, 0)
    order = list(fns.items())
    for i in range(rounds):
        for name, fn in order[i % 2 :] + order[: i % 2]:  # who goes first alternates
            t0 = time.perf_counter()
            fn(i)  # type: ignore[operator]
            times[name].append(time.perf_counter() - t0)
            if after is not None:
                after(name, i)
    return times


@contextmanager
def one_torch_thread():
    """Torch's intra-op threads at one while open: every system a bench compares replays alike (with two
    on a loaded machine, OpenMP's spin-waiting slowed some replays 10-20x)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
