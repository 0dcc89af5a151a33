"""The Keras internals the engine relies on, in one place (``tests/test_keras_private.py``
pins each behaviour, so a Keras upgrade that changes one fails there first).

- ``same_rank``: how ``Loss.__call__`` lines up per-element loss values and sample weights
  (``keras.src.losses.loss.squeeze_or_expand_to_same_rank``).
- ``loss_function``: the ``keras.losses.Loss`` that ``compile`` makes of a plain loss
  function (``keras.src.losses.losses.LossFunctionWrapper``, mean over the batch).
- ``output_mask`` / ``set_mask``: the mask a layer attaches to its output
  (``keras.src.backend``'s ``_keras_mask``), read where a stage ends and set again where
  the next begins.
- ``with_training``: how a functional model passes ``training`` to each layer it calls
  (``keras.src.models.functional.operation_fn``: only to layers whose call takes it).
- ``functional_of`` / ``input_structure`` / ``output_structure``: a Sequential's functional
  graph (``_functional``, there once the Sequential is built) and a functional model's input
  and output structures (``_inputs_struct``, ``_outputs_struct``, which
  ``keras.tree.flatten`` orders as ``model.inputs`` and ``model.outputs``).
- ``batch_norm_moments``: the moments BatchNormalization normalizes with (``_moments``).
- ``batch_norm_moments_from``: a training-mode BatchNormalization call takes its mean and
  variance from ``_moments(inputs, mask)`` and nothing else (the moving-statistics update
  and the normalization read them): a synchronized BatchNormalization's moments are computed
  by the engine's all-reduce inside the stage's program while the layer's own call runs.
- ``set_variable_path``: a variable made outside a layer gets the path of the template
  variable it copies (``_path``), so an optimizer names its slots as for the original.
- ``copy_weight_decay_exclusions``: ``Optimizer.exclude_from_weight_decay`` keeps the
  excluded variables by identity and the name patterns as a regex in private attributes, which
  ``get_config`` does not carry; a copy of the optimizer for a stage's variables gets the
  same exclusions, mapped onto the stage's copies of the variables.
- ``mirror_writes``: every eager write to a ``keras.Variable`` (``assign``, ``assign_add``,
  ``assign_sub``, and what Keras's setters and ``set_weights`` call) ends in its
  ``_direct_assign(value)``; a write inside a ``StatelessScope`` is recorded in the scope
  instead. Wrapping that method on one variable makes its eager writes reach other copies.
- ``tf_variable``: on the TensorFlow backend a ``keras.Variable``'s ``value`` is the
  ``tf.Variable`` that holds it, which Keras's TensorFlow optimizer assigns to (and scatters
  into) directly; a program that takes it as an argument updates that variable.
- ``keep_gradients_local``: under a ``tf.distribute`` strategy, Keras's TensorFlow optimizer
  sums the gradients over the replicas itself before its update
  (``TFOptimizer._all_reduce_sum_gradients``, through the replica context); the engine's
  gradients arrive already reduced, so a copy applied in a replica context must not sum
  them again.
- ``compile_metrics``: the object ``compile(metrics=..., weighted_metrics=...)`` makes
  (``keras.src.trainers.compile_utils.CompileMetrics``): it resolves "accuracy" from the
  shapes of labels and predictions, names each metric (with its output's name on a model
  of several outputs) and updates them as ``fit`` does.
- ``logs_in_order``: the list ``evaluate``, ``train_on_batch`` and ``test_on_batch`` return
  without ``return_dict`` (``Trainer._flatten_metrics_in_order``: the names of
  ``model.metrics`` in order, a ``CompileMetrics`` by its metrics, then the other logs sorted;
  one value alone); ``batch_logs``: the dict ``*_on_batch(return_dict=True)`` returns
  (``keras.src.utils.python_utils.pythonify_logs``: sorted by name); ``class_weights``: the
  sample weights ``class_weight`` gives a batch
  (``data_adapter_utils.class_weight_to_sample_weights``), refused beside sample weights.
- ``epoch_iterator`` / ``unpack_x_y_sample_weight`` / ``train_validation_split``: how
  ``fit``, ``evaluate`` and ``predict`` batch their data (``keras.src.trainers``'
  ``EpochIterator`` over a data adapter: arrays, dicts, ``tf.data``, generators,
  ``PyDataset``; shuffling, ``steps_per_epoch``, ``class_weight``, the partial last batch),
  yielding TensorFlow tensors as Keras's TensorFlow trainer does.
- ``dataset_elements``: a ``tf.data`` iterator made by ``iter(dataset)`` holds its iterator
  resource (``_iterator_resource``), which the ``IteratorGetNext`` op reads one element of
  as a flat list of tensors in ``tf.nest`` order of ``element_spec`` (what ``next`` does,
  with more Python around it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend import get_keras_mask, set_keras_mask
from keras.src.losses.loss import squeeze_or_expand_to_same_rank
from keras.src.losses.losses import LossFunctionWrapper
from keras.src.models.functional import Functional, operation_fn
from keras.src.trainers.compile_utils import CompileMetrics
from keras.src.trainers.data_adapters.array_slicing import (
    train_validation_split as _train_validation_split,
)
from keras.src.trainers.data_adapters.data_adapter_utils import (
    class_weight_to_sample_weights as _class_weight_to_sample_weights,
)
from keras.src.trainers.data_adapters.data_adapter_utils import (
    unpack_x_y_sample_weight as _unpack,
)
from keras.src.trainers.epoch_iterator import EpochIterator
from keras.src.trainers.trainer import Trainer
from keras.src.utils.python_utils import pythonify_logs

__all__ = [
    "batch_norm_moments",
    "batch_norm_moments_from",
    "compile_metrics",
    "epoch_iterator",
    "train_validation_split",
    "unpack_x_y_sample_weight",
    "copy_weight_decay_exclusions",
    "dataset_elements",
    "functional_of",
    "input_structure",
    "loss_function",
    "output_mask",
    "output_structure",
    "same_rank",
    "set_mask",
    "set_variable_path",
    "sublayers",
    "tf_variable",
    "with_training",
]


def with_training(layer: Any, training: bool) -> Callable[..., Any]:
    """``layer``'s ``__call__``, passing ``training`` as a functional model passes it."""
    return operation_fn(layer, training=training)


