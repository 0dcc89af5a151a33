"""The Keras workflow over a pipeline's steps: ``fit``, ``evaluate``, ``predict``, and the
model interface Keras callbacks use.

The loops are Keras's own, step for step (``keras.src.backend.tensorflow.trainer``): the same
data handling (``EpochIterator``: arrays, dicts, ``tf.data``, generators, shuffling,
``steps_per_epoch``, ``class_weight``, ``validation_split``), the same ``CallbackList`` with
``History`` and the progress bar, the same hooks in the same order with the same ``logs``.
What differs is the step: one pipelined step on the global batch. A batch that does not
split into R·M equal parts (a dataset's last one) is padded to the size of the call's first
batch with examples that count for nothing (``batches.pad``), so it is trained exactly as
Keras trains it and compiles no new programs.

Every ``timeline_every``-th training step (0: none) is run timed (``timing.StepView``: per
device compute, transfers, all-reduce, idle) and kept in ``last_timeline``; the launcher's
``--timeline_every`` writes it to TensorBoard.

Callbacks get the pipeline as their ``model``: ``stop_training``, ``optimizer`` (the one
logical optimizer, ``logical_optimizer.py``: what is written to it reaches every copy),
``get_weights``/``set_weights``, ``save``/``save_weights``/``load_weights`` (through the
user's Keras model, :meth:`to_keras`), ``metrics`` and ``history``.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from hybrid.core.config import RunConfig
from hybrid.engine import keras_private
from hybrid.engine.api import batches, executions, export, feed, weights_file
from hybrid.engine.api.logical_optimizer import LogicalOptimizer
from hybrid.engine.api.metrics import StepMetrics
from hybrid.engine.api.per_host import PerHostDataset, steps_of
from hybrid.engine.model.graph import Graph, TensorSpec
from hybrid.engine.model.optimizers import OptimizerCopies
from hybrid.engine.model.variables import Placement
from hybrid.engine.step import mirrors, optimizer_state, sharding
from hybrid.engine.step.stage import StageReplica
from hybrid.engine.traced import Keyed

__all__ = ["Workflow"]


def _warn_ran_out(steps: int) -> None:
    """Once per ``fit``: the data ran out before the epoch's end."""
    warnings.warn(
        f"fit: the data ran out before the epoch's end; optimizer.iterations is {steps}, the "
        "steps taken, as Keras's fit with jit_compile=True counts them (without XLA Keras "
        "adds one each time its data runs out: docs/guide/exactness.md)",
        stacklevel=3,
    )


def _should_eval(epoch: int, frequency: int | Sequence[int]) -> bool:
    """Keras's rule: validate after (1-indexed) epoch ``epoch + 1``."""
    if isinstance(frequency, int):
        return (epoch + 1) % frequency == 0
    return epoch + 1 in frequency


class _Padding:
    """One call's batch size: every batch is padded to the first one's (rounded up to a
    multiple of R·M), so a short last batch reuses the compiled step."""

    def __init__(self, config: RunConfig) -> None:
        self.config, self.size = config, 0

    def __call__(self, x: Any) -> int:
        n = int(keras.tree.flatten(x)[0].shape[0])
        self.size = max(self.size, batches.padded_size(self.config, n))
        return self.size


