"""The pipeline's micro-batch count M: set with everything a step derives from it, or chosen
by measurement (``Pipeline(micro_batches="auto")``).

"auto" chooses at the first batch the pipeline sees (``fit``'s first batch, or the first
``train_step``), on the real model, mesh, schedule and remat, as::

    n = examples per replica of that batch
    for M in the divisors of n up to MAX_AUTO that the schedule accepts:
        use M; time the gradient step on this batch (compile once, then best of REPEATS)
    use the fastest M

The gradient step (``Pipeline.gradients``) is the whole schedule with its all-reduces and
no optimizer update: it changes no weight, optimizer state, step counter, random stream,
BatchNormalization statistic or metric, so choosing leaves the model as it was. M's one
cost that it leaves out, the update, is the same for every M. The choice follows the
clock: two runs may choose differently, which changes nothing that is exact, but does
change what depends on M (BatchNormalization's per-micro-batch statistics, the random
stream of dropout, which is drawn per micro-batch).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any

import tensorflow as tf
from absl import logging

from hybrid.core import schedule as schedule_lib
from hybrid.core.config import ConfigError, RunConfig, least_micro_batches, validate_run
from hybrid.engine.step import assembly

if TYPE_CHECKING:
    from hybrid.engine.api.pipeline import Pipeline

__all__ = [
    "AUTO",
    "MAX_AUTO",
    "REPEATS",
    "candidates",
    "choose_micro_batches",
    "initial_micro_batches",
    "use_micro_batches",
]

AUTO = "auto"
MAX_AUTO = 16  # the most micro-batches "auto" tries
REPEATS = 3  # timed gradient steps per candidate, after its compiling one


def initial_micro_batches(micro_batches: int | str, schedule: str, stages: int) -> int:
    """The M a pipeline is built with: the given count, or for "auto" the fewest the
    schedule runs (``least_micro_batches``) until the first batch chooses.

    Raises:
      ValueError: a string other than "auto".
    """
    if isinstance(micro_batches, str):
        if micro_batches != AUTO:
            raise ValueError(
                f"micro_batches={micro_batches!r}: give a positive integer, or 'auto' to "
                "time the candidates on the first batch and keep the fastest"
            )
        return least_micro_batches(schedule, stages)
    return micro_batches


def use_micro_batches(pipe: Pipeline, micro_batches: int) -> None:
    """Sets the pipeline's M and everything a step derives from it: the validated config,
    the training and forward-only schedules and their execution orders, each stage copy's
    accumulation and activity-regularizer scale, and fresh step functions."""
    config = pipe.config = validate_run(
        dataclasses.replace(pipe.config, micro_batches=micro_batches)
    )
    pipe.micro_batches = M = micro_batches
    S, v = pipe.mesh.num_stages, config.virtual_stages
    pipe.schedule = schedule_lib.validate(schedule_lib.get(config.schedule, S, M, v))
    pipe._order = schedule_lib.execution_order(pipe.schedule)
    pipe._fused = schedule_lib.pairs_to_fuse(pipe.schedule)
    pipe._inference = schedule_lib.forward_only(S, M, v)
    pipe._inference_order = schedule_lib.execution_order(pipe._inference)
    assembly.split_batch(pipe.stages, pipe.mesh.num_replicas, M, config.defer_weight_gradients)
    # fresh step functions: a traced step has M in its graph
    pipe._train = tf.function(pipe._train_step, autograph=False)
    pipe._timed = tf.function(functools.partial(pipe._train_step, record=True), autograph=False)
    pipe._grads = tf.function(pipe._gradient_step, autograph=False)
    pipe._eval = tf.function(pipe._eval_step, autograph=False)
    pipe._predict = tf.function(pipe._predict_step, autograph=False)


def candidates(config: RunConfig, examples: int) -> list[int]:
    """Every M up to :data:`MAX_AUTO` that splits ``examples`` per replica evenly and that
    ``config``'s schedule accepts."""
    per_replica = max(1, examples // config.replicas)
    found = []
    for M in range(1, min(MAX_AUTO, per_replica) + 1):
        if per_replica % M:
            continue
        try:
            validate_run(dataclasses.replace(config, micro_batches=M, global_batch=None))
        except ConfigError:
            continue
        found.append(M)
    return found


def choose_micro_batches(pipe: Pipeline, xs: Any, ys: Any, ws: Any) -> dict[int, float]:
    """Times the gradient step on this batch (flat inputs, labels, sample weights) at every
    candidate M, keeps the fastest in ``pipe`` and returns the seconds of each.

    Raises:
      ValueError: the batch is too small for any M the schedule accepts.
    """
    examples = int(xs[0].shape[0])
    found = candidates(pipe.config, examples)
    if not found:
        raise ValueError(
            f"micro_batches='auto': a first batch of {examples} examples on "
            f"{pipe.config.replicas} replicas leaves no micro-batch count that the "
            f"{pipe.config.schedule!r} schedule accepts; give micro_batches explicitly"
        )
    seconds = {}
    for M in found:
        use_micro_batches(pipe, M)
        parts = pipe._shards(xs, ys, ws)
        pipe._grads(parts)  # traces and compiles this M's programs
        runs = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            float(pipe._grads(parts)[0])  # returns once the whole step has run
            runs.append(time.perf_counter() - start)
        seconds[M] = min(runs)
    best = min(seconds, key=lambda m: (seconds[m], m))
    use_micro_batches(pipe, best)
    placeholder = least_micro_batches(pipe.config.schedule, pipe.mesh.num_stages)
    if pipe.config.replicas * placeholder == 1:  # else the build warned of R·M > 1 already
        assembly.warn_parts(pipe.stages, pipe.config.replicas, best, int(xs[0].shape[0]))
    timings = ", ".join(f"M={m} {1e3 * s:.1f} ms" for m, s in seconds.items())
    logging.info("micro_batches='auto' chose M=%d (gradient step: %s)", best, timings)
    return seconds