def sublayers(layer: Any) -> list[Any]:
    """Every layer inside ``layer`` (nested at any depth), ``layer`` itself first."""
    if not isinstance(layer, keras.layers.Layer):
        return []
    return [layer, *layer._flatten_layers(include_self=False)]


def functional_of(model: keras.Model) -> keras.Model | None:
    """The functional graph of ``model`` (itself, or a built Sequential's), or None."""
    if isinstance(model, Functional):
        return model
    return getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else None


def input_structure(model: keras.Model) -> Any:
    """The structure (a tensor, list or dict of inputs) a functional model was built with."""
    return model._inputs_struct


def output_structure(model: keras.Model) -> Any:
    """The structure (a tensor, list or dict) of a functional model's outputs."""
    return model._outputs_struct


def batch_norm_moments(layer: keras.layers.BatchNormalization, x: Any) -> tuple[Any, Any]:
    """The mean and (biased) variance a training-mode BatchNormalization call takes of ``x``."""
    return layer._moments(x, None)


@contextlib.contextmanager
def batch_norm_moments_from(
    layers: Sequence[keras.layers.BatchNormalization], moments: Callable[[Any, Any], Any]
) -> Iterator[None]:
    """Inside: a training call of each of ``layers`` (on a tensor without a mask)
    normalizes with ``moments(inputs, axes)``, a ``(mean, variance)`` pair over the layer's
    reduction ``axes``, instead of its own."""
    for layer in layers:
        object.__setattr__(layer, "_moments", functools.partial(_given, moments, layer))
    try:
        yield
    finally:
        for layer in layers:
            object.__delattr__(layer, "_moments")


def _given(moments: Callable[[Any, Any], Any], layer: Any, inputs: Any, mask: Any) -> Any:
    if mask is not None:
        raise NotImplementedError(f"{layer.name}: the moments of a masked tensor are its own")
    return moments(inputs, layer._reduction_axes)


def set_variable_path(variable: Any, path: str) -> None:
    """Gives ``variable`` the path ``path`` (a template variable's)."""
    variable._path = path


def mirror_writes(variable: Any, also: Callable[[Any], None]) -> None:
    """After every eager write to ``variable`` (not one traced into a function: the
    engine's own programs write each copy themselves), ``also(new value)`` is called. A
    variable mirrored again (a second pipeline of the same model) keeps its one wrapper and
    calls every ``also`` in turn."""
    sinks: list[Callable[[Any], None]] | None = variable.__dict__.get("_hybrid_mirrors")
    if sinks is None:
        sinks = []
        before = variable._direct_assign

        def direct_assign(value: Any) -> None:
            before(value)
            if not tf.inside_function():
                for sink in sinks:
                    sink(variable.value)

        variable._direct_assign = direct_assign
        variable._hybrid_mirrors = sinks
    sinks.append(also)


