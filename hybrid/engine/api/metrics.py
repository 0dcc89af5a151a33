"""What ``fit`` and ``evaluate`` report: the loss tracker and the compiled metrics, as Keras
keeps them.

Keras updates, after every step on a batch of n examples::

    loss_tracker.update_state(loss, sample_weight=n)          # "loss": batch-size weighted
    compile_metrics.update_state(y, y_pred, sample_weight)    # "accuracy", "auc", ...

The pipeline computes the same on the *global* batch: the last stage returns each
micro-batch's model outputs beside its loss terms, the step concatenates them over
micro-batches and replicas into the batch's predictions (in example order), drops the
padding examples of a partial batch, and updates Keras's own metric objects once. Every
metric (a mean, a confusion-matrix AUC, anything) therefore sees exactly the labels and
predictions it would see in ``model.fit``, however the batch was split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from hybrid.engine import keras_private
from hybrid.engine.api.batches import structured
from hybrid.engine.traced import Traced

__all__ = ["StepMetrics"]


class StepMetrics:
    """The loss tracker and the ``compile``-style metrics of one pipeline.

    Args:
      metrics, weighted_metrics: as ``keras.Model.compile`` takes them (strings,
        ``keras.metrics`` objects; a list per output or a dict by output name for a model
        of several outputs); None for none.
      output_names: the model's output names (metric names get them as prefixes on a model
        of several outputs), or None.
      dict_names: the names of a model that returns a dict (labels and predictions are
        given to the metrics as dicts), else None.
    """

    def __init__(
        self,
        metrics: Any,
        weighted_metrics: Any,
        output_names: Sequence[str] | None,
        dict_names: tuple[str, ...] | None,
    ) -> None:
        self.loss = keras.metrics.Mean(name="loss")
        # A model of several outputs also reports each one's loss, as "<output>_loss".
        names = list(dict_names or output_names or [])
        self.output_losses = (
            [keras.metrics.Mean(name=f"{name}_loss") for name in names] if len(names) > 1 else []
        )
        # The newest step's own loss (the tracker keeps the running mean).
        self.last_loss = tf.Variable(0.0, trainable=False, name="last_loss")
        self.compiled = (
            keras_private.compile_metrics(
                metrics, weighted_metrics, list(output_names) if output_names else None
            )
            if metrics or weighted_metrics
            else None
        )
        self._names = dict_names
        self._results = Traced(self._tensors)  # one trace before compiled is built, one after
        self._reset = Traced(self._reset_all)  # likewise
        self._returned: dict[str, tf.Tensor] | None = None  # the latest step's logs

    @property
    def needs_predictions(self) -> bool:
        """Whether the steps must return the model's outputs (compiled metrics exist)."""
        return self.compiled is not None

    @property
    def metrics(self) -> list[Any]:
        """The metric objects, as ``keras.Model.metrics`` lists them."""
        compiled = [self.compiled] if self.compiled is not None else []
        return [self.loss, *self.output_losses, *compiled]

    def build(self, y_true: list[tf.Tensor], shapes: Sequence[tuple[int | None, ...]]) -> None:
        """Creates the compiled metrics' variables from a batch of labels and the shapes of
        the outputs (Keras resolves "accuracy" from them), before any step traces."""
        if self.compiled is not None and not self.compiled.built:
            y_pred = [tf.zeros((1, *shape)) for shape in shapes]
            labels = [t[:1] for t in y_true]
            self.compiled.build(structured(labels, self._names), structured(y_pred, self._names))

    def update(
        self,
        examples: tf.Tensor,
        loss: tf.Tensor,
        output_losses: tf.Tensor,
        y_true: list[tf.Tensor] | None = None,
        y_pred: list[tf.Tensor] | None = None,
        sample_weight: list[tf.Tensor] | None = None,
    ) -> None:
        """Adds one step: its loss (weighted by the step's ``examples``, the real ones), each
        output's loss and, with compiled metrics, the batch's first ``examples`` labels and
        predictions (the rest are padding)."""
        count = tf.cast(examples, tf.float32)
        self.loss.update_state(loss, sample_weight=count)
        self.last_loss.assign(tf.cast(loss, tf.float32))
        # Keras weighs each output's loss by the batch's static size, unknown (None: weight
        # 1) in its traced step whenever batches differ in size: a plain mean over steps.
        for metric, value in zip(self.output_losses, tf.unstack(output_losses), strict=False):
            metric.update_state(value)
        if self.compiled is None or y_true is None or y_pred is None:
            return

        def real(tensors: list[tf.Tensor]) -> Any:
            return structured([t[:examples] for t in tensors], self._names)

        weights = real(sample_weight) if sample_weight is not None else None
        self.compiled.update_state(real(y_true), real(y_pred), weights)

    @property
    def _built(self) -> bool:
        """Whether the compiled metrics have state yet (a trace of the logs or of the reset
        is made for each answer)."""
        return self.compiled is not None and self.compiled.built

    def tensors(self) -> dict[str, tf.Tensor]:
        """The logs as tensors, for a traced step to return after its updates (as Keras's
        train function returns its metrics' results): reading them then takes no call of
        its own (:meth:`returned`)."""
        return self._tensors(self._built)

    def returned(self, logs: dict[str, tf.Tensor]) -> None:
        """Keeps the logs a step returned (:meth:`tensors`): :meth:`result` reads them until
        the next step or :meth:`reset`."""
        self._returned = logs

    def result(self) -> dict[str, float]:
        """The logs ``fit`` reports: ``loss`` first, then each compiled metric by name: the
        ones the latest step returned, else read by one traced function (Keras's eager
        ``result()`` of each metric costs as much as a small step)."""
        logs = self._returned
        if logs is None:
            logs = self._results(self._built)
        return {name: float(value) for name, value in logs.items()}

    def _tensors(self, built: bool) -> dict[str, tf.Tensor]:
        """The logs as tensors; ``built``: whether the compiled metrics have state yet."""
        logs = {"loss": self.loss.result()}
        logs.update({m.name: m.result() for m in self.output_losses})
        if built and self.compiled is not None:
            logs.update(self.compiled.result())
        return logs

    def reset(self) -> None:
        """Every metric's ``reset_state``, in one traced call (eagerly, each variable's
        assignment is an op of its own: as much as a small step)."""
        self._returned = None
        self._reset(self._built)

    def _reset_all(self, built: bool) -> None:
        del built  # the compiled metrics' variables, once built, are in the trace
        for metric in self.metrics:
            metric.reset_state()
