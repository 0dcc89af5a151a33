"""What a run would be, without running it (``hybrid-train --dry_run``)::

    pipe = the run's Pipeline, built on its mesh (nothing compiled, trained or written)
    print pipe.summary()                      # the stages table
    profile = the model's layers measured at the run's micro-batch size (hybrid.planning)
    print evaluate(profile, the run's configuration)   # step time, bubble, memory per device

Your own model (``--model=package.module:fn``) is profiled as the layer calls the Pipeline
cuts (:func:`hybrid.planning.costs.profile_model`); one the planner cannot profile (a
subclassed model, several outputs, an open input dimension) is summarised, not profiled,
and the line says why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hybrid import planning as planner
from hybrid.planning.report import format_bytes, format_time
from hybrid.run.train_config import TrainConfig
from hybrid.run.trainer import mesh_for, pipeline_for
from hybrid.run.user_model import optimizer_for, profiled_layers

__all__ = ["dry_run"]


def dry_run(
    config: TrainConfig,
    log: Callable[[str], None] = print,
    planned: planner.Prediction | None = None,
) -> planner.Prediction | None:
    """Prints the run's stages table and (for a reference model) the planner's prediction
    of its step time, bubble and memory per device; returns the prediction (None when the
    model is yours). ``planned``: the prediction of the plan that chose this run
    (``--mesh=auto``), printed as it is, not profiled again: one prediction per run."""
    pipe, _, _ = pipeline_for(config, mesh_for(config))
    spec = config.mesh.replace(";", ",")
    log(f"dry run of --mesh={spec}: nothing is trained or written")
    pipe.summary(print_fn=log)
    if planned is not None:
        log(f"predicted (the plan's): {_predicted(planned)}")
        return planned
    profiled = profiled_layers(config)
    R, M = pipe.mesh.num_replicas, pipe.micro_batches
    rows = max(1, config.data.global_batch_size // (R * M))
    try:
        profile = planner.profile_model(
            profiled.model,
            profiled.input_shape,
            profiled.input_dtype,
            [rows],
            x=profiled.x,
            loss=profiled.loss,
            optimizer=lambda: optimizer_for(config),
            repeats=3,
            verbose=1,
        )
    except ValueError as err:  # a model the planner cannot profile
        log(f"predicted step time and memory: not for this model: {err}")
        return None
    run = dataclasses.replace(pipe.config, balance=tuple(pipe.balance))
    hardware = planner.host_hardware(pipe.mesh.size, verbose=1)  # as hybrid.plan's
    slots = planner.search.slots_of(lambda: optimizer_for(config))
    prediction = planner.evaluate(profile, run, config.data.global_batch_size, hardware, slots)
    log(f"predicted (profiled at {rows} rows per micro-batch): {_predicted(prediction)}")
    return prediction


def _predicted(prediction: planner.Prediction) -> str:
    """Step time, bubble and memory per pipeline device, in one line."""
    memory = ", ".join(
        f"device {d} {format_bytes(m)}" for d, m in enumerate(prediction.memory_per_device)
    )
    return (
        f"{format_time(prediction.step_time)} per step, bubble {prediction.bubble:.1%}; "
        f"memory per pipeline device: {memory}"
    )
