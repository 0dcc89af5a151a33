"""Each pipeline device's predicted peak memory, from the model's shapes, by
:mod:`hybrid.core.memory`'s rule: what ``Pipeline(balance="memory")`` cuts by and what
``pipe.summary()`` shows.

    per call  weights, and activations per example estimated from its output's shape
              (hybrid.engine.model.layer_costs.layer_bytes)
    usage     the optimizer's slots per weight (counted on a copy), R, M, remat, the
              schedule's micro-batches in flight per stage, deferral, ZeRO-1 sharding
    micro     the global batch / (R · M) examples a stage runs at once

``hybrid.plan`` (``hybrid-train --dry_run``) measures each layer instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybrid.core import memory
from hybrid.engine.model.optimizers import OptimizerCopies, slots_per_weight

__all__ = ["memory_cut", "predicted_peaks", "usage"]


def usage(pipe: Any, optimizers: OptimizerCopies) -> memory.Usage:
    """How ``pipe`` uses memory beyond its layers, with these optimizer copies."""
    return memory.usage_of(pipe.config, pipe.schedule, slots_per_weight(optimizers))


def _micro_batch(pipe: Any, batch: int) -> float:
    return batch / (pipe.mesh.num_replicas * pipe.micro_batches)


def memory_cut(
    pipe: Any, optimizers: OptimizerCopies, batch: int | None
) -> Callable[[memory.LayerBytes], tuple[int, ...]]:
    """The cut for ``balance="memory"`` at this global ``batch``: the calls' bytes per
    example -> calls per model stage.

    Raises:
      ValueError: the batch is not known (built from a shape without its batch size).
    """
    if batch is None:
        raise ValueError(
            'balance="memory" weighs activations by the batch size, which this build does '
            "not give: build with the batch size in the shape (pipe.build((64, 32)), not "
            "(None, 32)), or let the first batch build the pipeline"
        )

    def cut(per_example: memory.LayerBytes) -> tuple[int, ...]:
        layers = memory.scaled(per_example, _micro_batch(pipe, batch))
        return memory.balance_by_memory(
            layers, pipe.schedule.num_model_stages, usage(pipe, optimizers)
        )

    return cut


def predicted_peaks(
    pipe: Any,
    optimizers: OptimizerCopies,
    per_example: memory.LayerBytes | None,
    batch: int | None,
) -> tuple[float, ...] | None:
    """Each pipeline device's predicted peak bytes (a row of the mesh: every replica's is
    the same), from the built ``pipe``'s calls' bytes per example at the global ``batch``;
    None when the batch size is not known."""
    if batch is None or per_example is None:
        return None
    layers = memory.scaled(per_example, _micro_batch(pipe, batch))
    return memory.device_peaks(layers, pipe.balance, usage(pipe, optimizers))
