"""What one training run needs (``TrainConfig``), as small records, and the one table that
maps the launcher's flat names (its flags, ``run_config.json``'s fields) onto them.

    TrainConfig
      model:      ModelSpec      what is trained: the model, its size, its dtype policy
      data:       DataSpec       what it is trained on: the source, the batch, validation
      optimizer:  OptimizerSpec  how: a Keras optimizer's name, arguments, learning rate
      layout:     Layout         how the step runs on the mesh (Pipeline's layout keywords)
      outputs:    OutputSpec     where it is kept: model_dir, checkpoints, export
      mesh, platform, train_steps, seed, ...: the run's own settings

``FIELDS`` names every leaf once: the flag ``--width`` sets ``config.model.width``,
``TrainConfig.of(width=...)`` builds one from flat names, ``config.flat()`` gives the flat
names back (the run record's form). No TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybrid.core.config import Layout
from hybrid.run.data_sources import BUILTIN_TEXT

__all__ = [
    "FIELDS",
    "DataSpec",
    "ModelSpec",
    "OptimizerSpec",
    "OutputSpec",
    "TrainConfig",
    "execution_conflict",
]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What is trained.

    Attributes:
      name: "transformer", "resnet" or "mlp" (``hybrid.models``), or yours:
        "package.module:fn" (``hybrid.run.user_model``).
      width, depth: model width (d_model, channels, units) and depth (blocks).
      seq_len, num_heads, dropout: the Transformer's context, heads and dropout rate.
      tie_embeddings: the Transformer's output head reads the token embedding matrix.
      precision: the Keras dtype policy the model is built under.
    """

    name: str = "transformer"
    width: int = 64
    depth: int = 2
    seq_len: int = 64
    num_heads: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = False
    precision: str = "float32"


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What the model is trained on.

    Attributes:
      source: "synthetic", "text:PATH", "text:python-docs", "tfrecord:PATTERN" or
        "package.module:fn" (``hybrid.run.data``).
      tfrecord_features, tfrecord_label: a "tfrecord:PATTERN" source's feature spec (JSON)
        and the name of its label feature.
      global_batch_size: examples per step over all replicas.
      validation_data, validation_steps: data in ``source``'s grammar evaluated at the end
        of the run (``fit``'s ``validation_data``; a reference source draws with
        ``seed + 1``), and how many batches of it; None: no validation.
    """

    source: str = "text:" + BUILTIN_TEXT
    tfrecord_features: str | None = None
    tfrecord_label: str = "label"
    global_batch_size: int = 32
    validation_data: str | None = None
    validation_steps: int | None = None


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """How the model is trained.

    Attributes:
      name, config: a Keras optimizer's name and its other arguments (JSON).
      learning_rate: the optimizer's learning rate; a resumed run applies it
        (``hybrid.run.resume``).
    """

    name: str = "adam"
    config: str = "{}"
    learning_rate: float = 3e-3


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """Where the run is kept.

    Attributes:
      model_dir: checkpoints and TensorBoard events; None keeps nothing.
      checkpoint_every: save every this many steps (0: only at the end).
      keep_checkpoints: how many recent checkpoints to keep.
      export_dir: at the end, a SavedModel of the model here and one per stage under
        ``export_dir/stages``; None writes none.
      keras_file: at the end, the trained model saved as this ``.keras`` file; None: none.
      fresh_start: move the model_dir's checkpoints aside (``aside-<time>/``) and start
        from step 1, instead of resuming (or stopping, when none can be restored).
      take_over_lock: take the model_dir's lock even when it names a run on another host.
    """

    model_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    export_dir: str | None = None
    keras_file: str | None = None
    fresh_start: bool = False
    take_over_lock: bool = False


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs.

    Attributes:
      model, data, optimizer, layout, outputs: the records above (``layout``:
        ``Pipeline``'s layout keywords: micro-batches — or "auto" —, schedule, virtual
        stages, remat, balance, deferred weight gradients).
      mesh: mesh spec, e.g. "stage:2;replica:2" (the launcher's "auto" is planned first).
      platform: "cpu", "gpu" or "tpu": the device type the mesh is made of.
      train_steps: the step to train up to (a resumed run continues to it).
      seed: initial weights, data order and random layers.
      jit_compile: XLA-compile the stage programs.
      prefetch: batches prepared on the mesh's devices ahead of the step (0: none).
      boundary_dtype: what crosses a stage boundary in training (``Pipeline``'s
        ``boundary_dtype``: "bfloat16" and "int8" compress, inexactly).
      timeline_every: time every this many steps: per device compute, transfers,
        all-reduce and idle to the log, TensorBoard and a PNG (0: never).
      log_every: log and write TensorBoard scalars every this many steps.
      steps_per_execution: the training steps one call of the traced step runs
        (``compile(steps_per_execution=N)``): the launcher's work after a step (logs,
        checkpoints, the progress bar) then comes every N steps; ``log_every``,
        ``checkpoint_every`` and ``timeline_every`` are multiples of N
        (:func:`execution_conflict`).
      profile_steps: (first, last) steps to capture in a TF profiler trace, or None.
      progress_bar: show Keras's progress bar instead of the log lines.
    """

    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    layout: Layout = Layout(micro_batches=4)
    outputs: OutputSpec = OutputSpec()
    mesh: str = "stage:2;replica:2"
    platform: str = "cpu"
    train_steps: int = 60
    seed: int = 0
    jit_compile: bool = True
    prefetch: int = 2
    boundary_dtype: str = "float32"
    timeline_every: int = 0
    log_every: int = 10
    steps_per_execution: int = 1
    profile_steps: tuple[int, int] | None = None
    progress_bar: bool = False

    @classmethod
    def of(cls, **flat: Any) -> TrainConfig:
        """The config with the flat names given (:data:`FIELDS`), defaults elsewhere.

        Raises:
          TypeError: a name that is not in FIELDS.
        """
        return cls().replace(**flat)

    def replace(self, **flat: Any) -> TrainConfig:
        """This config with the flat names given changed (:data:`FIELDS`).

        Raises:
          TypeError: a name that is not in FIELDS.
        """
        unknown = sorted(set(flat) - set(FIELDS))
        if unknown:
            raise TypeError(f"TrainConfig has no fields {unknown}; the fields: {sorted(FIELDS)}")
        top: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            record, attribute = FIELDS[name]
            if record is None:
                top[attribute] = value
            else:
                nested.setdefault(record, {})[attribute] = value
        for record, changes in nested.items():
            top[record] = dataclasses.replace(getattr(self, record), **changes)
        return dataclasses.replace(self, **top)

    def flat(self) -> dict[str, Any]:
        """Every field by its flat name (the flags' and the run record's form)."""
        return {
            name: getattr(self if record is None else getattr(self, record), attribute)
            for name, (record, attribute) in FIELDS.items()
        }


