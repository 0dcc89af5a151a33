"""``compile(steps_per_execution=N)``: up to N steps of one kind run by one call of one traced
function, so the host's fixed cost of a call (dispatching the function, reading the metrics,
the callbacks) is paid once per N steps, as in Keras.

An execution is the batches Keras's epoch iterator hands over together (N of them, fewer at
the end of the data). Consecutive batches of the same structure and shapes (within one
``fit``, every batch is padded to the first one's size; only whether a batch carries padding
flags can differ) run as one loop::

    stacked[r] = each tensor of replica r's shards stacked over the K batches,
                 on the device that reads it (inputs: the first stage's, labels: the last's)
    i, done = 0, counter
    while i < K:                       # one iteration at a time (parallel_iterations=1)
        after done: step(batch i of stacked)
        i, done = i + 1, counter after the step

The loop body is the single step's body traced once, whatever K is: building an execution
costs one step's tracing, not K. Each iteration reads the variables the previous one wrote
(the step counter carried from one to the next orders them), so K steps in a loop compute
exactly what K calls of the single step do, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hybrid.engine.api.batches import Shard, Shards

__all__ = ["check_steps_per_execution", "groups", "run_loop"]


def check_steps_per_execution(steps: Any) -> int:
    """``steps_per_execution`` (``compile``'s, or set on the pipeline) as an int.

    Raises:
      ValueError: not an integer ≥ 1.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"steps_per_execution={steps!r}: give the number of steps each call "
            "of the traced step runs, an integer >= 1 (callbacks and logs then come every "
            "that many steps, as in Keras)"
        )
    return steps


def _signature(parts: Shards) -> Any:
    """What must agree for batches to be stacked: every tensor's place, shape and dtype."""

    def of(tensors: Sequence[tf.Tensor] | None) -> Any:
        return None if tensors is None else tuple((tuple(t.shape), t.dtype) for t in tensors)

    return tuple(
        (of(p.xs), of(p.ys), of(p.ws), None if p.valid is None else tuple(p.valid.shape))
        for p in parts
    )


def groups(executions: Sequence[Shards]) -> list[list[Shards]]:
    """The batches of an execution split into runs of consecutive batches that stack
    (:func:`_signature`), in order."""
    found: list[list[Shards]] = []
    for parts in executions:
        if found and _signature(found[-1][0]) == _signature(parts):
            found[-1].append(parts)
        else:
            found.append([parts])
    return found


def _stack(many: Sequence[Shards], firsts: Sequence[str], lasts: Sequence[str]) -> Shards:
    """Replica r's shard of every batch stacked along a new first axis: inputs on
    ``firsts[r]``, labels, sample weights and padding flags on ``lasts[r]``."""

    def stacked(tensors: Sequence[Any], device: str) -> Any:
        if tensors[0] is None:
            return None
        with tf.device(device):
            return [tf.stack(list(same)) for same in zip(*tensors, strict=True)]

    out = []
    for r, (first, last) in enumerate(zip(firsts, lasts, strict=True)):
        column = [parts[r] for parts in many]
        valid = stacked(
            [[p.valid] for p in column] if column[0].valid is not None else [None], last
        )
        out.append(
            Shard(
                stacked([p.xs for p in column], first),
                stacked([p.ys for p in column], last),
                stacked([p.ws for p in column], last),
                None if valid is None else valid[0],
            )
        )
    return out


def _batch(stacked: Shards, i: tf.Tensor) -> Shards:
    """Batch ``i`` of the stacked shards."""

    def at(tensors: list[tf.Tensor] | None) -> Any:
        return None if tensors is None else [t[i] for t in tensors]

    return [
        Shard(at(s.xs), at(s.ys), at(s.ws), None if s.valid is None else s.valid[i])
        for s in stacked
    ]


def run_loop(
    step: Callable[[Shards], Any],
    many: Sequence[Shards],
    devices: tuple[Sequence[str], Sequence[str]],
    counter: Callable[[], tf.Tensor],
) -> None:
    """``step`` on each of ``many`` batches in turn, as one ``tf.while_loop`` (traced once).

    Args:
      step: the single step's body on one batch's shards.
      many: the batches, all of one :func:`_signature`.
      devices: each replica's first- and last-stage device.
      counter: reads a value every step writes last (the step counter; for steps that
        write none, anything the next iteration may wait on).
    """
    stacked = _stack(many, *devices)

    def body(i: tf.Tensor, done: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        with tf.control_dependencies([done]):
            step(_batch(stacked, i))
            return i + 1, counter()

    tf.while_loop(
        lambda i, _: i < len(many),
        body,
        [tf.constant(0), counter()],
        parallel_iterations=1,
    )
