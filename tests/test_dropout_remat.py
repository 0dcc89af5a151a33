"""Remat stays exact with random layers: a recomputed forward draws the same dropout mask.

For every schedule, "always" and "except_last" must give the same gradients and the same
weights after training as "never" (which recomputes nothing), with Dropout in the model.
"""

import sys

import keras
import numpy as np
import pytest

import hybrid
from hybrid.core import schedule as sched

import reference as ref
import runner

BATCH = 32


def dropout_layers(seed=0, dropout_seed=7):
    keras.utils.set_random_seed(seed)
    return [
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.5, seed=dropout_seed),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.3, seed=dropout_seed + 1),
        keras.layers.Dense(16),
        keras.layers.Dropout(0.2, seed=dropout_seed + 2),
        keras.layers.Dense(ref.CLASSES),
    ]


def make(schedule, remat, dropout_seed=7):
    pipe = hybrid.Pipeline(
        dropout_layers(dropout_seed=dropout_seed),
        mesh=hybrid.DeviceMesh.create(2, 2),
        micro_batches=4,
        schedule=schedule,
        remat=remat,
        virtual_stages=2 if schedule == "interleaved" else 1,
    )
    pipe.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=ref.loss_fn(),
        jit_compile=schedule in ("gpipe", "zb-h1"),
    )
    pipe.build((None, ref.IN_FEATURES))
    return pipe


@pytest.mark.parametrize("schedule", sched.names())
def test_recomputation_draws_the_same_masks(schedule):
    never = make(schedule, "never")
    weights = never.get_weights()
    x, y = ref.batch(BATCH, seed=3)
    want = never.gradients(x, y)
    # except_last mixes both paths in one step; "always" recomputes every micro-batch.
    pipes = {}
    for remat in ("always", "except_last") if schedule == "1f1b" else ("always",):
        pipes[remat] = pipe = make(schedule, remat)
        pipe.set_weights(weights)
        for got, expected in zip(pipe.gradients(x, y), want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7, err_msg=remat)
    # Training steps (the step counter moves the masks on) stay in lockstep too; gradients()
    # updated nothing, so the "always" pipeline still holds the initial weights.
    always = pipes["always"]
    ref.assert_weights_close(always.get_weights(), weights, rtol=0, atol=0)
    for step in range(2):
        xs, ys = ref.batch(BATCH, seed=10 + step)
        np.testing.assert_allclose(
            always.train_step(xs, ys)["loss"], never.train_step(xs, ys)["loss"], rtol=1e-5
        )
    ref.assert_weights_close(always.get_weights(), never.get_weights())


def test_dropout_is_really_active():
    """Masks depend on the seed and on the step: otherwise the test above proves nothing."""
    a, b = make("1f1b", "always", dropout_seed=7), make("1f1b", "always", dropout_seed=8)
    b.set_weights(a.get_weights())
    x, y = ref.batch(BATCH, seed=3)
    assert not np.allclose(a.gradients(x, y)[0], b.gradients(x, y)[0])
    loss = a.evaluate(x, y, verbose=0)  # inference mode: no dropout, deterministic
    assert loss == a.evaluate(x, y, verbose=0)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
