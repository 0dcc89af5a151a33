"""The model, loss and optimizer a ``TrainConfig`` names: a reference model
(``hybrid.models``) or yours (``package.module:fn``, whose errors are reported as one line
naming it), a Keras optimizer with its arguments checked before it is made.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import keras
import numpy as np

from hybrid import models
from hybrid.run import data
from hybrid.run.data_sources import is_function_spec

if TYPE_CHECKING:
    from hybrid.run.train_config import TrainConfig

__all__ = [
    "UserFunctionError",
    "build_model",
    "call_user",
    "load_function",
    "model_for",
    "optimizer_class",
    "optimizer_for",
    "Profiled",
    "profiled_layers",
]

_IMAGE_SHAPE = (16, 16, 3)


class UserFunctionError(ValueError):
    """Your ``--model`` or ``--data`` function raised; the message names it and its error."""


def build_model(config: TrainConfig) -> tuple[list[keras.layers.Layer], tuple[int, ...], str]:
    """The reference model's layers, its input shape (without batch) and input dtype."""
    if config.model.name == "transformer":
        layers = models.transformer(
            vocab_size=data.VOCAB_SIZE,
            seq_len=config.model.seq_len,
            d_model=config.model.width,
            num_heads=config.model.num_heads,
            num_blocks=config.model.depth,
            dropout=config.model.dropout,
            seed=config.seed,
            tie_embeddings=config.model.tie_embeddings,
        )
        return layers, (config.model.seq_len,), "int32"
    if config.model.name == "resnet":
        return (
            models.resnet(10, config.model.width, config.model.depth, seed=config.seed),
            _IMAGE_SHAPE,
            ("float32"),
        )
    if config.model.name == "mlp":
        return (
            models.mlp(10, config.model.width, config.model.depth, seed=config.seed),
            (64,),
            "float32",
        )
    raise ValueError(
        f"unknown model {config.model.name!r}; choose one of {list(models.MODEL_NAMES)}"
    )


def load_function(spec: str) -> Callable[..., Any]:
    """The function ``package.module:name`` names (``--model``, ``--data``).

    Raises:
      ValueError: the module cannot be imported or has no such function.
    """
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"{spec}: cannot import {module_name!r} ({err}); is it on PYTHONPATH?"
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"{spec}: module {module_name!r} has no function {name!r}")
    return function


def takes_input_context(spec: str) -> bool:
    """Whether ``spec``'s data function has a parameter ``input_context``: then it is
    built on every input host (``Pipeline.distribute_datasets_from_function``)."""
    return "input_context" in inspect.signature(load_function(spec)).parameters