def tf_variable(variable: Any) -> Any:
    """The ``tf.Variable`` holding ``variable``'s value (``variable`` itself if it is one).

    Raises:
      TypeError: a Keras variable whose value is not a ``tf.Variable`` (another backend).
    """
    found = variable.value if isinstance(variable, keras.Variable) else variable
    if not isinstance(found, tf.Variable):
        name = getattr(variable, "path", type(variable).__name__)
        raise TypeError(f"{name}: its value is a {type(found).__name__}, not a tf.Variable")
    return found


def keep_gradients_local(optimizer: keras.optimizers.Optimizer) -> None:
    """Makes ``optimizer`` (and a LossScaleOptimizer's inner one) apply the gradients it is
    given in a replica context as they are, without summing them over the replicas."""
    for one in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if one is not None and hasattr(one, "_all_reduce_sum_gradients"):
            one._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)


def same_rank(values: Any, weights: Any) -> tuple[Any, Any]:
    """``values`` and ``weights`` with the rank Keras gives them before multiplying."""
    return squeeze_or_expand_to_same_rank(values, weights)


def copy_weight_decay_exclusions(
    source: keras.optimizers.Optimizer,
    target: keras.optimizers.Optimizer,
    source_variables: Sequence[Any],
    target_variables: Sequence[Any],
) -> None:
    """Gives ``target`` (not built yet) the exclusions of ``source``, where
    ``target_variables[i]`` is the copy of ``source_variables[i]``."""
    excluded: set[int] = getattr(source, "_exclude_from_weight_decay", None) or set()
    target._exclude_from_weight_decay = {
        target._var_key(copy)
        for original, copy in zip(source_variables, target_variables, strict=True)
        if source._var_key(original) in excluded
    }
    target._exclude_from_weight_decay_pattern = getattr(
        source, "_exclude_from_weight_decay_pattern", None
    )
    target._exclude_from_weight_decay_cache = {}


def set_mask(tensor: Any, mask: Any) -> None:
    """Attaches ``mask`` to ``tensor`` as a layer attaches its output's mask."""
    set_keras_mask(tensor, mask)


def output_mask(tensor: Any) -> Any:
    """The Keras mask a layer attached to its output, or None."""
    return get_keras_mask(tensor)


def loss_function(fn: Callable[[Any, Any], Any]) -> keras.losses.Loss:
    """``fn(y_true, y_pred)`` (per-example values) as the Loss ``compile`` would use."""
    return LossFunctionWrapper(fn, reduction="sum_over_batch_size")


def compile_metrics(metrics: Any, weighted_metrics: Any, output_names: Any) -> Any:
    """What ``compile(metrics=metrics, weighted_metrics=weighted_metrics)`` makes of them
    (built on the first labels and predictions it sees)."""
    return CompileMetrics(metrics, weighted_metrics, output_names=output_names)


def dataset_elements(dataset: tf.data.Dataset) -> Iterator[Any]:
    """The elements of ``dataset``, in order, as ``iter(dataset)`` yields them; where every
    component is a dense tensor in tuples, lists and dicts, each is read by one
    ``IteratorGetNext`` op of the dataset's own iterator and packed by :func:`_packer`,
    without the iterator's Python (measured here on batches of 2 × 8 floats: 137 µs an
    element through ``next``, 49 µs through the op, the dataset's own work)."""
    iterator = iter(dataset)
    spec = dataset.element_spec
    leaves = tf.nest.flatten(spec)
    pack = _packer(spec)
    resource = getattr(iterator, "_iterator_resource", None)
    if resource is None or pack is None:
        yield from iterator  # ragged, sparse, nested datasets: the iterator unpacks them
        return
    types, shapes = [leaf.dtype for leaf in leaves], [leaf.shape for leaf in leaves]
    while True:
        try:
            flat = tf.raw_ops.IteratorGetNext(
                iterator=resource, output_types=types, output_shapes=shapes
            )
        except tf.errors.OutOfRangeError:
            return
        yield pack(iter(flat))


