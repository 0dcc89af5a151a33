"""A global batch as the pipeline takes it: checked against the run, and split into each
replica's micro-batches.

    x[B, ...] -> R contiguous shards -> M micro-batches each: parts[r][m] has B / (R·M) rows

The first split is made before the step (``shards``: on the host, or by ``feed.py`` ahead of
the step, which copies each shard onto its replica's devices); the step splits each shard into
micro-batches on the device that reads them (``micro_inputs``, ``micro_labels``).

A model with several inputs takes them as the structure it was built with (a dict by name,
a list); the engine handles them flat, in ``keras.tree.flatten`` order (``model.inputs``).

Labels travel with their sample weights as ``(y, sample_weight, valid)`` to the last stage.
A batch that does not split into R·M equal parts (the last batch of a dataset) is padded with
copies of its first example, and ``valid`` (1 per real example, 0 per padding one) keeps the
padding out of the loss, its gradient and the metrics: the step is that of the real examples
alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from hybrid.core.config import RunConfig, check_global_batch
from hybrid.engine.model.graph import Graph
from hybrid.engine.model.layer_checks import layer_names
from hybrid.engine.step.stage import Labels, StageReplica, TensorSpec

__all__ = [
    "Shard",
    "batch_of",
    "examples",
    "flat",
    "flat_batch",
    "input_specs",
    "joined",
    "pad",
    "padded_size",
    "prepare",
    "micro_inputs",
    "micro_labels",
    "shards",
    "structured",
    "warn_padding",
    "whole_labels",
]


def input_specs(input_shape: Any, dtype: Any) -> list[TensorSpec]:
    """Each model input's spec from a shape (with the batch dimension) or a list of shapes,
    and a dtype or a list of dtypes."""
    several = isinstance(input_shape, (list, tuple)) and any(
        isinstance(d, (list, tuple)) for d in input_shape
    )
    shapes = list(input_shape) if several else [input_shape]
    dtypes = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype] * len(shapes)
    return [
        TensorSpec(tuple(shape[1:]), tf.as_dtype(d).name)
        for shape, d in zip(shapes, dtypes, strict=True)
    ]


def batch_of(input_shape: Any) -> int | None:
    """The batch size an input shape (or a list of them, one per input) gives, or None."""
    several = isinstance(input_shape[0], (list, tuple))
    batch = (input_shape[0] if several else input_shape)[0]
    return batch if isinstance(batch, int) else None


def flat_batch(
    graph: Graph, x: Any, y: Any = None, sample_weight: Any = None
) -> tuple[list[tf.Tensor], list[tf.Tensor] | None, list[tf.Tensor] | None]:
    """Inputs, labels and sample weights (one array for every output, or one per output)
    as flat lists in the order of ``graph``'s inputs and outputs."""
    xs = flat(x, len(graph.inputs), graph.input_names, "inputs")
    count, names = len(graph.outputs), graph.output_names
    ys = None if y is None else flat(y, count, names, "labels")
    ws = None
    if sample_weight is not None:
        ws = flat(sample_weight, count, names, "sample weights", shared=True)
    return xs, ys, ws


def structured(outputs: list[Any], names: tuple[str, ...] | None) -> Any:
    """Flat outputs as the model returns them: one, a list, or a dict by output name."""
    if names is not None:
        return dict(zip(names, outputs, strict=True))
    return outputs[0] if len(outputs) == 1 else outputs


def flat(
    value: Any, count: int, names: tuple[str, ...] | None, what: str, shared: bool = False
) -> list[tf.Tensor]:
    """The ``count`` model inputs (or labels, sample weights) in ``value`` as a flat list.

    Args:
      value: one array, a list/tuple of arrays, or a dict of arrays by name.
      names: the model's input (output) names when it takes (returns) a dict, else None.
      what: "inputs", "labels" or "sample weights", for the error message.
      shared: one array stands for every entry (sample weights for every output).

    Raises:
      ValueError: ``value`` does not match the model's inputs (outputs).
    """
    if isinstance(value, dict):
        if names is None or sorted(value) != list(names):
            expected = f"named {list(names)}" if names else f"as {count} array(s), not a dict"
            raise ValueError(f"the model takes {what} {expected}, got a dict of {sorted(value)}")
        parts = [value[name] for name in names]
    elif isinstance(value, (list, tuple)) and count > 1:
        parts = list(value)
    elif names is not None and not shared and count > 1:
        raise ValueError(
            f"the model takes a dict of {what} named {list(names)}, got {type(value).__name__}"
        )
    else:
        parts = [value] * (count if shared else 1)
    if len(parts) != count:
        raise ValueError(f"the model takes {count} {what}, got {len(parts)}")
    return [tf.convert_to_tensor(p) for p in parts]


