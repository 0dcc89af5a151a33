"""What ``Pipeline.compile`` makes of ``keras.Model.compile``'s arguments: the objective,
the optimizer's per-device copies, the metrics and whether stage programs use XLA."""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from hybrid.core.config import check_switches
from hybrid.engine.api.executions import check_steps_per_execution
from hybrid.engine.api.metrics import StepMetrics
from hybrid.engine.model.graph import Graph
from hybrid.engine.model.losses import LossLike
from hybrid.engine.model.objective import Objective
from hybrid.engine.model.optimizers import OptimizerCopies, OptimizerLike, optimizer_copies

__all__ = ["Compiled"]


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One ``compile`` call's settings, checked (a pipeline holds one; none before compile).

    Attributes:
      objective: each output's loss and weight (``objective.py``).
      optimizers: the optimizer's copies, one per stage device when placed.
      metrics: the loss tracker and compiled metrics (``metrics.py``).
      jit_compile: whether stage programs are XLA-compiled.
      steps_per_execution: the steps one call of a traced step runs (``executions.py``).
    """

    objective: Objective
    optimizers: OptimizerCopies
    metrics: StepMetrics
    jit_compile: bool
    steps_per_execution: int = 1

    @classmethod
    def of(
        cls,
        model: Any,
        graph: Graph,
        *,
        optimizer: OptimizerLike,
        loss: LossLike,
        loss_weights: Any,
        metrics: Any,
        weighted_metrics: Any,
        run_eagerly: bool,
        steps_per_execution: int,
        jit_compile: bool | str,
        auto_scale_loss: bool,
    ) -> Compiled:
        """The settings ``keras.Model.compile(...)`` with these arguments gives ``model``.

        Raises:
          ValueError: what a pipeline cannot honour (named, with what to do instead).
        """
        if loss is None:
            raise ValueError(
                "compile(loss=None): the pipeline's step needs a loss to pipeline the "
                "backward from (a model whose only losses are add_loss terms is not "
                "supported); give loss=... as for keras.Model.compile"
            )
        if run_eagerly:
            raise ValueError(
                "compile(run_eagerly=True): the pipelined step always runs as a traced "
                "function over the mesh; debug the model with plain Keras on one device"
            )
        if jit_compile != "auto":
            check_switches(jit_compile=jit_compile)
        check_switches(auto_scale_loss=auto_scale_loss)
        policy = getattr(getattr(model, "dtype_policy", None), "name", None)
        scale = auto_scale_loss and policy == "mixed_float16"
        names = getattr(model, "output_names", None) if isinstance(model, keras.Model) else None
        return cls(
            objective=Objective.of(loss, loss_weights, graph.output_names, len(graph.outputs)),
            optimizers=optimizer_copies(optimizer, scale_loss=scale),
            metrics=StepMetrics(metrics, weighted_metrics, names, graph.output_names),
            jit_compile=jit_compile is not False,
            steps_per_execution=check_steps_per_execution(steps_per_execution),
        )
