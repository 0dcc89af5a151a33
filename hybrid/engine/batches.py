"""A global batch as the pipeline takes it: checked against the run, and split into each
replica's micro-batches.

    x[B, ...] -> R contiguous shards -> M micro-batches each: parts[r][m] has B / (R·M) rows

A model with several inputs takes them as the structure it was built with (a dict by name,
a list); the engine handles them flat, in ``keras.tree.flatten`` order (``model.inputs``).

Labels travel with their sample weights as ``(y, sample_weight)`` pairs to the last stage.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hybrid.core.config import RunConfig, check_global_batch

__all__ = ["flat_inputs", "labels", "prepare", "split", "split_inputs"]


def flat_inputs(x: Any, count: int, names: tuple[str, ...] | None) -> list[tf.Tensor]:
    """The model inputs in ``x`` as a flat list of ``count`` tensors.

    Args:
      x: one array, a list/tuple of arrays, or a dict of arrays by input name.
      names: the model's input names when it takes a dict (sorted), else None.

    Raises:
      ValueError: ``x`` does not match the model's inputs.
    """
    if names is not None:
        if not isinstance(x, dict) or sorted(x) != list(names):
            given = sorted(x) if isinstance(x, dict) else type(x).__name__
            raise ValueError(f"the model takes a dict of inputs named {list(names)}, got {given}")
        parts = [x[name] for name in names]
    elif isinstance(x, (list, tuple)) and count > 1:
        parts = list(x)
    else:
        parts = [x]
    if len(parts) != count:
        raise ValueError(f"the model takes {count} inputs, got {len(parts)}")
    return [tf.convert_to_tensor(p) for p in parts]


def prepare(
    config: RunConfig, xs: list[tf.Tensor], y: Any = None, sample_weight: Any = None
) -> tuple[list[tf.Tensor], tf.Tensor | None, tf.Tensor | None]:
    """``(xs, y, sample_weight)`` as tensors, after checking they describe one global batch.

    Raises:
      ConfigError: the batch does not split into R × M equal parts.
      ValueError: inputs, y or the sample weights have different numbers of examples, or
        sample weights come without labels.
    """
    batch = int(xs[0].shape[0])
    check_global_batch(config, batch)
    xs = [_examples(x, batch, f"input {i}") for i, x in enumerate(xs)]
    if y is not None:
        y = _examples(tf.convert_to_tensor(y), batch, "y")
    if sample_weight is not None:
        if y is None:
            raise ValueError("sample_weight needs labels y to weigh the loss of")
        sample_weight = _examples(tf.convert_to_tensor(sample_weight), batch, "sample_weight")
    return xs, y, sample_weight


def _examples(t: tf.Tensor, batch: int, name: str) -> tf.Tensor:
    if t.shape.rank == 0 or int(t.shape[0]) != batch:
        raise ValueError(f"x has {batch} examples but {name} has shape {tuple(t.shape)}")
    return t


def split(config: RunConfig, t: tf.Tensor) -> list[list[tf.Tensor]]:
    """``parts[r][m]``: micro-batch m of replica r's contiguous shard of ``t``."""
    R, M = config.replicas, config.micro_batches
    pieces = tf.split(t, R * M)
    return [pieces[r * M : (r + 1) * M] for r in range(R)]


def split_inputs(config: RunConfig, xs: list[tf.Tensor]) -> list[list[list[tf.Tensor]]]:
    """``parts[r][m]``: micro-batch m of replica r, one tensor per model input."""
    each = [split(config, x) for x in xs]
    R, M = config.replicas, config.micro_batches
    return [[[parts[r][m] for parts in each] for m in range(M)] for r in range(R)]


def labels(
    config: RunConfig, y: tf.Tensor, sample_weight: tf.Tensor | None
) -> list[list[tuple[tf.Tensor, tf.Tensor | None]]]:
    """``labels[r][m]``: micro-batch m's (labels, sample weights or None) on replica r."""
    ys = split(config, y)
    if sample_weight is None:
        return [[(part, None) for part in row] for row in ys]
    ws = split(config, sample_weight)
    return [list(zip(y_row, w_row, strict=True)) for y_row, w_row in zip(ys, ws, strict=True)]