def call_user(option: str, spec: str, *args: Any, **kwargs: Any) -> Any:
    """``spec``'s function called with ``args`` and ``kwargs``; what it raises becomes a
    one-line :class:`UserFunctionError` naming the option, the function and its own
    message."""
    function = load_function(spec)
    try:
        return function(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the user's code: any error is theirs
        raise UserFunctionError(
            f"--{option}={spec}: your function {function.__name__}() raised "
            f"{type(err).__name__}: {err}"
        ) from err


def _user_model(config: TrainConfig) -> tuple[keras.Model, Any, Any]:
    """Your model, loss and metrics from ``config.model.name`` (``package.module:fn``): fn()
    returns a dict ``{"model", "loss", "metrics"}`` or a model compiled with its loss. Keras's
    seeds are set from ``--seed`` first, so its initial weights are the same in every run."""
    keras.utils.set_random_seed(config.seed)
    made = call_user("model", config.model.name)
    if isinstance(made, dict):
        model, loss, metrics = made.get("model"), made.get("loss"), made.get("metrics")
    else:
        model, loss, metrics = made, getattr(made, "loss", None), None
    if not isinstance(model, keras.Model) or loss is None:
        raise ValueError(
            f"--model={config.model.name} must return a Keras model compiled with its loss, or "
            f"{{'model': ..., 'loss': ..., 'metrics': ...}}; got {type(made).__name__}"
        )
    return model, loss, metrics


def optimizer_class(name: str) -> type:
    """The ``keras.optimizers`` class named ``name``, case-insensitively ("adamw": AdamW)."""
    for attribute, cls in vars(keras.optimizers).items():
        if attribute.lower() == name.lower() and isinstance(cls, type):
            return cls
    raise ValueError(f"keras.optimizers has no optimizer {name!r}")


def optimizer_for(config: TrainConfig) -> keras.optimizers.Optimizer:
    """``--optimizer`` at ``--learning_rate`` with ``--optimizer_config``'s arguments, under
    a LossScaleOptimizer for ``mixed_float16`` (as ``compile`` wraps it: a list of layers
    carries no model policy for the Pipeline to see)."""
    cls = optimizer_class(config.optimizer.name)
    arguments = json.loads(config.optimizer.config)
    _check_optimizer_arguments(cls, arguments, config.optimizer.config)
    made = cls(learning_rate=config.optimizer.learning_rate, **arguments)
    if config.model.precision == "mixed_float16":
        return keras.optimizers.LossScaleOptimizer(made)
    return made


def _check_optimizer_arguments(cls: type, arguments: dict[str, Any], given: str) -> None:
    """Raises ValueError for an argument ``cls`` does not take, or a value whose type is not
    that of the argument's default (a number for a number, a bool for a bool)."""
    accepted: dict[str, Any] = {}
    for source in (cls, keras.optimizers.Optimizer):
        for name, parameter in inspect.signature(source).parameters.items():
            if (
                parameter.kind is parameter.KEYWORD_ONLY
                or parameter.kind is parameter.POSITIONAL_OR_KEYWORD
            ):
                accepted.setdefault(name, parameter.default)
    accepted.pop("learning_rate", None)
    for name, value in arguments.items():
        if name not in accepted:
            raise ValueError(
                f"--optimizer_config={given}: {cls.__name__} has no argument {name!r}; it "
                f"takes {sorted(accepted)}"
            )
        default = accepted[name]
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if (isinstance(default, bool) and not isinstance(value, bool)) or (
            isinstance(default, int | float) and not isinstance(default, bool) and not number
        ):
            raise ValueError(
                f"--optimizer_config={given}: {name}={value!r} is a {type(value).__name__}; "
                f"{cls.__name__} takes a {type(default).__name__} there (default {default!r})"
            )


def model_for(config: TrainConfig) -> tuple[Any, Any, Any, Any, Any]:
    """The config's model built under its dtype policy (the global policy is restored after),
    its loss, metrics, input shape(s) with the batch and dtype(s)."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(config.model.precision)
    try:
        if is_function_spec(config.model.name):
            model, loss, metrics = _user_model(config)
            shapes = _fixed_shapes(config, [(None, *t.shape[1:]) for t in model.inputs])
            dtypes = [t.dtype for t in model.inputs]
            if len(shapes) == 1:
                return model, loss, metrics, shapes[0], dtypes[0]
            return model, loss, metrics, shapes, dtypes
        layers, input_shape, dtype = build_model(config)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    return layers, _reference_loss(), None, (None, *input_shape), dtype


def _fixed_shapes(config: TrainConfig, shapes: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Your model's input shapes (with the batch), each dimension it leaves open (a
    KerasHub model's sequence length) taken from your ``--data`` function's first batch."""
    if not any(None in shape[1:] for shape in shapes):
        return shapes
    x = _first_batch(config)
    flat = keras.tree.flatten(x) if x is not None else []
    if len(flat) != len(shapes):
        return shapes  # the Pipeline's build names what is open
    return [
        (None, *tuple(a.shape[1:])) if None in shape[1:] else shape
        for shape, a in zip(shapes, flat, strict=True)
    ]


def _first_batch(config: TrainConfig) -> Any:
    """The inputs of your ``--data=module:function``'s first batch, or None for another
    source (or a function that takes an ``input_context``: made per host)."""
    spec = config.data.source
    if not is_function_spec(spec) or takes_input_context(spec):
        return None
    first = call_user("data", spec, config.data.global_batch_size).take(1)
    return next(iter(first.as_numpy_iterator()))[0]


def _reference_loss() -> keras.losses.Loss:
    """The reference models' loss: their outputs are logits over classes (or bytes)."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Profiled(NamedTuple):
    """What the planner profiles for a run (:func:`hybrid.planning.costs.profile_model`'s
    arguments): the model or its layers, the input's shape (without the batch) and dtype or
    a sample batch ``x``, and the loss."""

    model: Any
    input_shape: tuple[int, ...] | None
    input_dtype: str
    x: Any
    loss: Any


def profiled_layers(config: TrainConfig) -> Profiled:
    """What the planner profiles for ``config``'s model: a reference model's layers with
    their input shape and dtype; your ``--model`` itself, its input from its
    ``keras.Input``, or, where that leaves a dimension open (a KerasHub model's sequence
    length), zeros of the shapes :func:`model_for` took from your ``--data``'s first
    batch (``x``: one example per input, in the model's input order)."""
    if not is_function_spec(config.model.name):
        layers, shape, dtype = build_model(config)
        return Profiled(layers, shape, dtype, None, _reference_loss())
    model, loss, _, shapes, dtypes = model_for(config)  # open dimensions fixed from --data
    if isinstance(dtypes, list):
        found = list(zip(shapes, dtypes, strict=True))
    else:
        found = [(shapes, dtypes)]
    x = None  # the model's keras.Input says all, or an open dimension is named
    if any(None in t.shape[1:] for t in model.inputs) and all(None not in s[1:] for s, _ in found):
        x = [np.zeros((1, *shape[1:]), dtype) for shape, dtype in found]  # its inputs' order
    return Profiled(model, None, "float32", x, loss)