class Workflow(abc.ABC):
    """``fit``, ``evaluate`` and ``predict`` with Keras's semantics, over a pipeline's steps.

    The contract with the pipeline is Keras's own split of a trainer: a train step, a test
    step and a predict step, each on one prepared batch (:meth:`_batch`: the batch padded
    and cut into the replicas' shards, the pipeline built on first use); plus the state
    callbacks read (the stage copies, where each variable lives, the step counter).
    """

    config: RunConfig  # the run at the current micro-batch count
    prefetch: int
    _metrics: StepMetrics
    _graph: Graph
    _specs: list[TensorSpec]
    _optimizers: OptimizerCopies

    # What this kind of step cannot do yet: method or setting -> the reason (refused when
    # asked for, before anything runs).
    cannot: dict[str, str] = {}

    def __init__(self) -> None:
        self._timeline_every = 0
        self.last_timeline: Any = None
        self.stop_training = False
        self.history: Any = None
        self.train_function = None  # no graph for TensorBoard's write_graph to write
        self._logical_optimizer: LogicalOptimizer | None = None
        # The epoch a callback restored (Keras's BackupAndRestore sets it): fit starts there.
        self._initial_epoch: int | None = None
        self._steps_per_execution = 1
        # Whether the last training execution traced its function (a new number of steps,
        # or the step after a first one that ran the replicas in turn).
        self.execution_traced = False

    @property
    def timeline_every(self) -> int:
        """Every this many training steps of ``fit``, one is run timed (0: none)."""
        return self._timeline_every

    @timeline_every.setter
    def timeline_every(self, every: int) -> None:
        if every:
            self._refuse("timeline_every")
        self._timeline_every = every

    @property
    def steps_per_execution(self) -> int:
        """The steps ``fit`` and ``evaluate`` run per call (``compile``'s; settable, as on a
        Keras model)."""
        return self._steps_per_execution

    @steps_per_execution.setter
    def steps_per_execution(self, steps: int) -> None:
        self._steps_per_execution = executions.check_steps_per_execution(steps)

    def _refuse(self, what: str) -> None:
        """Raises ValueError with the reason when this step cannot do ``what`` yet."""
        if what in self.cannot:
            raise ValueError(f"{what}: {self.cannot[what]}")

    # -- the contract ---------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def built(self) -> bool:
        """Whether the stages are placed."""

    @property
    @abc.abstractmethod
    def stages(self) -> list[list[StageReplica]]:
        """``stages[k][r]``: model stage k's copy on replica r."""

    @property
    @abc.abstractmethod
    def placement(self) -> Placement:
        """Which stages hold each model variable."""

    @property
    @abc.abstractmethod
    def step_counter(self) -> Any:
        """Optimizer steps taken (a variable)."""

    @abc.abstractmethod
    def _require_compiled(self, method: str) -> None:
        """Raises Keras's error when ``method`` runs before ``compile``."""

    @abc.abstractmethod
    def _batch(self, x: Any, y: Any = None, sample_weight: Any = None, pad_to: Any = None) -> Any:
        """The batch prepared for a step (see the class docstring)."""

    @abc.abstractmethod
    def _shard_devices(self) -> tuple[list[str], list[str]]:
        """Where each replica's shard goes: its inputs' and its labels' devices."""

    @abc.abstractmethod
    def _train_batch(self, parts: Any, timed: bool = False) -> None:
        """One training step on a prepared batch (timed: kept in ``last_timeline``)."""

    @abc.abstractmethod
    def _test_batch(self, parts: Any) -> None:
        """One evaluation step on a prepared batch (updates the metrics)."""

    @abc.abstractmethod
    def _predict_batch(self, parts: Any) -> list[Any]:
        """The model's outputs on a prepared batch's real examples."""

    @abc.abstractmethod
    def _train_many(self, batches: list[Any]) -> None:
        """Training steps on several prepared batches, in order, in as few calls as it can
        (``compile(steps_per_execution=N)``); none of them timed."""

    @abc.abstractmethod
    def _test_many(self, batches: list[Any]) -> None:
        """Evaluation steps on several prepared batches, in as few calls as it can."""

    def timed(self, step: int) -> bool:
        """Whether training step ``step`` (counted from 1 over the run) is run timed: every
        ``timeline_every``-th."""
        every = self.timeline_every
        return bool(every) and step % every == 0

    def _train_one(self, parts: Any) -> None:
        """One training step; timed when the step it takes is a ``timeline_every`` one."""
        timed = bool(self.timeline_every) and self.timed(int(self.step_counter.numpy()) + 1)
        self._train_batch(parts, timed=timed)

    def _train_execution(self, data: list[Any]) -> None:
        """The training steps of one execution (the batches Keras's epoch iterator hands
        over together): one by one when there is one or one of them is timed, else in as
        few calls as the pipeline can (``execution_traced`` says whether that traced)."""
        self.execution_traced = False
        if len(data) > 1 and self.timeline_every:
            step = int(self.step_counter.numpy())
            if any(self.timed(step + k) for k in range(1, len(data) + 1)):
                for parts in data:
                    self._train_one(parts)
                return
        if len(data) == 1:
            self._train_one(data[0])
        else:
            self._train_many(data)

    def _test_execution(self, data: list[Any]) -> None:
        """The evaluation steps of one execution."""
        if len(data) == 1:
            self._test_batch(data[0])
        else:
            self._test_many(data)

    # -- the model's weights, in and out ---------------------------------------------------

    def _output_structure(self, outputs: list[Any]) -> Any:
        return batches.structured(outputs, self._graph.output_names)

    def get_weights(self) -> list[np.ndarray]:
        """All weights, in the order of ``model.get_weights()`` (a tied variable once)."""
        return self.replica_weights(0)

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Sets all weights (order as in :meth:`get_weights`) on every replica."""
        placement = self.placement
        rows = placement.spread(weights, [row[0].num_weights() for row in self.stages])
        for row, values in zip(self.stages, rows, strict=True):
            for copy in row:
                copy.set_weights(values)

    @abc.abstractmethod
    def replica_weights(self, replica: int) -> list[np.ndarray]:
        """The weights held by one replica's devices (all replicas should be identical)."""

    def to_keras(self) -> keras.Model:
        """The user's Keras model with the pipeline's weights (trainable and non-trainable
        state: BatchNormalization's moving statistics) written into its variables: the very
        model object passed in (a list of layers: a ``keras.Sequential`` of them)."""
        for variable, value in zip(self.placement.variables, self.get_weights(), strict=True):
            keras_private.tf_variable(variable).assign(value)  # not mirrored back: they hold it
        return self._graph.keras_model(self._specs)

    # -- what callbacks use of a model ----------------------------------------------------

    @property
    def optimizer(self) -> LogicalOptimizer:
        """The one logical optimizer (every device's copy behind it: ``logical_optimizer``):
        what a user or a callback reads of it every copy agrees on, what it writes reaches
        every copy."""
        if not self.built:
            raise RuntimeError("the pipeline is not built yet; call build() or fit()")
        if self._logical_optimizer is None:
            variables = optimizer_state.logical_variables(
                self.stages, self.placement, self._optimizers.make
            )
            mirrors.mirror(variables)
            copies = [copy.optimizer for row in self.stages for copy in row]
            self._logical_optimizer = LogicalOptimizer(copies, variables)
        return self._logical_optimizer

    @property
    def last_loss(self) -> float:
        """The loss of the newest training or evaluation step alone (``logs["loss"]`` is
        the running mean over the epoch, as in Keras)."""
        return float(self._metrics.last_loss.numpy())

    @property
    def metrics(self) -> list[Any]:
        """The loss tracker and the compiled metrics, as ``keras.Model.metrics``."""
        return self._metrics.metrics

    def save(self, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
        """Saves the user's Keras model with the trained weights (``keras.Model.save``)."""
        self.to_keras().save(filepath, overwrite=overwrite, **kwargs)

    def save_weights(self, filepath: str, overwrite: bool = True) -> None:
        """``keras.Model.save_weights`` of the user's model with the trained weights, and the
        optimizer's variables where Keras writes a compiled model's (``weights_file``)."""
        self.to_keras().save_weights(filepath, overwrite=overwrite)
        if self.built and self._compiled_optimizer():
            weights_file.write_optimizer(filepath, self.optimizer)

    def load_weights(self, filepath: str, **kwargs: Any) -> None:
        """Loads weights saved by :meth:`save_weights` (or Keras) onto every device (the
        user's model's variables mirror their writes to every copy: ``step/mirrors.py``),
        and the optimizer's variables when the file holds them, as Keras does."""
        self.to_keras().load_weights(filepath, **kwargs)
        if self._compiled_optimizer() and str(filepath).endswith(".weights.h5"):
            weights_file.read_optimizer(filepath, self.optimizer)
            self.step_counter.assign(int(self.optimizer.iterations.numpy()))  # seeds follow

    def _compiled_optimizer(self) -> bool:
        return all(copy.optimizer is not None for row in self.stages for copy in row)

    def summary(self, print_fn: Any = None) -> None:
        """Prints the stages table (``hybrid.engine.api.summary``): per stage its devices, layer
        calls, parameters, the tensors crossing its cut and its estimated compute share; then
        the mesh, schedule, M, remat and the bubble. As ``keras.Model.summary``: printed with
        ``print_fn`` (default ``print``), returns None."""
        from hybrid.engine.api import summary as summary_lib

        summary_lib.summary(self, print_fn)

    def __repr__(self) -> str:
        from hybrid.engine.api import summary as summary_lib

        return f"{type(self).__name__}({summary_lib.one_line(self)})"

    def export(self, path: str, per_stage: bool = False) -> None:
        """Writes a SavedModel for serving (``serve`` and ``serving_default``, equal to
        :meth:`predict`); with ``per_stage``, one per stage under ``path/stage_<i>`` and the
        manifest ``path/pipeline.json`` (``hybrid.run.serving`` runs them pipelined)."""
        if not per_stage:
            export.export_model(self.to_keras(), path)
            return
        graph = self._graph
        inputs = graph.input_names or [f"input_{j}" for j in range(len(graph.inputs))]
        stages = [row[0] for row in self.stages]
        export.export_stages(stages, inputs, graph.output_names, path)

    # -- Keras's one-batch steps -----------------------------------------------------------

    def train_on_batch(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        class_weight: Any = None,
        return_dict: bool = False,
    ) -> Any:
        """One training step on the batch, as ``keras.Model.train_on_batch``: the metrics
        reset first, then the batch's loss and metrics (a dict with ``return_dict``, else
        the loss alone or a list in Keras's order)."""
        self._require_compiled("train_on_batch")
        sample_weight = keras_private.class_weights(y, sample_weight, class_weight)
        self._metrics.reset()
        self._train_one(self._batch(x, y, sample_weight))
        return self._batch_logs(return_dict)

    def _batch_logs(self, return_dict: bool) -> Any:
        logs = keras_private.batch_logs(self._metrics.result())
        return logs if return_dict else keras_private.logs_in_order(self, logs)

    def test_on_batch(
        self, x: Any, y: Any = None, sample_weight: Any = None, return_dict: bool = False
    ) -> Any:
        """The batch's loss and metrics in inference mode, as ``keras.Model.test_on_batch``
        (the metrics reset first)."""
        self._require_compiled("test_on_batch")
        self._metrics.reset()
        self._test_batch(self._batch(x, y, sample_weight))
        return self._batch_logs(return_dict)

    def predict_on_batch(self, x: Any) -> Any:
        """The model's outputs for the batch, as ``keras.Model.predict_on_batch``."""
        self._require_compiled("predict_on_batch")
        outputs = [t.numpy() for t in self._predict_batch(self._batch(x))]
        return self._output_structure(outputs)

    # -- the loops ------------------------------------------------------------------------

    def _finalize_variable_values(self) -> None:
        """What Keras's ``fit`` does at its end (``optimizer.finalize_variable_values``): an
        optimizer with ``use_ema`` replaces the trained weights by their averages, on every
        copy (with sharded optimizer states: the owners', then sent to the others)."""
        for row in self.stages:
            for copy in row:
                if copy.optimizer is not None:
                    copy.optimizer.finalize_variable_values(copy.updated_variables)
            sharding.broadcast(row)

    def _callbacks(self, callbacks: Any, verbose: Any, epochs: int, steps: Any) -> Any:
        if isinstance(callbacks, keras.callbacks.CallbackList):
            return callbacks
        return keras.callbacks.CallbackList(
            callbacks,
            add_history=True,
            add_progbar=verbose != 0,
            verbose=verbose,
            epochs=epochs,
            steps=steps,
            model=self,
        )

    def _feed(
        self, iterator: Any, labelled: bool = True, per_host: PerHostDataset | None = None
    ) -> feed.Feed:
        """Builds the pipeline (and its metrics) from the data's first batch, as Keras's
        symbolic build does before the callbacks start; then feeds the iterator's batches
        to the loop prepared (padded to the call's first batch, cut into the replicas'
        shards) and, with ``prefetch``, on their devices ahead of the step (``feed.py``).
        ``labelled``: the step takes labels and sample weights (``predict``'s does not).
        ``per_host``: the iterator counts steps, the shards come from the hosts' datasets
        (``per_host.py``), already cut."""
        if not self.built:
            for _, _, data in iterator:
                first = per_host.zeros() if per_host is not None else data[0]
                self._batch(*keras_private.unpack_x_y_sample_weight(first))
                break
        iterator.reset()
        padding = _Padding(self.config)
        depth = feed.check_depth(self.prefetch) * self.steps_per_execution  # executions

        def place(parts: Any) -> Any:
            return Keyed(feed.on_devices(parts, *self._shard_devices()) if depth else parts)

        if per_host is not None:
            per_host.check(self.config.micro_batches, self._specs)
            iterator.feed = feeding = feed.Feed(place, depth, source=per_host.batches)
            return feeding

        def prepare(data: Any) -> Any:
            x, y, w = keras_private.unpack_x_y_sample_weight(data)
            if not labelled:
                y = w = None
            return place(self._batch(x, y, w, padding(x)))

        iterator.feed = feeding = feed.Feed(prepare, depth)
        return feeding

    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: Any = "auto",
        callbacks: Any = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool = True,
        class_weight: Any = None,
        sample_weight: Any = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int | Sequence[int] = 1,
    ) -> keras.callbacks.History:
        """Trains for ``epochs`` as ``keras.Model.fit`` does (same arguments, callbacks,
        progress bar and returned ``History``), one pipelined step per batch,
        ``steps_per_execution`` of them per call (``executions.py``)."""
        self._require_compiled("fit")
        x, per_host = steps_of(x, y, sample_weight, "fit")
        shuffle = shuffle and per_host is None  # the hosts' datasets shuffle themselves
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = keras_private.train_validation_split(
                (x, y, sample_weight), validation_split
            )
        iterator = keras_private.epoch_iterator(
            x=x,
            y=y,
            sample_weight=sample_weight,
            batch_size=batch_size,
            steps_per_epoch=steps_per_epoch,
            shuffle=shuffle,
            class_weight=class_weight,
            steps_per_execution=self.steps_per_execution,
        )
        with self._feed(iterator, per_host=per_host):
            callbacks = self._callbacks(callbacks, verbose, epochs, iterator.num_batches)
            self.stop_training = False
            callbacks.on_train_begin()
            training_logs = None
            initial_epoch = self._initial_epoch or initial_epoch  # as Keras's fit
            for epoch in range(initial_epoch, epochs):
                self._metrics.reset()
                callbacks.on_epoch_begin(epoch)
                ran = False  # an empty epoch logs nothing, as in Keras
                ran_out = iterator.ran_out
                with iterator.catch_stop_iteration():
                    for begin, end, data in iterator:
                        callbacks.on_train_batch_begin(begin)
                        self._train_execution(data)
                        ran = True
                        callbacks.on_train_batch_end(end, self._metrics.result())
                        if self.stop_training:
                            break
                if iterator.ran_out > ran_out and ran_out == 0:
                    _warn_ran_out(int(self.step_counter.numpy()))
                epoch_logs = self._metrics.result() if ran else {}
                if validation_data is not None and _should_eval(epoch, validation_freq):
                    val_x, val_y, val_w = (
                        (validation_data, None, None)
                        if isinstance(validation_data, PerHostDataset)
                        else keras_private.unpack_x_y_sample_weight(validation_data)
                    )
                    val_logs = self.evaluate(
                        val_x,
                        val_y,
                        sample_weight=val_w,
                        batch_size=validation_batch_size or batch_size,
                        steps=validation_steps,
                        callbacks=callbacks,
                        return_dict=True,
                    )
                    epoch_logs.update({f"val_{k}": value for k, value in val_logs.items()})
                callbacks.on_epoch_end(epoch, epoch_logs)
                training_logs = epoch_logs
                if self.stop_training:
                    break
        if epochs > initial_epoch:
            self._finalize_variable_values()
        callbacks.on_train_end(logs=training_logs)
        return self.history

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: Any = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Any = None,
        return_dict: bool = False,
    ) -> Any:
        """The loss and metrics over the data in inference mode, as ``keras.Model.evaluate``
        computes them (the loss: the batch-size weighted mean of the batches' losses)."""
        self._require_compiled("evaluate")
        x, per_host = steps_of(x, y, sample_weight, "evaluate")
        iterator = keras_private.epoch_iterator(
            x=x,
            y=y,
            sample_weight=sample_weight,
            batch_size=batch_size,
            steps_per_epoch=steps,
            steps_per_execution=self.steps_per_execution,
        )
        with self._feed(iterator, per_host=per_host):
            callbacks = self._callbacks(callbacks, verbose, 1, iterator.num_batches)
            self._metrics.reset()
            callbacks.on_test_begin()
            ran = False  # no data: empty logs, as in Keras
            for begin, end, data in iterator:
                callbacks.on_test_batch_begin(begin)
                self._test_execution(data)
                ran = True
                callbacks.on_test_batch_end(end, self._metrics.result())
        logs = self._metrics.result() if ran else {}
        callbacks.on_test_end(logs)
        return logs if return_dict else keras_private.logs_in_order(self, logs)

    def predict(
        self,
        x: Any,
        batch_size: int | None = None,
        verbose: Any = "auto",
        steps: int | None = None,
        callbacks: Any = None,
    ) -> Any:
        """The model's outputs for every example of ``x``, in order, structured as the
        model returns them (``keras.Model.predict``)."""
        self._require_compiled("predict")
        if isinstance(x, PerHostDataset):
            raise ValueError(
                "predict reads its inputs on the client and returns every output there; give "
                "it arrays or a tf.data.Dataset (per-host datasets feed fit and evaluate)"
            )
        iterator = keras_private.epoch_iterator(
            x=x,
            batch_size=batch_size,
            steps_per_epoch=steps,
            steps_per_execution=self.steps_per_execution,
        )
        pieces = []
        with self._feed(iterator, labelled=False):
            callbacks = self._callbacks(callbacks, verbose, 1, iterator.num_batches)
            callbacks.on_predict_begin()
            for begin, end, data in iterator:
                callbacks.on_predict_batch_begin(begin)
                each = [[t.numpy() for t in self._predict_batch(parts)] for parts in data]
                pieces += each
                outputs = [np.concatenate(p) for p in zip(*each, strict=True)]
                callbacks.on_predict_batch_end(end, {"outputs": self._output_structure(outputs)})
        callbacks.on_predict_end()
        return self._output_structure([np.concatenate(p) for p in zip(*pieces, strict=True)])
