"""BatchNormalization: exactly Keras with one micro-batch per step, defined otherwise.

The definition (docs/guide/exactness.md, ``engine/model/batch_norm.py``): training normalizes each
micro-batch with its own statistics; the moving statistics are updated once per step from the
moments of the layer's input over the whole global batch. So with replicas × micro_batches = 1
everything equals ``compile`` + ``train_on_batch``; with more, the moving statistics of a BN
whose input does not depend on another BN still equal Keras's after a step (the second BN's
input differs, since the first normalized micro-batches), every replica holds the same ones,
and a warning says so when the pipeline is built.

``BatchNormalization(synchronized=True)`` (``hybrid/engine/synced_norm.py``) normalizes each
micro-batch over the R replicas' micro-batches together: with M = 1 the step is Keras's under
``MirroredStrategy`` over R devices (losses, every weight and moving statistic, optimizer
slots, the all-reduce's gradient included); with M > 1 it is plain Keras normalizing each
group of R micro-batches alone, gradients summed over the groups.
"""

import contextlib
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import hybrid

import reference as ref
import runner

BATCH = 16


def model(seed=0, synchronized=False, conv=False):
    """Dense (or a 2×2 Conv2D: BN over 3 axes) -> BN -> Dense -> BN -> Dense."""
    keras.utils.set_random_seed(seed)
    first = [keras.layers.Dense(16)]
    if conv:
        first = [keras.layers.Reshape((2, 2, 2)), keras.layers.Conv2D(4, 2, padding="same")]
    return keras.Sequential(
        [
            keras.Input((ref.IN_FEATURES,)),
            *first,
            keras.layers.BatchNormalization(momentum=0.8, name="first", synchronized=synchronized),
            *[keras.layers.Flatten()] * conv,
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(momentum=0.8, name="second", synchronized=synchronized),
            keras.layers.Dense(ref.CLASSES),
        ]
    )


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def pair(stages, replicas, micro_batches, synchronized=False, strategy=None, conv=False, **kwargs):
    """The Keras model (compiled; built under ``strategy`` when given) and a pipeline of its
    twin with the same weights."""
    with strategy.scope() if strategy else contextlib.nullcontext():
        keras_model = model(synchronized=synchronized, conv=conv)
        keras_model.compile(optimizer=sgd(), loss=loss(), jit_compile=False)
    template = model(seed=1, synchronized=synchronized, conv=conv)
    template.set_weights(keras_model.get_weights())
    jit_compile = kwargs.pop("jit_compile", False)
    pipe = hybrid.Pipeline(
        template,
        mesh=hybrid.DeviceMesh.create(stages, replicas),
        micro_batches=micro_batches,
        **kwargs,
    )
    pipe.compile(optimizer=sgd(), loss=loss(), jit_compile=jit_compile)
    return keras_model, pipe


def sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


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
    with pytest.warns(UserWarning, match=r"micro-batch alone in training: 4 examples \(the glo"):
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


def test_the_copies_of_a_stage_trace_one_moving_statistics_update(monkeypatch):
    """At 2×2 the moving statistics' update (``batch_norm.update_copy``) is traced as often
    per stage as at 2×1: the copies of a stage run one traced update on their own
    statistics (``hybrid/engine/step/update.py``); every replica still ends with the
    moving statistics of the whole batch (test_moving_statistics_come_from_the_whole_batch)."""
    from hybrid.engine.model import batch_norm

    traced = []
    update_copy = batch_norm.update_copy

    def counting(copy, summed, count):
        traced.append(copy.index)
        return update_copy(copy, summed, count)

    monkeypatch.setattr(batch_norm, "update_copy", counting)

    def counts(replicas):
        traced.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # micro-batches of 4 examples
            _, pipe = pair(2, replicas, 2, schedule="1f1b")
            for step in range(2):
                pipe.train_step(*ref.batch(BATCH, seed=step + 1))
        return [traced.count(k) for k in range(2)]

    one = counts(1)
    assert min(one) > 0, one
    assert counts(2) == one


