"""Pipeline: trains a Keras model on an S × R mesh, one exact step at a time.

Conceptually one training step computes, for a global batch (x, y) of B examples::

    for r in range(R):                              # data-parallel replicas
        for m in range(M):                          # micro-batches of B / (R·M) examples
            a = x[r][m]
            for s in range(S):  a = stage[s](a)     # F actions, one device per stage
            num[r][m], den[r][m] = loss terms of (y[r][m], a, sample_weight[r][m])
            backprop num[r][m] through the stages, accumulating dW[s][r]   # B actions
    loss = sum(num) / sum(den)        # the reduction Keras applies to the whole batch
    for s in range(S):  dW[s][:] = sum over r of dW[s][r] / sum(den)  # all-reduce, group s
    sum the gradients of a variable held by several stages (a tied embedding)
    clip every stage's dW by the norm over all stages (global_clipnorm)
    every device (s, r) applies dW[s][r] to its copy of stage s with its copy of the optimizer

which is the gradient of the batch's loss as Keras reduces it: the step one device would take
(with several outputs, each output's loss is reduced so and weighted: ``objective.py``; the
divisors are known from the labels before the backward starts, which carries the 1 / sum(den)).
It differs from that sequential loop only in *when* things run: the schedule (``schedule.py``)
orders each device's F/B actions, the step issues every action on its device with a control
dependency on the device's previous action, so each device runs one action at a time in
schedule order while different devices overlap. The whole step is one ``tf.function`` (one
trace per input signature); stage programs are XLA-compiled on their devices.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hybrid.core.config import (
    REMAT_MODES,
    RunConfig,
    layout_of,
    least_micro_batches,
    pipeline_arguments,
    validate_run,
)
from hybrid.core.mesh import DeviceMesh
from hybrid.engine import compile_cache
from hybrid.engine.api import (
    batches,
    executions,
    feed,
    out_of_memory,
    stage_memory,
    step_bodies,
)
from hybrid.engine.api.batches import Flat, Shards
from hybrid.engine.api.compiled import Compiled
from hybrid.engine.api.mesh_step import MeshExecutor, Placing
from hybrid.engine.api.micro_batching import (
    AUTO,
    Steps,
    best_of,
    choose_micro_batches,
    initial_micro_batches,
    steps_for,
)
from hybrid.engine.api.per_host import UNDER_STRATEGY, PerHostDataset
from hybrid.engine.api.strategy_step import StrategyExecutor
from hybrid.engine.api.workflow import Workflow
from hybrid.engine.devices import client_cpu
from hybrid.engine.model.graph import graph_of
from hybrid.engine.model.losses import LossLike
from hybrid.engine.model.optimizers import OptimizerLike
from hybrid.engine.model.variables import Placement
from hybrid.engine.step import assembly, compression
from hybrid.engine.step import clocks as timing
from hybrid.engine.step.clocks import TimedAction
from hybrid.engine.step.stage import StageReplica, TensorSpec

__all__ = ["REMAT_MODES", "Pipeline", "TimedAction"]


class Pipeline(Workflow):
    """A Keras model cut into ``mesh.num_stages`` stages and replicated on the mesh.

    Built in two steps, as a Keras model is: the constructor takes the parallel layout,
    :meth:`compile` what ``keras.Model.compile`` takes::

        pipe = hybrid.Pipeline(model, mesh, micro_batches=4, schedule="1f1b")
        pipe.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        pipe.fit(x, y, batch_size=32)

    Args:
      model: a Keras model (functional, with any branches, merges, skip connections, shared
        layers, inputs and nested functional models; or Sequential), or a list of Keras
        layers applied in order. Its layer objects run as they are; each stage device holds
        a copy of the variables its layers read.
      mesh: the S × R device mesh, or its spec ("stage:2,replica:4") on the local devices;
        None: ``config``'s S × R on the local devices.
      strategy: a ``tf.distribute`` strategy (a ``TPUStrategy`` on the mesh's layout, or a
        ``MirroredStrategy``) that runs the step as one program per replica
        (``strategy_step.py``); None: the step runs over the mesh's devices.
      config: a whole layout as the planner gives it (a ``RunConfig``, e.g. ``hybrid.plan
        (...).best.config``): its mesh shape, micro-batches, schedule, virtual stages,
        remat, balance and deferral. Then none of those may be given as keywords.
      micro_batches: M, the micro-batches each replica's shard of the batch is split into;
        or "auto": the first labelled batch times the gradient step at every M the schedule
        accepts and keeps the fastest (``micro_batching.py``; ``micro_batch_seconds``).
      schedule: name of a schedule in ``hybrid.core.schedule.names()``.
      remat: "never" keeps activations, "always" keeps each stage input and recomputes its
        forward in the backward, "except_last" recomputes all but the last micro-batch.
      balance: layer calls per stage (in the model's topological order), or how to cut:
        None or "compute" (each call's estimated work, ``layer_costs.call_work``), "params",
        "time" (profiled per call), "memory" (the smallest largest predicted stage peak).
      virtual_stages: model stages per device (the interleaved schedule).
      defer_weight_gradients: each stage's weight gradients once per step over all its
        micro-batches' rows (``deferral.py``; exact; needs ``remat="never"``; memory).
      shard_optimizer_states: each of a stage's R replicas holds the optimizer state of,
        and updates, its share of the stage's variables and sends them to the others
        (ZeRO-1, ``sharding.py``; exact; optimizer state ÷ R per device).
      prefetch: executions (``steps_per_execution`` batches each) prepared on the replicas'
        devices ahead of the step (``feed.py``); 0 prepares each batch at its step.
      boundary_dtype: "bfloat16" or "int8" compresses the activations and gradients that
        cross stage boundaries in training (``compression.py``: inexact, for slow links);
        None or "float32" sends them as they are.

    Raises:
      ValueError: ``config`` together with layout keywords, or a mesh of another shape.
    """

    def __init__(
        self,
        model: keras.Model | Sequence[keras.layers.Layer],
        mesh: DeviceMesh | str | None = None,
        *,
        strategy: Any = None,
        config: RunConfig | None = None,
        micro_batches: int | str | None = None,
        schedule: str | None = None,
        remat: str | None = None,
        balance: str | Sequence[int] | None = None,
        virtual_stages: int | None = None,
        defer_weight_gradients: bool | None = None,
        shard_optimizer_states: bool | None = None,
        prefetch: int = 2,
        boundary_dtype: str | None = None,
    ) -> None:
        super().__init__()
        layout = layout_of(
            config,
            micro_batches=micro_batches,
            schedule=schedule,
            remat=remat,
            balance=balance,
            virtual_stages=virtual_stages,
            defer_weight_gradients=defer_weight_gradients,
            shard_optimizer_states=shard_optimizer_states,
        )
        if mesh is None:
            if config is None:
                raise ValueError(
                    "Pipeline(model, mesh=None) needs a config to take the mesh shape from; "
                    "give a mesh (e.g. hybrid.DeviceMesh.create(stages=2, replicas=2))"
                )
            mesh = DeviceMesh.create(stages=config.stages, replicas=config.replicas)
        self.mesh = mesh = pipeline_arguments(mesh, balance=layout.balance)
        if config is not None and (config.stages, config.replicas) != mesh.shape:
            raise ValueError(
                f"the config is for {config.stages} stage(s) × {config.replicas} replica(s) "
                f"and the mesh is {mesh.num_stages} × {mesh.num_replicas}; give a mesh of "
                "the config's shape, or mesh=None to make one on the local devices"
            )
        self._executor: MeshExecutor | StrategyExecutor = (
            MeshExecutor() if strategy is None else StrategyExecutor(strategy, mesh, layout)
        )
        self.cannot = self._executor.cannot
        self.prefetch = feed.check_depth(prefetch)
        self._codec = compression.codec_for(compression.check_boundary_dtype(boundary_dtype))
        self._model = model
        self._graph = graph_of(model)
        balance = layout.balance
        counts = None if balance is None or isinstance(balance, str) else tuple(map(int, balance))
        self._auto = layout.micro_batches == AUTO
        M = initial_micro_batches(layout.micro_batches, layout.schedule, mesh.num_stages)
        self.micro_batch_seconds: dict[int, float] = {}
        self.config = validate_run(
            RunConfig(
                stages=mesh.num_stages,
                replicas=mesh.num_replicas,
                micro_batches=M,
                schedule=layout.schedule,
                virtual_stages=layout.virtual_stages,
                remat=layout.remat,
                balance=counts if counts is not None else str(balance) if balance else None,
                num_layers=len(self._graph.calls),
                defer_weight_gradients=layout.defer_weight_gradients,
                shard_optimizer_states=layout.shard_optimizer_states,
                global_batch=config.global_batch if config is not None else None,
            )
        )
        self.remat, self._defer = layout.remat, layout.defer_weight_gradients
        # Explicit counts, or None until build() balances by self._balance_mode.
        self._balance: tuple[int, ...] | None = counts
        self._balance_mode = "compute" if balance is None or counts is not None else str(balance)
        self._stages: list[list[StageReplica]] = []
        self._placement: Placement | None = None
        self._bytes: tuple[Any, int | None] = (None, None)  # see predicted_memory
        self._compiled: Compiled | None = None
        self._step = self._executor.step_variable(mesh)  # see step_counter
        self._steps = self._steps_for(M)
        self._first = compile_cache.FirstStep()  # which traced step of each kind runs next
        self._event_keys: list[tuple[int, Any]] = []  # a timed step's (device, action) pairs

    def compile(
        self,
        optimizer: OptimizerLike = "rmsprop",
        loss: LossLike = None,
        loss_weights: Any = None,
        metrics: Any = None,
        weighted_metrics: Any = None,
        run_eagerly: bool = False,
        steps_per_execution: int = 1,
        jit_compile: bool | str = "auto",
        auto_scale_loss: bool = True,
    ) -> None:
        """Configures the training as ``keras.Model.compile`` does, with its arguments and
        defaults; then ``fit``, ``evaluate``, ``predict`` and the steps can run.

        Args:
          optimizer: a Keras optimizer, used as one optimizer over the whole model: each
            device holds a copy for its variables (same class, configuration and
            weight-decay exclusions) and ``global_clipnorm`` clips by the norm over every
            stage; a name ("adam"); or a zero-argument factory returning a new one.
          loss: a ``keras.losses.Loss`` (its reduction is honoured over the global batch),
            a loss name, or ``callable(y_true, y_pred)`` returning per-example values
            (reduced as ``compile`` reduces them: the mean over the batch); for several
            outputs, one for all or a list (dict by output name) of them.
          loss_weights: each output's weight in the loss (a list, or dict by output name).
          metrics, weighted_metrics: as ``compile`` takes them; ``fit``, ``evaluate`` and
            ``train_step`` report them, computed on the global batch (``metrics.py``).
          run_eagerly: must be False: the pipelined step is always a traced function
            (debug the model with plain Keras on one device).
          steps_per_execution: the steps ``fit`` and ``evaluate`` run per call of their
            traced function (``executions.py``), as Keras's: callbacks and logs
            every that many steps; ``predict`` hands its callbacks that many batches'
            outputs at once.
          jit_compile: "auto" or True compiles the stage programs with XLA (a stage that
            updates sparse gradients on a CPU updates with TensorFlow's kernels); False
            runs them with TensorFlow's kernels.
          auto_scale_loss: with a ``mixed_float16`` model, wrap the optimizer in a
            ``LossScaleOptimizer``, as ``compile`` does.

        Raises:
          ValueError: a loss of None, run_eagerly, steps_per_execution not an integer
            >= 1, or a second compile once the pipeline is built.
        """
        if self.built:
            raise ValueError(
                "compile() after the pipeline was built: its stage copies already hold "
                "their optimizers and loss; build a new Pipeline from pipe.to_keras() to "
                "train with other settings"
            )
        compiled = Compiled.of(
            self._model,
            self._graph,
            optimizer=optimizer,
            loss=loss,
            loss_weights=loss_weights,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
            run_eagerly=run_eagerly,
            steps_per_execution=steps_per_execution,
            jit_compile=jit_compile,
            auto_scale_loss=auto_scale_loss,
        )
        self._compiled = compiled
        self._loss, self._optimizers = compiled.objective, compiled.optimizers
        self._metrics, self.jit_compile = compiled.metrics, compiled.jit_compile
        self.steps_per_execution = compiled.steps_per_execution

    def _steps_for(self, micro_batches: int) -> Steps:
        """The schedules and traced step functions of M = ``micro_batches``."""
        return steps_for(
            self.config,
            micro_batches,
            train=functools.partial(step_bodies.train, self),
            gradients=functools.partial(step_bodies.gradients, self),
            evaluate=functools.partial(step_bodies.evaluate, self),
            predict=functools.partial(step_bodies.predict, self),
            train_many=functools.partial(step_bodies.train_many, self),
            evaluate_many=functools.partial(step_bodies.evaluate_many, self),
        )

    def _use(self, micro_batches: int) -> None:
        """Replaces the step's state with that of M = ``micro_batches`` (every stage copy
        told how the batch is split)."""
        steps = self._steps_for(micro_batches)
        for row in self._stages:
            for copy in row:
                copy.split_batch(self.mesh.num_replicas, micro_batches, self._defer)
        self._steps, self.config = steps, steps.config

    @property
    def micro_batches(self) -> int:
        """M: the micro-batches each replica's shard of the batch is split into."""
        return self._steps.micro_batches

    @property
    def schedule(self) -> Any:
        """The training schedule (``hybrid.core.schedule.Schedule``) at this M."""
        return self._steps.schedule

    @property
    def compiled(self) -> bool:
        """Whether :meth:`compile` was called."""
        return self._compiled is not None

    def _require_compiled(self, method: str) -> None:
        if self._compiled is None:
            raise ValueError(f"You must call `compile()` before calling `{method}()`.")

    # -- building --------------------------------------------------------------------------

    @property
    def built(self) -> bool:
        return bool(self._stages)

    @property
    def balance(self) -> tuple[int, ...]:
        """Layer calls per stage (once built, or when given)."""
        if self._balance is None:
            raise RuntimeError("the balance is chosen when the pipeline is built; call build()")
        return self._balance

    @property
    def step_counter(self) -> tf.Variable:
        """Optimizer steps taken; with the micro-batch it seeds the random layers (a restored
        checkpoint sets it: a resumed run draws what the original would have drawn)."""
        return self._step

    @property
    def stages(self) -> list[list[StageReplica]]:
        """``stages[k][r]``: the copy of model stage k on replica r's device."""
        return self._stages

    def distribute_datasets_from_function(self, dataset_fn: Any) -> PerHostDataset:
        """``tf.distribute.Strategy.distribute_datasets_from_function`` for the mesh: a
        dataset of per-replica batches made on every input host, for ``fit``'s and
        ``evaluate``'s ``x``; the client sends no examples (``per_host.py``)."""
        if self.strategy is not None:
            raise ValueError(UNDER_STRATEGY)
        firsts = [self.mesh.device(0, r) for r in range(self.mesh.num_replicas)]
        return PerHostDataset(dataset_fn, firsts, self._graph)

    def build(self, input_shape: Any, dtype: Any = "float32") -> None:
        """Builds the layers, chooses the balance and places a stage copy on every device.

        Args:
          input_shape: the model's input shape including the batch dimension (which may be
            None), as in ``keras.Model.build``; a list of shapes for a model with several
            inputs (a dict model: in the order of its sorted input names).
          dtype: the input dtype (e.g. "int32" for token ids), or one per input.
        """
        self._require_compiled("build")
        if self.built:
            return
        self._build(batches.input_specs(input_shape, dtype), batches.batch_of(input_shape))

    def _build(self, specs: Sequence[TensorSpec], batch: int | None = None) -> None:
        if len(specs) != len(self._graph.inputs) or any(None in s.shape for s in specs):
            raise ValueError(
                f"the model takes {len(self._graph.inputs)} input(s), got the input shapes "
                f"{[(None, *s.shape) for s in specs]}; give one shape per input, every "
                "dimension but the batch known (each shape compiles its own programs)"
            )
        self._specs = list(specs)
        self._shapes = [s.shape for s in specs]
        by_memory = self._balance_mode == "memory"
        layout = assembly.lay_out(
            self._graph,
            specs,
            client_cpu(),
            self.schedule.num_model_stages,
            self._balance,
            self._balance_mode,
            self.jit_compile,
            stage_memory.memory_cut(self, self._optimizers, batch) if by_memory else None,
            timing_device=self.mesh.device(0, 0),
        )
        self._bytes = (layout.bytes, batch)
        self._balance, self._placement = layout.balance, layout.placement
        masked = [k in layout.masked for k in self._graph.outputs]
        self._loss = self._loss.bind(layout.output_shapes, masked)
        with out_of_memory.said(self, building=True):  # the weights and optimizer slots
            self._stages = self._place(layout, batch)
        self._ties = layout.placement.ties()
        self._clocks = [timing.DeviceClock(d) for d in self.mesh.pipeline(0)]
        if self._metrics.needs_predictions:
            if any(masked):
                raise NotImplementedError(
                    "metrics on a masked output are not supported yet (the mask does not "
                    "reach the metrics); compute them with evaluate() on to_keras()"
                )
            for copy in self._stages[-1]:
                copy.returns_predictions()

    def _place(self, layout: assembly.Layout, batch: int | None = None) -> list[list[StageReplica]]:
        """Every stage's copies (``stages[k][r]``) and replica groups, as the executor
        places them (``batch``: see ``assembly.place``)."""
        placing = Placing(
            self.schedule,
            self.mesh,
            self._optimizers,
            self._loss,
            self.jit_compile,
            self._defer,
            batch,
            self.config.shard_optimizer_states,
        )
        stages, self._groups = self._executor.place(layout, placing)
        return stages

    def predicted_memory(self) -> tuple[float, ...] | None:
        """Each pipeline device's predicted peak bytes (``[d]``: the devices of mesh row d,
        which hold model stage d, or stages d, d+S, ... with virtual stages), estimated from
        the model's shapes at the batch size it was built for (``stage_memory.py``;
        ``hybrid.plan`` measures); None when that batch size is not known."""
        self._require_compiled("predicted_memory")
        return stage_memory.predicted_peaks(self, self._optimizers, *self._bytes)

    @property
    def strategy(self) -> Any:
        """The ``tf.distribute`` strategy the step runs under (None: over the mesh)."""
        return self._executor.strategy

    def replica_weights(self, replica: int) -> list[np.ndarray]:
        """The weights held by one replica's devices (all replicas should be identical)."""
        return self.placement.read(self._executor.replica_weights(self._stages, replica))

    def traced_train_step(self, x: Any, y: Any, sample_weight: Any = None) -> tf.Graph:
        """The training step's graph on this batch, traced, never run: under an offline
        ``TPUStrategy`` (``platforms.tpu_offline``) the TPU program a slice would compile."""
        self._require_compiled("traced_train_step")
        return self._steps.train.get_concrete_function(self._batch(x, y, sample_weight)).graph

    # -- public steps ----------------------------------------------------------------------

    def train_step(self, x: Any, y: Any, sample_weight: Any = None) -> dict[str, float]:
        """One training step on the global batch (any number of examples), as
        ``keras.Model.train_on_batch(x, y, sample_weight, return_dict=True)`` takes it: the
        loss as Keras reduces it and the metrics, on this batch alone.

        Args:
          x, y: the global batch of inputs and labels.
          sample_weight: per-example (or per-timestep) weights; None weighs every example 1.
        """
        self._require_compiled("train_step")
        self._metrics.reset()
        self._train_batch(self._batch(x, y, sample_weight))
        return self._metrics.result()

    def timed_train_step(
        self, x: Any, y: Any, sample_weight: Any = None
    ) -> tuple[dict[str, float], list[TimedAction]]:
        """A real training step that also records when each of replica 0's actions ran
        (``timing.py``: seconds from its first start); ``last_timeline`` gets the breakdown."""
        self._require_compiled("timed_train_step")
        self._refuse("timed_train_step")
        self._metrics.reset()
        view = self._timed_step(self._batch(x, y, sample_weight))
        return self._metrics.result(), view.actions

    def _train_batch(self, parts: Shards, timed: bool = False) -> None:
        batches.warn_padding(parts, [row[0] for row in self._stages], training=True)
        if timed:
            self._timed_step(parts)
        else:
            traces = self._training_traces()
            self._metrics.returned(self._run_first("train", parts)[1])
            self.execution_traced = self._training_traces() > traces

    def _train_many(self, many: list[Shards]) -> None:
        traces = self._training_traces()
        self._run_many("train", many)
        self.execution_traced = self._training_traces() > traces

    def _training_traces(self) -> int:
        """How many traces the training steps made (a strategy's step is not ours: none)."""
        steps = (self._steps.train, self._steps.train_many)
        return sum(getattr(f, "experimental_get_tracing_count", int)() for f in steps)

    def _test_many(self, many: list[Shards]) -> None:
        self._run_many("evaluate", many)

    def _run_many(self, kind: str, many: list[Shards]) -> None:
        """``kind`` ("train" or "evaluate") on each batch in turn: every run of batches of
        one signature (``executions.groups``) in one call of the ``<kind>_many`` step; the
        pipeline's first step of the kind, and a lone batch, in a call of the single step."""
        training = kind == "train"
        single = self._train_batch if training else self._test_batch
        if not self._first.ran(self._steps, kind):
            single(many[0])  # the first call compiles, in turn where it should
            many = many[1:]
        for group in executions.groups(many):
            if len(group) == 1:
                single(group[0])
                continue
            for parts in group:
                batches.warn_padding(parts, [row[0] for row in self._stages], training)
            with out_of_memory.said(self):
                self._metrics.returned(getattr(self._steps, f"{kind}_many")(group))

    def _run_first(self, kind: str, parts: Shards) -> Any:
        """The traced ``kind`` step on ``parts``, its first call in turn where it should."""
        with out_of_memory.said(self):
            return self._first.function(self._steps, self._ordering, kind)(parts)

    def _ordering(self) -> bool:
        """Whether a first call runs the replicas in turn (``compile_cache.ordered``)."""
        jit = self._compiled is not None and self._compiled.jit_compile
        synced = any(copy.synced for row in self._stages for copy in row)
        return compile_cache.ordered(self.config.replicas, jit, self.strategy, synced)

    def _test_batch(self, parts: Shards) -> None:
        batches.warn_padding(parts, [row[0] for row in self._stages], training=False)
        self._metrics.returned(self._run_first("evaluate", parts))

    def _predict_batch(self, parts: Shards) -> Flat:
        return self._run_first("predict", parts)

    def _timed_step(self, parts: Shards) -> timing.StepView:
        """The training step on ``parts``, timed: its view is kept in ``last_timeline``."""
        with out_of_memory.said(self):
            stamps, logs = self._steps.timed(parts)
        self._metrics.returned(logs)
        events = timing.timeline(self._event_keys, stamps, self.mesh.num_stages)
        self.last_timeline = timing.StepView.of(events)
        return self.last_timeline

    def gradients(self, x: Any, y: Any, sample_weight: Any = None) -> list[np.ndarray]:
        """The gradients of the batch's loss as :meth:`train_step` computes them (replica
        0's, in the order of ``model.trainable_variables``), without updating anything."""
        self._require_compiled("gradients")
        self._refuse("gradients")
        _, grads = self._run_first("gradients", self._batch(x, y, sample_weight))
        return [tf.convert_to_tensor(g).numpy() for g in grads]  # a sparse one densified

    def _batch(
        self, x: Any, y: Any = None, sample_weight: Any = None, pad_to: int | None = None
    ) -> Shards:
        """The batch cut into the replicas' shards of flat lists of tensors (inputs, labels
        and sample weights per output) with which examples are real: a batch that does not
        split into R·M equal parts is padded (to ``pad_to`` examples, or the next multiple
        of R·M) with examples that count for nothing. Builds the pipeline on first use."""
        xs, ys, ws = batches.flat_batch(self._graph, x, y, sample_weight)
        shapes = [tuple(t.shape[1:]) for t in xs]
        if not self.built:
            self._build([TensorSpec(tuple(t.shape[1:]), t.dtype.name) for t in xs], len(xs[0]))
        elif shapes != self._shapes:
            raise ValueError(
                f"the pipeline was built for inputs of shapes {self._shapes} (without the "
                f"batch), got {shapes}; build another Pipeline for another shape"
            )
        if ys is not None:
            self._metrics.build(ys, self._loss.shapes)
            if self._auto:  # the first labelled batch chooses M
                self._choose_micro_batches(xs, ys, ws)
                self._auto = False
        return self._shards(xs, ys, ws, pad_to)

    def _choose_micro_batches(self, xs: Flat, ys: Any, ws: Any) -> None:
        """micro_batches="auto": times the gradient step on this batch at every candidate M
        (``micro_batching.py``), uses the fastest and keeps the seconds of each."""

        def seconds_of(micro_batches: int) -> float:
            self._use(micro_batches)
            parts = self._shards(xs, ys, ws)
            return best_of(lambda: float(self._run_first("gradients", parts)[0]))

        examples = int(xs[0].shape[0])
        best, self.micro_batch_seconds = choose_micro_batches(self.config, examples, seconds_of)
        self._use(best)
        R = self.config.replicas
        if R * least_micro_batches(self.config.schedule, self.mesh.num_stages) == 1:
            assembly.warn_parts(self.stages, R, best, examples)  # else the build warned

    def _shards(self, xs: Flat, ys: Any, ws: Any, pad_to: int | None = None) -> Shards:
        """Flat inputs, labels and weights padded and cut into the replicas' shards."""
        xs, ys, ws, valid = batches.pad(self.config, xs, ys, ws, pad_to)
        return batches.shards(self.config, *batches.prepare(self.config, xs, ys, ws), valid)

    def _shard_devices(self) -> tuple[list[str], list[str]]:
        """Where each replica's shard goes: its inputs' and its labels' devices."""
        return self._executor.input_devices(self._stages, self.mesh)

    @property
    def placement(self) -> Placement:
        """Which stages hold each model variable (known once built)."""
        if self._placement is None:
            raise RuntimeError("the pipeline is not built yet; call build() or train_step()")
        return self._placement
