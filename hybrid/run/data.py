"""Input pipelines: ``tf.data`` datasets whose batch for step i depends only on (seed, i).

    dataset(spec, model, batch, seed, start_step=k)  yields  batch(k+1), batch(k+2), …

Every batch is drawn with stateless random ops keyed on (seed, step), so the data order is
deterministic and a job resumed from a checkpoint at step k continues with exactly the
batches an uninterrupted run would have seen, on any mesh: the checkpoint stores the data
position (the step) and nothing else about the input.

Sources (``spec``):
  ``synthetic``            a learnable synthetic task for the model: a fixed random teacher
                           network labels Gaussian inputs (mlp, resnet); arithmetic token
                           sequences the model must continue (transformer).
  ``text:PATH``            byte-level language modelling on a text file: random windows of
                           ``seq_len + 1`` bytes, the model predicts each next byte.
  ``text:python-docs``     the same on the Python reference manual that ships inside every
                           CPython (``pydoc_data.topics``, ~0.5 MB of English): real text
                           that exists on every machine, so the demo trains offline.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from hybrid.run.data_sources import BUILTIN_TEXT, VOCAB_SIZE, check_source, parse_features

__all__ = ["BUILTIN_TEXT", "VOCAB_SIZE", "dataset", "load_text", "tfrecord_dataset"]


def load_text(path: str) -> np.ndarray:
    """The bytes of a text source as uint8 token ids (``python-docs``: the Python manual)."""
    if path == BUILTIN_TEXT:
        from pydoc_data.topics import topics  # part of CPython's standard library

        raw = "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    else:
        with open(path, "rb") as f:
            raw = f.read()
    return np.frombuffer(raw, dtype=np.uint8)


BatchFn = Callable[[tf.Tensor], tuple[tf.Tensor, tf.Tensor]]


def _step_seed(seed: int, step: tf.Tensor, stream: int = 0) -> tf.Tensor:
    return tf.stack([tf.constant(seed, tf.int64), step * 4 + stream])


def _text_batches(corpus: np.ndarray, batch: int, seq_len: int, seed: int) -> BatchFn:
    if corpus.size < seq_len + 2:
        raise ValueError(
            f"the text has {corpus.size} bytes, fewer than seq_len + 2 = {seq_len + 2}; use a "
            "longer text or a shorter seq_len"
        )
    tokens = tf.constant(corpus.astype(np.int32))
    last_start = corpus.size - seq_len - 1

    def make(step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        starts = tf.random.stateless_uniform(
            [batch], _step_seed(seed, step), minval=0, maxval=last_start + 1, dtype=tf.int64
        )
        index = starts[:, None] + tf.range(seq_len + 1, dtype=tf.int64)[None, :]
        windows = tf.gather(tokens, index)
        return windows[:, :-1], windows[:, 1:]

    return make


def _token_batches(batch: int, seq_len: int, seed: int) -> BatchFn:
    """Sequences ``(start + i·stride) mod 256``: the model infers the stride from context."""

    def make(step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        start = tf.random.stateless_uniform(
            [batch, 1], _step_seed(seed, step, 0), maxval=VOCAB_SIZE, dtype=tf.int32
        )
        stride = tf.random.stateless_uniform(
            [batch, 1], _step_seed(seed, step, 1), minval=1, maxval=8, dtype=tf.int32
        )
        seq = (start + stride * tf.range(seq_len + 1)[None, :]) % VOCAB_SIZE
        return seq[:, :-1], seq[:, 1:]

    return make


def _teacher_batches(
    batch: int, input_shape: tuple[int, ...], num_classes: int, seed: int
) -> BatchFn:
    """x ~ N(0, 1); y = argmax of a fixed random two-layer teacher on x (pooled for images)."""
    rng = np.random.default_rng(seed)
    pooled = input_shape[-1] if len(input_shape) == 3 else int(np.prod(input_shape))
    hidden = tf.constant(rng.normal(size=(pooled, 4 * num_classes)).astype("float32"))
    head = tf.constant(rng.normal(size=(4 * num_classes, num_classes)).astype("float32"))

    def make(step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        x = tf.random.stateless_normal((batch, *input_shape), _step_seed(seed, step))
        features = tf.reduce_mean(x, axis=(1, 2)) if len(input_shape) == 3 else x
        features = tf.reshape(features, [batch, pooled])
        y = tf.argmax(tf.tanh(features @ hidden) @ head, axis=1, output_type=tf.int32)
        return x, y

    return make


def dataset(
    spec: str,
    model: str,
    global_batch: int,
    seed: int = 0,
    start_step: int = 0,
    *,
    seq_len: int = 64,
    input_shape: tuple[int, ...] = (64,),
    num_classes: int = 10,
) -> tf.data.Dataset:
    """Endless (x, y) global batches for steps ``start_step + 1, start_step + 2, …``.

    Args:
      spec: the data source (see the module docstring).
      model: "transformer" reads token windows; "mlp" and "resnet" read ``input_shape``
        features or images with ``num_classes`` labels (synthetic only).
      global_batch: examples per step.
      seed: fixes the teacher and every batch.
      start_step: steps already taken (the data position of a restored checkpoint).

    Raises:
      ValueError: a text source for a model that does not read tokens, or a bad spec.
    """
    source = check_source(spec, model)
    if model == "transformer":
        if source.kind == "text":
            make = _text_batches(load_text(source.path), global_batch, seq_len, seed)
        else:
            make = _token_batches(global_batch, seq_len, seed)
    else:
        make = _teacher_batches(global_batch, tuple(input_shape), num_classes, seed)
    steps = tf.data.Dataset.range(start_step + 1, np.iinfo(np.int64).max)
    return steps.map(make).prefetch(2)


def tfrecord_dataset(
    pattern: str, features: str, label: str, global_batch: int, start_step: int = 0
) -> tf.data.Dataset:
    """Endless (x, y) global batches of the ``tf.train.Example`` records in the files matching
    ``pattern``, read in sorted file order and repeated, so batch i is the same on every run
    (a resumed run skips the ``start_step`` batches already taken).

    Args:
      features: the JSON feature spec (``hybrid.run.data_sources.parse_features``); ``label`` is
        y, the other features are x: one tensor, or a dict by name when there are several.

    Raises:
      ValueError: no file matches, or a bad feature spec.
    """
    spec = parse_features(features, label)
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        raise ValueError(f"no file matches --data=tfrecord:{pattern}")
    parsing = {
        name: tf.io.FixedLenFeature(shape, tf.as_dtype(dtype))
        for name, (dtype, shape) in spec.items()
    }
    inputs = [name for name in spec if name != label]

    def split(records: tf.Tensor) -> tuple[object, tf.Tensor]:
        parsed = tf.io.parse_example(records, parsing)
        x = parsed[inputs[0]] if len(inputs) == 1 else {k: parsed[k] for k in inputs}
        return x, parsed[label]

    records = tf.data.TFRecordDataset(files).repeat()
    batches = records.batch(global_batch, drop_remainder=True).skip(start_step)
    return batches.map(split).prefetch(2)
