"""Graph functions the engine calls many times: traced once per input signature, then
called as that trace without ``tf.function``'s per-call argument canonicalization
(:class:`Traced`)."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf

__all__ = ["RETRACING_WINDOW", "Keyed", "Traced", "signature", "traced"]

RETRACING_WINDOW = 10  # a Traced warns when half of its last this many calls traced it


def traced(fn: Callable[..., Any], jit_compile: bool | None = None) -> Any:
    """``fn`` as a graph function (no autograph) of its own, XLA-compiled as ``jit_compile``
    says (``tf.function``'s argument). Through a partial: TensorFlow's
    retracing warning counts the traces of one Python code object across every
    ``tf.function`` made of it (every pipeline, every M, every layer the planner profiles):
    each is counted on its own, so the warning means a function that retraces."""
    return tf.function(functools.partial(fn), autograph=False, jit_compile=jit_compile)


def _signature(value: Any, tensors: list[tf.Tensor]) -> Any:
    """The structure of ``value`` (lists, tuples, None, tensors and Python scalars, which a
    trace takes as constants) with each tensor's shape and dtype and each scalar's value,
    its tensors appended to ``tensors`` in ``tf.nest`` order; None where a value is
    anything else."""
    if value is None:
        return ()
    if type(value) is Keyed:
        tensors.extend(value.tensors)
        return value.key
    if type(value) in (bool, int, float, str):
        return type(value), value
    if isinstance(value, tf.Tensor):
        tensors.append(value)
        return tuple(value.shape.as_list()), value.dtype
    if type(value) in (list, tuple) or isinstance(value, tuple) and hasattr(value, "_fields"):
        inner = [_signature(item, tensors) for item in value]
        return None if None in inner else (type(value), tuple(inner))
    return None


def signature(value: Any) -> Any:
    """What a trace of ``value`` depends on (:func:`_signature`: structure, each tensor's
    shape and dtype, each Python constant), hashable; None for a value it cannot read."""
    return _signature(value, [])


class Keyed(list):  # type: ignore[type-arg]
    """A list (a batch's shards) whose signature and tensors (:func:`_signature`) are read
    once, where it is made: on the feeding thread, so that the loop's thread, which calls
    the step, does not walk every batch twice (to group an execution's batches, then to
    call its trace). Not to be changed once made."""

    def __init__(self, items: Any) -> None:
        super().__init__(items)
        self.tensors: list[tf.Tensor] = []
        self.key = _signature(list(self), self.tensors)


class Traced:
    """A graph function traced once per input signature, and called as that trace.

    A ``tf.function`` call canonicalizes its arguments against every trace before it runs
    one (about 0.5 ms a call here, as much as a tiny step's whole graph; a millisecond of
    tracing per stage program called in a step being traced). The engine's programs take
    lists and named tuples of tensors (a batch's shards, a stage's inputs), whose signature
    — structure, shapes, dtypes — is cheap to read: this keeps one concrete function per
    signature and calls it with the flat tensors, eagerly or from a function being
    traced. Arguments of anything else go to the ``tf.function`` as they are. Like
    ``tf.function``, it warns of a function that keeps retracing: when half of its last
    :data:`RETRACING_WINDOW` calls traced it.
    """

    def __init__(self, fn: Callable[..., Any], jit_compile: bool | None = None) -> None:
        self.function = traced(fn, jit_compile)
        self._concrete: dict[Any, Any] = {}
        self._traced: collections.deque[bool] = collections.deque(maxlen=RETRACING_WINDOW)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors: list[tf.Tensor] = []
        key = _signature(args, tensors)
        keywords: list[tf.Tensor] = []  # keyword arguments: Python constants only
        key = key, _signature(tuple(sorted(kwargs.items())), keywords)
        if None in key or keywords:
            return self.function(*args, **kwargs)
        concrete = self._concrete.get(key)
        self._traced.append(concrete is None)
        if concrete is None:
            concrete = self.function.get_concrete_function(*args, **kwargs)
            self._concrete[key] = concrete
            if sum(self._traced) * 2 >= RETRACING_WINDOW:  # where TensorFlow's warning goes
                tf.get_logger().warning(
                    "%d of the last %d calls of a pipeline program triggered tf.function "
                    "retracing: each new input signature (batch shape, dtype, structure) "
                    "traces it again; keep the batch shape fixed",
                    sum(self._traced),
                    len(self._traced),
                )
        return concrete._call_flat(tensors, concrete.captured_inputs)

    def get_concrete_function(self, *args: Any) -> Any:
        return self.function.get_concrete_function(*args)

    def concrete_functions(self) -> list[Any]:
        """Every trace made so far (by either way of calling)."""
        return list(self.function._list_all_concrete_functions())

    def experimental_get_tracing_count(self) -> int:
        return int(self.function.experimental_get_tracing_count())