def _packer(spec: Any) -> Callable[[Iterator[Any]], Any] | None:
    """A function taking the flat components of an element of structure ``spec`` (in
    ``tf.nest`` order: a dict's values by sorted key) to the element, as
    ``tf.nest.pack_sequence_as`` packs them (a dict keeps its own key order); None for a
    structure of anything but dense tensors in tuples, lists and dicts."""
    if type(spec) is tf.TensorSpec:
        return next
    if type(spec) in (tuple, list):
        parts = [_packer(item) for item in spec]
        if None in parts:
            return None
        kind = type(spec)
        return lambda flat: kind([part(flat) for part in parts])  # type: ignore[misc]
    if type(spec) is dict:
        keys = sorted(spec)
        inner = [_packer(spec[key]) for key in keys]
        if None in inner:
            return None
        order = list(spec)

        def pack(flat: Iterator[Any]) -> dict[Any, Any]:
            values = {key: part(flat) for key, part in zip(keys, inner, strict=True)}  # type: ignore[misc]
            return {key: values[key] for key in order}

        return pack
    return None


class _TensorEpochIterator(EpochIterator):  # type: ignore[misc]
    """Keras's epoch iterator yielding TensorFlow tensors (its TensorFlow trainer's), each
    epoch's batches passed through ``feed`` when it is set."""

    feed: Callable[[Any], Any] | None = None
    ran_out = 0  # epochs ended by the data running out (not by reaching their step count)

    _dataset: Any = None

    def _get_iterator(self) -> Any:
        # the dataset built once (as Keras's TensorFlow iterator does): building it costs
        # tens of milliseconds, and Keras asks for an iterator once per epoch and once more
        if self._dataset is None:
            self._dataset = self.data_adapter.get_tf_dataset()
        batches = dataset_elements(self._dataset)
        return batches if self.feed is None else self.feed(batches)

    def __next__(self) -> tuple[int, int, list[Any]]:
        """The next execution's batches: ``steps_per_execution`` of them, fewer where the
        data ends inside it (a short last execution, without Keras's warning that the input
        ran out: its TensorFlow trainer's loop ends there quietly)."""
        begin, end, batches = next(self._epoch_iterator)
        buffer: list[Any] = []
        with self.catch_stop_iteration():
            for _ in range(self.steps_per_execution):
                try:
                    buffer.append(next(batches))
                except StopIteration:
                    if not buffer:
                        raise
                    break
            return begin, end, buffer
        raise StopIteration  # the data ran out before this execution's first batch

    @contextlib.contextmanager
    def catch_stop_iteration(self) -> Iterator[None]:
        """Keras's (which ends the epoch where the data runs out), counting in ``ran_out``
        each time the data ran out before a batch it was asked for."""
        with super().catch_stop_iteration():
            try:
                yield
            except StopIteration:
                self.ran_out += 1
                raise


def logs_in_order(model: Any, logs: dict[str, float]) -> float | list[float]:
    """``logs`` as Keras's ``evaluate`` / ``*_on_batch`` return them without ``return_dict``,
    for a model-like object with Keras's ``metrics``."""
    return Trainer._flatten_metrics_in_order(model, logs)  # type: ignore[no-any-return]


def batch_logs(logs: dict[str, float]) -> dict[str, float]:
    """``logs`` as Keras's ``train_on_batch``/``test_on_batch`` return them (by name)."""
    return pythonify_logs(logs)  # type: ignore[no-any-return]


def class_weights(y: Any, sample_weight: Any, class_weight: Any) -> Any:
    """The batch's sample weights with ``class_weight`` applied, as ``train_on_batch``
    makes them (``sample_weight`` itself without one).

    Raises:
      ValueError: both given (Keras's error).
    """
    if class_weight is None:
        return sample_weight
    if sample_weight is not None:
        raise ValueError(
            "Arguments `sample_weight` and `class_weight` cannot be specified at the same "
            f"time. Received: sample_weight={sample_weight}, class_weight={class_weight}"
        )
    return _class_weight_to_sample_weights(y, class_weight)


def epoch_iterator(**kwargs: Any) -> Any:
    """Keras's iterator over one epoch's batches: ``(first step, last step, [batch])``;
    setting its ``feed`` (a function of an iterator of batches) maps every epoch's
    iterator through it."""
    return _TensorEpochIterator(**kwargs)


def unpack_x_y_sample_weight(data: Any) -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` of one batch as ``fit`` unpacks it."""
    return tuple(_unpack(data))  # type: ignore[return-value]


def train_validation_split(arrays: Any, validation_split: float) -> Any:
    """``fit(validation_split=...)``'s split of arrays: the last fraction for validation."""
    return _train_validation_split(arrays, validation_split=validation_split)