def execution_conflict(
    steps_per_execution: int, log_every: int, checkpoint_every: int, timeline_every: int
) -> str | None:
    """Why these settings cannot run together, or None: the launcher logs, checkpoints and
    times only at the end of an execution of ``steps_per_execution`` steps, so each period
    must be a multiple of it."""
    periods = {
        "log_every": log_every,
        "checkpoint_every": checkpoint_every,
        "timeline_every": timeline_every,
    }
    off = {name: every for name, every in periods.items() if every % steps_per_execution}
    if not off:
        return None
    shown = ", ".join(f"--{name}={every}" for name, every in off.items())
    return (
        f"--steps_per_execution={steps_per_execution} runs that many steps per call and logs, "
        f"checkpoints and times only after a call; {shown} is not a multiple of it: give "
        f"multiples of {steps_per_execution}, or a --steps_per_execution that divides them"
    )


def _table() -> dict[str, tuple[str | None, str]]:
    """Flat name -> (record, attribute): a record's fields keep their names, but for the
    model's, the data's and the optimizer's name (``--model``, ``--data``, ``--optimizer``,
    ``--optimizer_config``)."""
    renamed = {
        ("model", "name"): "model",
        ("data", "source"): "data",
        ("optimizer", "name"): "optimizer",
        ("optimizer", "config"): "optimizer_config",
    }
    table: dict[str, tuple[str | None, str]] = {}
    defaults = TrainConfig()

    def add(name: str, place: tuple[str | None, str]) -> None:
        if name in table:  # two records' fields would share one flag
            raise TypeError(f"TrainConfig: {place} and {table[name]} are both named {name!r}")
        table[name] = place

    for field in dataclasses.fields(TrainConfig):
        default = getattr(defaults, field.name)
        if dataclasses.is_dataclass(default):
            for inner in dataclasses.fields(default):
                key = (field.name, inner.name)
                add(renamed.get(key, inner.name), key)
        else:
            add(field.name, (None, field.name))
    return table


FIELDS = _table()
"""Flat name -> (record, or None for TrainConfig's own field; attribute)."""
