"""``compile(steps_per_execution=N)``: up to N steps of one kind run by one call of one traced
function, so the host's fixed cost of a call (dispatching the function, reading the metrics,
the callbacks) is paid once per N steps, as in Keras.

An execution is the batches Keras's epoch iterator hands over together (N of them, fewer at
the end of the data). Consecutive batches of the same structure and shapes (within one
``fit``, every batch is padded to the first one's size; only whether a batch carries padding
flags can differ) run as one traced function of K batches: the single step's body traced K
times in a row. TensorFlow's automatic control dependencies order every read and write of a
variable in program order, as they order one step's update after its reads, so the K steps
compute exactly what K calls of the single step do, bit for bit; where the data allow, a
step's first stages start while the previous step's last stages finish (the next step's
stage k waits only for stage k's update).

Measured (``benchmarks/host_overhead.py``) against a ``tf.while_loop`` over the stacked
batches, whose body is traced once: the loop's frames on every device of the mesh cost more
per iteration than they save (4 × 4 mesh, M = 8, one run: 19.5 ms a step in the loop against
17.6 ms for one step per call; unrolled, in a later run: 11.3 ms against 18.8 ms), so
executions are unrolled, at K times one step's tracing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hybrid.engine.api.batches import Shards
from hybrid.engine.model.variables import next_step_reads
from hybrid.engine.traced import signature

__all__ = ["check_steps_per_execution", "groups", "run_steps"]


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


def groups(executions: Sequence[Shards]) -> list[list[Shards]]:
    """The batches of an execution split into runs of consecutive batches of one trace
    signature (``traced.signature``), in order (each run: one trace per length)."""
    found: list[list[Shards]] = []
    for parts in executions:
        if found and signature(found[-1][0]) == signature(parts):
            found[-1].append(parts)
        else:
            found.append([parts])
    return found


def run_steps(step: Callable[[Shards], Any], many: Sequence[Shards]) -> None:
    """``step`` on each of ``many`` batches in turn, traced one after the other into the
    one function being traced; each step reads the variables afresh (the engine shares one
    read of a variable between the actions of a step: ``TracedReads``)."""
    for parts in many:
        next_step_reads()
        step(parts)