def test_no_warning_with_one_micro_batch_per_step():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pair(2, 1, 1)[1].build((None, ref.IN_FEATURES))


def momenta(optimizers):
    """Every momentum slot, in the order of the model's variables."""
    return [v.numpy() for o in optimizers for v in o.variables if "momentum" in v.name]


@pytest.mark.parametrize(
    "stages,schedule,remat,balance,conv",
    [
        (2, "1f1b", "never", None, False),
        (2, "gpipe", "always", None, True),
        (2, "1f1b", "never", [4, 1], False),
    ],
)
def test_synchronized_with_one_micro_batch_is_keras_under_mirrored_strategy(
    stages, schedule, remat, balance, conv
):
    """2 replicas, M = 1: each step normalizes over the whole global batch, as Keras's
    synchronized BN does under a MirroredStrategy over 2 devices (with jit_compile, a stage
    holding one runs without XLA, warned; the last, without BN, compiles)."""
    strategy = ref.mirrored_strategy()
    jit = balance is not None
    kwargs = dict(schedule=schedule, remat=remat, jit_compile=jit, balance=balance, conv=conv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keras_model, pipe = pair(stages, 2, 1, True, strategy, **kwargs)
        for step in range(2):
            x, y = ref.batch(BATCH, seed=step + 1)
            want = keras_model.train_on_batch(x, y)
            np.testing.assert_allclose(pipe.train_step(x, y)["loss"], want, rtol=1e-6)
    assert [str(w.message).split(" all-reduces")[0] for w in caught] == ["stage 0"] * jit
    assert [row[0].jit_compile for row in pipe.stages] == [False, jit]
    for r in range(2):  # every weight, the moving statistics with them, on each replica
        ref.assert_weights_close(pipe.replica_weights(r), keras_model.get_weights(), 1e-6, 1e-6)
    want = momenta([keras_model.optimizer])  # the gradients, the all-reduce's included
    got = momenta([copy.optimizer for row in pipe.stages for copy in row[:1]])
    ref.assert_weights_close(got, want, 1e-6, 1e-6)
    x, y = ref.batch(BATCH, seed=9)
    np.testing.assert_allclose(  # inference: the moving statistics, no all-reduce
        pipe.evaluate(x, y, verbose=0), keras_model.evaluate(x, y, verbose=0), rtol=1e-6
    )


def micro_batch_step(keras_model, optimizer, x, y, groups):
    """Plain Keras's step on the batch whose BatchNormalizations normalize each group of
    examples alone: the loss of the whole batch, its gradients applied by ``optimizer``, the
    moving statistics updated once from every group's moments (``batch_norm.py``)."""
    norms = [n for n in keras_model.layers if isinstance(n, keras.layers.BatchNormalization)]
    layers = keras_model.layers
    probe = keras.Model(layers[0].input, [n.input for n in norms] + [layers[-1].output])
    moving = [[n.moving_mean.numpy(), n.moving_variance.numpy()] for n in norms]
    moments = []
    with tf.GradientTape() as tape:
        total = 0.0
        for group in groups:
            *inputs, logits = probe(x[group], training=True)
            total += tf.reduce_sum(
                keras.losses.sparse_categorical_crossentropy(y[group], logits, from_logits=True)
            )
            moments.append([tf.nn.moments(t, [0]) for t in inputs])
        batch_loss = total / len(x)
    variables = keras_model.trainable_variables
    optimizer.apply(tape.gradient(batch_loss, variables), variables)
    for j, norm in enumerate(norms):
        means = np.stack([m[j][0] for m in moments])
        variances = np.stack([m[j][1] for m in moments])
        mean = means.mean(0)
        variance = variances.mean(0) + (means**2).mean(0) - mean**2
        for variable, old, new in zip(
            (norm.moving_mean, norm.moving_variance), moving[j], (mean, variance), strict=True
        ):
            variable.assign(old * norm.momentum + new * (1 - norm.momentum))
    return float(batch_loss)


INTERLEAVED = dict(virtual_stages=2, balance=[2, 1, 1, 1])  # both BNs' stages on device 0


@pytest.mark.parametrize(
    "stages,replicas,schedule,remat,more",
    [
        (2, 2, "1f1b", "never", {}),
        (2, 2, "1f1b", "always", {}),
        (2, 2, "gpipe", "except_last", {}),
        (2, 2, "zb-h1", "never", {}),
        (2, 2, "interleaved", "never", INTERLEAVED),
        (1, 4, "1f1b", "never", {}),
    ],
)
def test_synchronized_micro_batch_normalizes_the_replicas_micro_batches_together(
    stages, replicas, schedule, remat, more
):
    """M = 2: micro-batch m is normalized over every replica's micro-batch m together (8
    examples), which is plain Keras normalizing those groups alone (interleaved: two groups
    on the same devices, their all-reduces interleaved)."""
    R, M = replicas, 2
    keras_model, pipe = pair(stages, R, M, True, schedule=schedule, remat=remat, **more)
    optimizer = sgd()
    n = BATCH // (R * M)  # replica r's micro-batch m: rows r·B/R + m·n ... + n
    rows = np.arange(BATCH).reshape(R, M, n)
    groups = [rows[:, m].reshape(-1) for m in range(M)]  # micro-batch m of every replica
    with pytest.warns(UserWarning, match=rf"{R} replicas together: 8 examples \(the global b"):
        pipe.build((BATCH, ref.IN_FEATURES))
    for step in range(2):
        x, y = ref.batch(BATCH, seed=step + 1)
        want = micro_batch_step(keras_model, optimizer, x, y, groups)
        np.testing.assert_allclose(pipe.train_step(x, y)["loss"], want, rtol=1e-6)
    for r in range(R):
        ref.assert_weights_close(pipe.replica_weights(r), keras_model.get_weights(), 1e-6, 1e-6)
    synced = [row[0].synced is not None for row in pipe.stages]  # the all-reducing stages
    assert synced == ([True, False, True, False] if more else [True] * stages)
    x, _ = ref.batch(BATCH, seed=9)
    np.testing.assert_allclose(pipe.predict(x, verbose=0), keras_model(x), rtol=1e-5, atol=1e-6)


def test_synchronized_with_deferred_weight_gradients_is_the_undeferred_step(schedule="zb-h1"):
    """The deferral proof refuses a BatchNormalization stage: its W runs per micro-batch at
    the end (all-reduces in the same order on every replica), as the undeferred step's."""
    _, plain = pair(2, 2, 2, True, schedule=schedule, remat="never")
    _, deferred = pair(2, 2, 2, True, schedule=schedule, remat="never", defer_weight_gradients=True)
    for step in range(2):
        x, y = ref.batch(BATCH, seed=step + 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (micro-batches; W per micro-batch)
            assert deferred.train_step(x, y)["loss"] == plain.train_step(x, y)["loss"]
    ref.assert_weights_close(deferred.get_weights(), plain.get_weights(), 0, 0)
    assert all(isinstance(copy.deferral, str) for row in deferred.stages for copy in row)


def test_synchronized_in_a_strategy_program_is_the_meshs():
    """Pipeline(strategy=MirroredStrategy over 2 devices): Keras's own synchronized moments
    all-reduce through the replica context, with the same step as on the 2×2 mesh."""
    keras_model, mesh = pair(2, 2, 2, True, remat="never")
    template = model(seed=1, synchronized=True)
    template.set_weights(keras_model.get_weights())
    program = hybrid.Pipeline(
        template,
        hybrid.DeviceMesh.create(2, 2),
        strategy=ref.mirrored_strategy(),
        micro_batches=2,
        remat="never",
    )
    program.compile(optimizer=sgd(), loss=loss(), jit_compile=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (micro-batches)
        for step in range(2):
            x, y = ref.batch(BATCH, seed=step + 1)
            want = mesh.train_step(x, y)["loss"]
            np.testing.assert_allclose(program.train_step(x, y)["loss"], want, rtol=1e-6)
    ref.assert_weights_close(program.get_weights(), mesh.get_weights(), 1e-6, 1e-6)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
