"""A flag-free training loop: a frozen config in, a trained pipeline and its history out."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import keras

from hybrid import data, models
from hybrid.mesh import DeviceMesh, parse_spec
from hybrid.pipeline import Pipeline

__all__ = ["TrainConfig", "TrainResult", "train"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs.

    Attributes:
      mesh: mesh spec, e.g. "stage:2;replica:2".
      micro_batches: micro-batches per replica per step.
      schedule: pipeline schedule name.
      virtual_stages: model stages per device (interleaved schedule).
      remat: "never", "except_last" or "always".
      global_batch_size: examples per step over all replicas.
      train_steps: optimizer steps to run.
      learning_rate: Adam learning rate.
      seed: initial weights and data.
      width, depth, features, num_classes: the MLP and its synthetic task.
      jit_compile: XLA-compile the stage programs.
      log_every: report every this many steps.
    """

    mesh: str = "stage:2;replica:2"
    micro_batches: int = 4
    schedule: str = "gpipe"
    virtual_stages: int = 1
    remat: str = "except_last"
    global_batch_size: int = 256
    train_steps: int = 40
    learning_rate: float = 3e-3
    seed: int = 0
    width: int = 256
    depth: int = 4
    features: int = 64
    num_classes: int = 10
    jit_compile: bool = True
    log_every: int = 5


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """The losses per step and the throughput after the first (compiling) step."""

    losses: tuple[float, ...]
    examples_per_second: float
    pipeline: Pipeline


def train(config: TrainConfig, log: Callable[[str], None] = print) -> TrainResult:
    """Trains the MLP on the synthetic teacher task on ``config.mesh``."""
    stages, replicas = parse_spec(config.mesh)
    mesh = DeviceMesh.create(stages, replicas)
    pipe = Pipeline(
        models.mlp(config.num_classes, config.width, config.depth, seed=config.seed),
        mesh=mesh,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.Adam(config.learning_rate),
        micro_batches=config.micro_batches,
        schedule=config.schedule,
        virtual_stages=config.virtual_stages,
        remat=config.remat,
        jit_compile=config.jit_compile,
    )
    batches = data.teacher_batches(
        config.global_batch_size, config.features, config.num_classes, config.seed
    )
    losses: list[float] = []
    timed_start, timed_steps = 0.0, 0
    for step in range(1, config.train_steps + 1):
        x, y = next(batches)
        start = time.perf_counter()
        loss = pipe.train_step(x, y)["loss"]
        elapsed = time.perf_counter() - start
        losses.append(loss)
        if step > 1:  # the first step traces and compiles
            timed_start += elapsed
            timed_steps += 1
        if step == 1:
            devices = [d for row in mesh.devices for d in row]
            log(f"mesh {mesh.spec} devices {devices} balance {pipe.balance}")
        if step % config.log_every == 0 or step == config.train_steps:
            rate = config.global_batch_size * timed_steps / timed_start if timed_steps else 0.0
            log(
                f"step {step:5d}  loss {loss:.4f}  examples/s {rate:9.1f}  "
                f"step_time {elapsed * 1e3:7.1f} ms"
            )
    rate = config.global_batch_size * timed_steps / timed_start if timed_steps else 0.0
    return TrainResult(tuple(losses), rate, pipe)
