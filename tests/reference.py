"""The single-device reference every pipelined run is compared with.

A plain ``keras.Sequential`` of the same layers with the same initial weights, trained on the
whole batch with a ``tf.GradientTape`` step on one device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import hybrid

IN_FEATURES = 8
CLASSES = 10


def mlp_layers(seed: int = 0, width: int = 16) -> list[keras.layers.Layer]:
    """Dense/activation layers with LayerNorm and no residuals (the test model)."""
    keras.utils.set_random_seed(seed)
    return [
        keras.layers.Dense(width, activation="relu"),
        keras.layers.LayerNormalization(),
        keras.layers.Dense(width),
        keras.layers.Activation("tanh"),
        keras.layers.Dense(width, activation="gelu"),
        keras.layers.LayerNormalization(),
        keras.layers.Dense(width),
        keras.layers.Dense(CLASSES),
    ]


@functools.cache
def mirrored_strategy() -> tf.distribute.MirroredStrategy:
    """The process's one MirroredStrategy over CPU:0 and CPU:1. Strategies made one after
    another in a process draw the same collective keys, and the runtime then pairs one's
    all-reduce with another's (a shape mismatch, or a hang): every test shares this one."""
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def batch(size: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(size, IN_FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(size,)).astype("int32")
    return x, y


def loss_fn() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


OPTIMIZERS: dict[str, Callable[[], keras.optimizers.Optimizer]] = {
    "sgd_momentum": lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
    # Adam divides by sqrt(v) + epsilon: where a gradient element is a near-cancelling sum
    # of size ~epsilon, one ulp of summation order (XLA's vs TensorFlow's kernels) moves the
    # update by up to lr. epsilon = 1e-3 bounds d(update)/d(grad) by lr / epsilon = 1, so a
    # weight differs only as much as its gradients do; the comparison stays exact elsewhere.
    "adam": lambda: keras.optimizers.Adam(learning_rate=1e-3, epsilon=1e-3),
}


COMPILE_ARGUMENTS = (
    "optimizer",
    "loss",
    "loss_weights",
    "metrics",
    "weighted_metrics",
    "jit_compile",
)


def compile_options(kwargs: dict) -> dict:
    """Takes ``Pipeline.compile``'s arguments out of ``kwargs`` (the rest are the layout)."""
    return {k: kwargs.pop(k) for k in COMPILE_ARGUMENTS if k in kwargs}


def pipeline(
    stages: int = 2,
    replicas: int = 1,
    *,
    layers: list[keras.layers.Layer] | None = None,
    mesh: hybrid.DeviceMesh | None = None,
    optimizer: str | Any = "sgd_momentum",
    micro_batches: int = 2,
    schedule: str = "gpipe",
    weights: Sequence[np.ndarray] | None = None,
    build: bool = False,
    **kwargs: Any,
) -> hybrid.Pipeline:
    """The test MLP (or ``layers``) as a Pipeline on an S × R mesh of this process.

    Args:
      mesh: another mesh (a cluster's) instead of this process's first S × R devices.
      optimizer: a name in :data:`OPTIMIZERS`, or anything ``Pipeline`` takes.
      schedule: interleaved gets 2 virtual stages unless ``virtual_stages`` is given.
      weights: set on every replica (the pipeline is built first).
      build: build for the test input even without ``weights``.
      kwargs: the rest of ``Pipeline``'s arguments.
    """
    kwargs.setdefault("virtual_stages", 2 if schedule == "interleaved" else 1)
    options = compile_options(kwargs)
    pipe = hybrid.Pipeline(
        layers if layers is not None else mlp_layers(),
        mesh=mesh or hybrid.DeviceMesh.create(stages, replicas),
        micro_batches=micro_batches,
        schedule=schedule,
        **kwargs,
    )
    pipe.compile(
        optimizer=OPTIMIZERS[optimizer]() if isinstance(optimizer, str) else optimizer,
        loss=loss_fn(),
        **options,
    )
    if build or weights is not None:
        pipe.build((None, IN_FEATURES))
    if weights is not None:
        pipe.set_weights(weights)
    return pipe


class Reference:
    """``model`` on the default device, trained one whole batch per step."""

    def __init__(self, layers: list[keras.layers.Layer], optimizer: keras.optimizers.Optimizer):
        with tf.device("/device:CPU:0"):
            self.model = keras.Sequential([keras.Input((IN_FEATURES,))] + layers)
            self.optimizer = optimizer
            self.optimizer.build(self.model.trainable_variables)
        self.loss = loss_fn()
        self._step = tf.function(self._train_step)

    def _train_step(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
        with tf.device("/device:CPU:0"):
            with tf.GradientTape() as tape:
                loss = self.loss(y, self.model(x, training=True))
            grads = tape.gradient(loss, self.model.trainable_variables)
            self.optimizer.apply(grads, self.model.trainable_variables)
        return loss, grads

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        loss, _ = self._step(x, y)
        return float(loss)

    def gradients(self, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
        """Gradients of the mean loss on (x, y) at the current weights (no update)."""
        with tf.GradientTape() as tape:
            loss = self.loss(y, self.model(x, training=True))
        return [g.numpy() for g in tape.gradient(loss, self.model.trainable_variables)]


def assert_weights_close(
    actual: list[np.ndarray], expected: list[np.ndarray], rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    assert len(actual) == len(expected), (len(actual), len(expected))
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"weight {i}")
