"""The run's configuration, written beside its checkpoints and compared when it resumes.

``model_dir/run_config.json`` holds every ``TrainConfig`` field, the model's layer summary
(each layer's class, dtype policy and weight shapes), its loss and the library version. A
resumed run compares its own with it::

    a field that changes what is trained (FIXED: the model and its sizes, data, batch,
      optimizer and its config, precision, seed), the layers or the loss   -> refused,
      one line naming each: "--optimizer: adam in the checkpoint, adamw now"
    the learning rate                                                     -> the new value
      applies (the optimizer's variable is set after the restore), logged
    anything else (mesh, micro-batches, schedule, remat, steps, logging, checkpoint
      cadence, outputs)                                                    -> applied, logged

and then writes its own, so the record always describes the newest run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

__all__ = ["FIXED", "RECORD_FILE", "ConfigDriftError", "Changes", "compare", "read", "write"]

RECORD_FILE = "run_config.json"
# TrainConfig fields whose change changes what is trained: refused on resume.
FIXED = (
    "model", "data", "tfrecord_features", "tfrecord_label", "optimizer", "optimizer_config",
    "precision", "seed", "global_batch_size", "width", "depth", "seq_len", "num_heads",
    "dropout", "tie_embeddings",
)  # fmt: skip
# Fields that say how this invocation runs, not what the run is: never reported.
_QUIET = ("model_dir", "fresh_start", "take_over_lock", "progress_bar")


class ConfigDriftError(ValueError):
    """A resumed run whose configuration changes what the checkpoints were trained as."""


def _path(directory: str) -> str:
    return directory.rstrip("/") + "/" + RECORD_FILE


def write(directory: str, config: Mapping[str, Any], layers: list[str], loss: str) -> None:
    """Writes the record of ``config`` (TrainConfig fields as JSON values) atomically."""
    from hybrid import __version__

    record = {"config": dict(config), "layers": layers, "loss": loss, "version": __version__}
    temporary = _path(directory) + ".tmp"
    with tf.io.gfile.GFile(temporary, "w") as f:
        f.write(json.dumps(record, indent=1, sort_keys=True) + "\n")
    tf.io.gfile.rename(temporary, _path(directory), overwrite=True)


def read(directory: str) -> dict[str, Any] | None:
    """The record in ``directory``; None when there is none (or it is not JSON)."""
    if not tf.io.gfile.exists(_path(directory)):
        return None
    try:
        with tf.io.gfile.GFile(_path(directory)) as f:
            record = json.loads(f.read())
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("config"), dict) else None


@dataclasses.dataclass
class Changes:
    """What differs between the recorded run and this one, field by field.

    Attributes:
      refused: one ``--field: old in the checkpoint, new now`` per change that is refused.
      applied: one ``--field: old -> new`` per change that is applied.
      learning_rate: (recorded, now) when the learning rate changed, else None.
    """

    refused: list[str] = dataclasses.field(default_factory=list)
    applied: list[str] = dataclasses.field(default_factory=list)
    learning_rate: tuple[float, float] | None = None


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _first_difference(old: list[str], new: list[str]) -> str:
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        if a != b:
            return f"layer {i}: {a} in the checkpoint, {b} now"
    return f"{len(old)} layers in the checkpoint, {len(new)} now"


def compare(
    record: Mapping[str, Any], config: Mapping[str, Any], layers: list[str], loss: str
) -> Changes:
    """The changes from ``record`` to this run (``config`` as JSON values, its layers and
    loss); :class:`ConfigDriftError` is for the caller to raise on ``refused``."""
    changes = Changes()
    old = record["config"]
    for name, value in config.items():
        if name in _QUIET or name not in old or old[name] == value:
            continue
        if name in FIXED:
            changes.refused.append(
                f"--{name}: {_show(old[name])} in the checkpoint, {_show(value)} now"
            )
        elif name == "learning_rate":
            changes.learning_rate = (float(old[name]), float(value))
        else:
            changes.applied.append(f"--{name}: {_show(old[name])} -> {_show(value)}")
    if not changes.refused and record.get("layers", layers) != layers:
        changes.refused.append(
            f"--model (its layers): {_first_difference(record['layers'], layers)}"
        )
    if record.get("loss", loss) != loss:
        changes.refused.append(
            f"--model (its loss): {record['loss']} in the checkpoint, {loss} now"
        )
    return changes
