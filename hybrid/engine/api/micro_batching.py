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
from collections.abc import Callable
from typing import Any

from absl import logging

from hybrid.core import schedule as schedule_lib
from hybrid.core.config import ConfigError, RunConfig, least_micro_batches, validate_run
from hybrid.engine.traced import Traced

__all__ = [
    "AUTO",
    "MAX_AUTO",
    "REPEATS",
    "Steps",
    "best_of",
    "candidates",
    "choose_micro_batches",
    "initial_micro_batches",
    "steps_for",
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


@dataclasses.dataclass(frozen=True)
class Steps:
    """Everything a pipeline's step derives from its micro-batch count M, built in one place
    (:func:`steps_for`) and replaced whole when M changes.

    Attributes:
      config: the run, validated at this M.
      schedule, order, fused: the training schedule, its global execution order and the
        F/B pairs it fuses.
      inference, inference_order: the forward-only schedule and its order.
      train, timed, gradients, evaluate, predict: the traced step functions (one trace per
        input signature; a traced step has M in its graph).
      train_many, evaluate_many: ``train`` and ``evaluate`` on each of a list of batches,
        one function (``compile(steps_per_execution=N)``; one trace per number of batches).
      first_train, first_gradients, first_evaluate, first_predict: the same steps with the
        replicas' programs run replica by replica (``MeshStep.gradients(ordered=True)``,
        ``MeshStep.forward(ordered=True)``), for the first call of each with a persistent
        XLA cache (``compile_cache.FirstStep``).
    """

    config: RunConfig
    schedule: schedule_lib.Schedule
    order: list[schedule_lib.Action]
    fused: Any
    inference: schedule_lib.Schedule
    inference_order: list[schedule_lib.Action]
    # tf.function objects (``get_concrete_function`` traces one without running it)
    train: Any
    timed: Any
    gradients: Any
    evaluate: Any
    predict: Any
    train_many: Any
    evaluate_many: Any
    first_train: Any = None
    first_gradients: Any = None
    first_evaluate: Any = None
    first_predict: Any = None

    @property
    def micro_batches(self) -> int:
        return self.config.micro_batches


def steps_for(
    config: RunConfig,
    micro_batches: int,
    *,
    train: Callable[..., Any],
    gradients: Callable[..., Any],
    evaluate: Callable[..., Any],
    predict: Callable[..., Any],
    train_many: Callable[..., Any],
    evaluate_many: Callable[..., Any],
) -> Steps:
    """The :class:`Steps` of ``config`` at M = ``micro_batches``: the validated config, the
    training and forward-only schedules and their execution orders, and fresh traced
    functions of the step callables (``train(parts, record=False, ordered=False)``,
    ``gradients(parts, ordered=False)``, ``evaluate(parts, ordered=False)``, ...,
    ``train_many(batches)``, ``evaluate_many(batches)``).

    Raises:
      ConfigError: a schedule that does not run ``micro_batches``.
    """
    config = validate_run(dataclasses.replace(config, micro_batches=micro_batches))
    S, M, v = config.stages, micro_batches, config.virtual_stages
    schedule = schedule_lib.validate(schedule_lib.get(config.schedule, S, M, v))
    inference = schedule_lib.forward_only(S, M, v)

    return Steps(
        config=config,
        schedule=schedule,
        order=schedule_lib.execution_order(schedule),
        fused=schedule_lib.pairs_to_fuse(schedule),
        inference=inference,
        inference_order=schedule_lib.execution_order(inference),
        train=Traced(train),
        timed=Traced(functools.partial(train, record=True)),
        gradients=Traced(gradients),
        evaluate=Traced(evaluate),
        predict=Traced(predict),
        train_many=Traced(train_many),
        evaluate_many=Traced(evaluate_many),
        first_train=Traced(functools.partial(train, ordered=True)),
        first_gradients=Traced(functools.partial(gradients, ordered=True)),
        first_evaluate=Traced(functools.partial(evaluate, ordered=True)),
        first_predict=Traced(functools.partial(predict, ordered=True)),
    )


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


def choose_micro_batches(
    config: RunConfig, examples: int, seconds_of: Callable[[int], float]
) -> tuple[int, dict[int, float]]:
    """The fastest candidate M for a first batch of ``examples`` and the seconds of each:
    ``seconds_of(M)`` uses M and returns the best of :data:`REPEATS` timed gradient steps
    (after one that traces and compiles).

    Raises:
      ValueError: the batch is too small for any M the schedule accepts.
    """
    found = candidates(config, examples)
    if not found:
        raise ValueError(
            f"micro_batches='auto': a first batch of {examples} examples on "
            f"{config.replicas} replicas leaves no micro-batch count that the "
            f"{config.schedule!r} schedule accepts; give micro_batches explicitly"
        )
    seconds = {M: seconds_of(M) for M in found}
    best = min(seconds, key=lambda m: (seconds[m], m))
    timings = ", ".join(f"M={m} {1e3 * s:.1f} ms" for m, s in seconds.items())
    logging.info("micro_batches='auto' chose M=%d (gradient step: %s)", best, timings)
    return best, seconds


def best_of(run: Callable[[], Any]) -> float:
    """Seconds of the fastest of :data:`REPEATS` runs of ``run`` after one that compiles
    (``run`` returns once the whole step has run)."""
    run()
    runs = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        runs.append(time.perf_counter() - start)
    return min(runs)