def padded_size(config: RunConfig, n: int) -> int:
    """The examples a batch of ``n`` is padded to: the next multiple of R·M."""
    parts = config.replicas * config.micro_batches
    return -(-n // parts) * parts


def pad(
    config: RunConfig,
    xs: list[tf.Tensor],
    ys: list[tf.Tensor] | None,
    ws: list[tf.Tensor] | None,
    to: int | None = None,
) -> tuple[list[tf.Tensor], list[tf.Tensor] | None, list[tf.Tensor] | None, tf.Tensor | None]:
    """The batch padded to ``to`` examples (default: the next multiple of R·M; a batch of
    that size is left as it is) with copies of its first example, and ``valid`` (None when
    not padded). Copies, not zeros: an all-zero example can make a loss 0/0 (token ids 0
    that a mask hides entirely), and 0 · NaN is NaN even where ``valid`` is 0.

    Raises:
      ValueError: ``to`` is smaller than the batch or not a multiple of R·M.
    """
    n, parts = int(xs[0].shape[0]), config.replicas * config.micro_batches
    target = to if to is not None else padded_size(config, n)
    if target % parts or target < n:
        raise ValueError(
            f"cannot pad a batch of {n} examples to {target}: not a multiple of {parts}"
        )
    if target == n:
        return xs, ys, ws, None

    def padded(t: tf.Tensor) -> tf.Tensor:
        t = tf.convert_to_tensor(t)
        if t.shape.rank == 0 or int(t.shape[0]) != n:
            return t  # the shape check in prepare() names it
        return tf.concat([t, tf.repeat(t[:1], target - n, axis=0)], axis=0)

    valid = tf.concat([tf.ones([n]), tf.zeros([target - n])], axis=0)
    return (
        [padded(x) for x in xs],
        None if ys is None else [padded(y) for y in ys],
        None if ws is None else [padded(w) for w in ws],
        valid,
    )


def warn_padding(parts: Sequence[Shard], stages: Sequence[StageReplica], training: bool) -> None:
    """Warns when the batch ``parts`` holds padding examples and they reach layers whose
    effect depends on the whole batch in this step: BatchNormalization's statistics (in
    training only: inference normalizes with the moving statistics), activity regularizers
    and ``add_loss`` (in any step that computes the loss). The loss and gradients of the
    real examples stay exact only without them; a prediction is never affected."""
    if all(shard.valid is None for shard in parts):
        return
    layers = [layer.name for stage in stages for layer, _ in stage.norms] if training else []
    layers += [layer.name for stage in stages for layer in stage.regularized]
    if layers:
        warnings.warn(
            "a partial batch is padded with copies of its first example to split into equal "
            f"micro-batches; layers {layer_names(sorted(set(layers)))} see them "
            "(BatchNormalization statistics in training, activity regularizers, add_loss), so "
            "this "
            f"{'step' if training else 'evaluation'} differs from Keras's on the partial "
            "batch: use a batch size that divides the data (or drop_remainder) to avoid it",
            stacklevel=3,
        )


Flat = list[tf.Tensor]  # one tensor per model input (labels, sample weights: per output)


class Shard(NamedTuple):
    """One replica's contiguous part of a global batch: its inputs (one tensor per model
    input), labels and sample weights (one per output, or None) and which examples are real
    (None: all of them)."""

    xs: list[tf.Tensor]
    ys: list[tf.Tensor] | None
    ws: list[tf.Tensor] | None
    valid: tf.Tensor | None


Shards = list[Shard]  # the global batch, one shard per replica


def shards(
    config: RunConfig,
    xs: list[tf.Tensor],
    ys: list[tf.Tensor] | None,
    ws: list[tf.Tensor] | None,
    valid: tf.Tensor | None,
) -> list[Shard]:
    """The (checked, padded) global batch cut into the R replicas' contiguous shards."""
    return _split(Shard(xs, ys, ws, valid), config.replicas)


def _split(part: Shard, n: int) -> list[Shard]:
    """``part`` cut into ``n`` contiguous equal parts: every tensor split along the batch."""
    xs, ys, ws = _cut(part.xs, n), _cut(part.ys, n), _cut(part.ws, n)
    valid = _cut([part.valid], n) if part.valid is not None else None
    return [
        Shard(
            xs[i],  # type: ignore[index]
            ys[i] if ys is not None else None,
            ws[i] if ws is not None else None,
            valid[i][0] if valid is not None else None,
        )
        for i in range(n)
    ]


def _cut(tensors: list[tf.Tensor] | None, n: int) -> list[list[tf.Tensor]] | None:
    """``pieces[i]``: the i-th of ``n`` contiguous equal parts of every tensor (None: None)."""
    if tensors is None:
        return None
    each = [tf.split(t, n) if n > 1 else [t] for t in tensors]
    return [[parts[i] for parts in each] for i in range(n)]


def examples(parts: Sequence[Shard]) -> tf.Tensor:
    """How many real examples the (possibly padded) batch has."""
    if parts[0].valid is None:
        return tf.add_n([tf.shape(p.xs[0])[0] for p in parts])
    return tf.cast(tf.add_n([tf.reduce_sum(p.valid) for p in parts]), tf.int32)


def whole_labels(parts: Sequence[Shard]) -> tuple[list[tf.Tensor] | None, list[tf.Tensor] | None]:
    """The global batch's labels and sample weights (per output) from its shards, in
    example order (the padding last)."""
    ys = joined([p.ys or [] for p in parts]) if parts[0].ys is not None else None
    ws = joined([p.ws or [] for p in parts]) if parts[0].ws is not None else None
    return ys, ws


def joined(parts: list[list[tf.Tensor]]) -> list[tf.Tensor] | None:
    """Each output's pieces (``parts[i]``: piece i, one tensor per output, in example
    order) concatenated into the batch's; None when the pieces carry no outputs."""
    if not parts or not parts[0]:
        return None
    return [tf.concat(list(pieces), axis=0) for pieces in zip(*parts, strict=True)]


def prepare(
    config: RunConfig,
    xs: list[tf.Tensor],
    ys: list[tf.Tensor] | None = None,
    weights: list[tf.Tensor] | None = None,
) -> tuple[list[tf.Tensor], list[tf.Tensor] | None, list[tf.Tensor] | None]:
    """``(xs, ys, weights)`` after checking they describe one global batch.

    Raises:
      ConfigError: the batch does not split into R × M equal parts.
      ValueError: inputs, labels or sample weights have different numbers of examples, or
        sample weights come without labels.
    """
    batch = int(xs[0].shape[0])
    check_global_batch(config, batch)
    xs = [_examples(x, batch, f"input {i}") for i, x in enumerate(xs)]
    if ys is not None:
        ys = [_examples(y, batch, "y") for y in ys]
    if weights is not None:
        if ys is None:
            raise ValueError("sample_weight needs labels y to weigh the loss of")
        weights = [_examples(w, batch, "sample_weight") for w in weights]
    return xs, ys, weights


def _examples(t: tf.Tensor, batch: int, name: str) -> tf.Tensor:
    if t.shape.rank == 0 or int(t.shape[0]) != batch:
        raise ValueError(f"x has {batch} examples but {name} has shape {tuple(t.shape)}")
    return t


def micro_inputs(
    config: RunConfig, parts: Sequence[Shard], devices: Sequence[str]
) -> list[list[list[tf.Tensor]]]:
    """``inputs[r][m]``: micro-batch m of replica r, one tensor per model input, split on
    ``devices[r]`` (the device of the replica's first stage)."""
    out = []
    for part, device in zip(parts, devices, strict=True):
        with tf.device(device):
            out.append(_cut(part.xs, config.micro_batches))
    return out  # type: ignore[return-value]


def micro_labels(
    config: RunConfig, parts: Sequence[Shard], devices: Sequence[str]
) -> list[list[Labels]]:
    """``labels[r][m]``: micro-batch m's (labels, sample weights or None, valid or None) on
    replica r, labels and sample weights a list with one tensor per model output, split on
    ``devices[r]`` (the device of the replica's last stage)."""
    out = []
    for part, device in zip(parts, devices, strict=True):
        if part.ys is None:
            raise ValueError("labels are needed for the loss")
        with tf.device(device):
            pieces = _split(part._replace(xs=[]), config.micro_batches)
        out.append([(p.ys, p.ws, p.valid) for p in pieces])
    return out
