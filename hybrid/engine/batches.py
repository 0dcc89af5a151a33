"""A global batch as the pipeline takes it: checked against the run, and split into each
replica's micro-batches.

    x[B, ...] -> R contiguous shards -> M micro-batches each: parts[r][m] has B / (R·M) rows

Labels travel with their sample weights as ``(y, sample_weight)`` pairs to the last stage.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hybrid.core.config import RunConfig, check_global_batch

__all__ = ["labels", "prepare", "split"]


def prepare(
    config: RunConfig, x: tf.Tensor, y: Any = None, sample_weight: Any = None
) -> tuple[tf.Tensor, tf.Tensor | None, tf.Tensor | None]:
    """``(x, y, sample_weight)`` as tensors, after checking they describe one global batch.

    Raises:
      ConfigError: the batch does not split into R × M equal parts.
      ValueError: y or the sample weights have another number of examples than x, or
        sample weights come without labels.
    """
    batch = int(x.shape[0])
    check_global_batch(config, batch)
    if y is not None:
        y = _examples(tf.convert_to_tensor(y), batch, "y")
    if sample_weight is not None:
        if y is None:
            raise ValueError("sample_weight needs labels y to weigh the loss of")
        sample_weight = _examples(tf.convert_to_tensor(sample_weight), batch, "sample_weight")
    return x, y, sample_weight


def _examples(t: tf.Tensor, batch: int, name: str) -> tf.Tensor:
    if t.shape.rank == 0 or int(t.shape[0]) != batch:
        raise ValueError(f"x has {batch} examples but {name} has shape {tuple(t.shape)}")
    return t


def split(config: RunConfig, t: tf.Tensor) -> list[list[tf.Tensor]]:
    """``parts[r][m]``: micro-batch m of replica r's contiguous shard of ``t``."""
    R, M = config.replicas, config.micro_batches
    pieces = tf.split(t, R * M)
    return [pieces[r * M : (r + 1) * M] for r in range(R)]


def labels(
    config: RunConfig, y: tf.Tensor, sample_weight: tf.Tensor | None
) -> list[list[tuple[tf.Tensor, tf.Tensor | None]]]:
    """``labels[r][m]``: micro-batch m's (labels, sample weights or None) on replica r."""
    ys = split(config, y)
    if sample_weight is None:
        return [[(part, None) for part in row] for row in ys]
    ws = split(config, sample_weight)
    return [list(zip(y_row, w_row, strict=True)) for y_row, w_row in zip(ys, ws, strict=True)]
