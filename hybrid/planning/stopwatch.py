"""Wall-clock timing of TensorFlow programs for the profiler: one run, the median of several,
and the median of a program net of a baseline program timed in turns with it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hybrid.engine.model.layer_costs import block

__all__ = ["median_seconds", "net_seconds", "run_seconds"]


def run_seconds(program: Any, args: tuple[Any, ...]) -> float:
    """Seconds of one call of ``program(*args)``, until every output is computed."""
    start = time.perf_counter()
    block(program(*args))
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], Sequence[tf.Tensor]], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one untimed call (tracing and
    compiling)."""
    block(fn())  # traces and compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def net_seconds(program: Any, baseline: Any, args: tuple[tf.Tensor, ...], repeats: int) -> float:
    """Median seconds of ``program`` minus median seconds of ``baseline``, timed in turns
    (at least 0)."""
    block(program(*args))
    block(baseline(*args))
    mine, base = [], []
    for _ in range(repeats):
        mine.append(run_seconds(program, args))
        base.append(run_seconds(baseline, args))
    return max(0.0, statistics.median(mine) - statistics.median(base))
