"""BatchNormalization: exactly Keras with one micro-batch per step, defined otherwise.

The definition (README, ``hybrid/engine/batch_norm.py``): training normalizes each
micro-batch with its own statistics; the moving statistics are updated once per step from the
moments of the layer's input over the whole global batch. So with replicas × micro_batches = 1
everything equals ``compile`` + ``train_on_batch``; with more, the moving statistics of a BN
whose input does not depend on another BN still equal Keras's after a step (the second BN's
input differs, since the first normalized micro-batches), every replica holds the same ones,
and a warning says so when the pipeline is built.
"""

import sys
import warnings

import keras
import numpy as np
import pytest

import hybrid

import reference as ref
import runner

BATCH = 16


def model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((ref.IN_FEATURES,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(momentum=0.8, name="first"),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(momentum=0.8, name="second"),
            keras.layers.Dense(ref.CLASSES),
        ]
    )


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def pair(stages, replicas, micro_batches, **kwargs):
    """The Keras model (compiled) and a pipeline of its twin with the same weights."""
    keras_model = model()
    keras_model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss())
    template = model(seed=1)
    template.set_weights(keras_model.get_weights())
    pipe = hybrid.Pipeline(
        template,
        mesh=hybrid.DeviceMesh.create(stages, replicas),
        loss=loss(),
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        micro_batches=micro_batches,
        jit_compile=False,
        **kwargs,
    )
    return keras_model, pipe


def moving(weights, keras_model, name):
    """The (moving_mean, moving_variance) arrays of layer ``name`` in ``weights``."""
    paths = [v.path.split("/", 1)[-1] for v in keras_model.weights]
    return [weights[paths.index(f"{name}/moving_{kind}")] for kind in ("mean", "variance")]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_micro_batch_per_step_is_exactly_keras(schedule):
    keras_model, pipe = pair(2, 1, 1, schedule=schedule)
    for step in range(2):
        x, y = ref.batch(BATCH, seed=step + 1)
        want = keras_model.train_on_batch(x, y)
        np.testing.assert_allclose(pipe.train_step(x, y)["loss"], want, rtol=1e-5)
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())
    x, y = ref.batch(BATCH, seed=9)
    np.testing.assert_allclose(  # inference mode: normalized by the moving statistics
        pipe.evaluate(x, y, verbose=0), keras_model.evaluate(x, y, verbose=0), rtol=1e-5
    )
    trained = pipe.to_keras()  # moving statistics written back with the weights
    ref.assert_weights_close(trained.get_weights(), keras_model.get_weights())


@pytest.mark.parametrize(
    "stages,replicas,micro_batches,remat",
    [(2, 1, 4, "always"), (1, 2, 2, "never"), (2, 2, 2, "except_last")],
)
def test_moving_statistics_come_from_the_whole_batch(stages, replicas, micro_batches, remat):
    keras_model, _ = pair(1, 1, 1)
    with pytest.warns(UserWarning, match=r"normalize each micro-batch .* 1/\d+ of it"):
        _, pipe = pair(stages, replicas, micro_batches, schedule="1f1b", remat=remat)
        x, y = ref.batch(BATCH, seed=1)
        pipe.train_step(x, y)
    keras_model.train_on_batch(x, y)
    want = moving(keras_model.get_weights(), keras_model, "first")
    for r in range(replicas):
        got = moving(pipe.replica_weights(r), keras_model, "first")
        ref.assert_weights_close(got, want)  # counted once per micro-batch, remat or not
    # The second BN's input comes from micro-batch normalization: defined, not Keras's.
    second = moving(pipe.get_weights(), keras_model, "second")
    assert not np.allclose(second[1], moving(keras_model.get_weights(), keras_model, "second")[1])


def test_no_warning_with_one_micro_batch_per_step():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pair(2, 1, 1)[1].build((None, ref.IN_FEATURES))


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
