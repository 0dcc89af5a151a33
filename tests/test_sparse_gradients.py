"""Sparse gradients (an Embedding's lookup) are applied as Keras applies them on one device:
the optimizer gets the IndexedSlices of every micro-batch and replica, in example order, so
its sparse path (Adam squaring each slice, Adagrad, momentum, EMA) gives Keras's weights.

The reference is ``model.compile(optimizer, loss)`` + ``train_on_batch`` on the whole
batch, from the same initial weights. Token ids repeat within the batch, where the sparse
and the densified update differ (Adam moved the embedding by 0.0585 in two steps; the
densified pipeline was 0.0385 off), so every comparison below fails on a densified path.
"""

from __future__ import annotations

import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import hybrid

import runner

SEQ, VOCAB, CLASSES, BATCH = 6, 32, 5, 16


def embedding_model(seed: int = 3, mask_zero: bool = True) -> keras.Model:
    """Embedding → Dense → pooling → Dense: the embedding's gradient is IndexedSlices."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 12, mask_zero=mask_zero, name="tokens")(ids)
    h = keras.layers.Dense(8, activation="tanh")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(ids, keras.layers.Dense(CLASSES)(h))


def tokens(step: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch whose ids repeat (8 distinct ids in 96 lookups)."""
    rng = np.random.default_rng(step)
    x = rng.integers(0, 8, size=(BATCH, SEQ)).astype("int32")
    return x, rng.integers(0, CLASSES, size=(BATCH,)).astype("int32")


def loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw_excluded": lambda: adamw_excluding_biases(),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam_ema": lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.5),
    "adam_clipnorm": lambda: keras.optimizers.Adam(1e-2, clipnorm=0.05),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.05),
}


def adamw_excluding_biases() -> keras.optimizers.Optimizer:
    optimizer = keras.optimizers.AdamW(1e-2, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


def keras_run(optimizer: str, steps: int = 2, jit_compile: bool = False) -> tuple[list, list]:
    """Keras on one device: the losses and the final weights."""
    model = embedding_model()
    model.compile(OPTIMIZERS[optimizer](), loss(), jit_compile=jit_compile)
    losses = [float(model.train_on_batch(*tokens(step))) for step in range(steps)]
    return losses, model.get_weights()


def pipeline_run(
    optimizer: str, stages: int, replicas: int, micro_batches: int, steps: int = 2, **kwargs
) -> tuple[list, list, hybrid.Pipeline]:
    jit_compile = kwargs.pop("jit_compile", False)
    pipe = hybrid.Pipeline(
        embedding_model(),
        mesh=hybrid.DeviceMesh.create(stages, replicas),
        micro_batches=micro_batches,
        **kwargs,
    )
    pipe.compile(optimizer=OPTIMIZERS[optimizer](), loss=loss(), jit_compile=jit_compile)
    losses = [pipe.train_step(*tokens(step))["loss"] for step in range(steps)]
    if optimizer == "adam_ema":  # as fit ends: the averages replace the trained weights
        pipe._finalize_variable_values()
    return losses, pipe.get_weights(), pipe


def assert_as_keras(got: tuple, want: tuple) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, atol=2e-6)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mesh", [(1, 1, 1), (2, 2, 2)], ids=["1x1_M1", "2x2_M2"])
def test_sparse_gradients_train_as_keras(optimizer, mesh):
    S, R, M = mesh
    if optimizer == "adam_ema":
        want_model = embedding_model()
        want_model.compile(OPTIMIZERS[optimizer](), loss())
        for step in range(2):
            want_model.train_on_batch(*tokens(step))
        want_model.optimizer.finalize_variable_values(want_model.trainable_variables)
        want = ([0.0, 0.0], want_model.get_weights())
        got = pipeline_run(optimizer, S, R, M)
        assert_as_keras(([0.0, 0.0], got[1]), want)
        return
    got = pipeline_run(optimizer, S, R, M, balance=[1, 4] if S == 2 else None)
    assert_as_keras(got[:2], keras_run(optimizer))


@pytest.mark.parametrize("optimizer", ["adam", "adamw_excluded", "adam_global_clipnorm"])
def test_sharded_optimizer_states_apply_slices_as_keras(optimizer):
    """ZeRO-1: the embedding's owner applies the gathered slices, the others take its rows."""
    got = pipeline_run(optimizer, 2, 2, 2, balance=[2, 3], shard_optimizer_states=True)
    assert_as_keras(got[:2], keras_run(optimizer))
    assert not all(all(copy.updates) for row in got[2].stages for copy in row)


@pytest.mark.parametrize(
    "schedule,remat,micro_batches,defer",
    [("1f1b", "never", 4, False), ("zb-h1", "never", 4, False), ("1f1b", "never", 4, True)],
)
def test_sparse_gradients_on_xla_schedules(schedule, remat, micro_batches, defer):
    """Compiled stage programs, split backwards (B then W) and deferral: the slices come out
    of each micro-batch's program and are joined outside it; deferred, the embedding's W
    runs once over the step's rows, its slices the micro-batches' joined (no fallback)."""
    from hybrid.engine.programs.row_sums import Plan

    kwargs = dict(schedule=schedule, remat=remat, defer_weight_gradients=defer, jit_compile=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="stage .* computes its weight gradients")
        got = pipeline_run(
            "adam", 2, 1 if defer else 2, micro_batches // (1 if defer else 2), **kwargs
        )
    assert_as_keras(got[:2], keras_run("adam", jit_compile=True))
    if defer:
        assert all(isinstance(row[0].deferral, Plan) for row in got[2].stages)


def test_a_sparse_gradient_is_what_keras_hands_the_optimizer():
    """The stage holds which gradients are slices; a densified path is really different
    (so the comparisons above can fail), and ``gradients()`` returns Keras's sums."""
    pipe = hybrid.Pipeline(
        embedding_model(), mesh=hybrid.DeviceMesh.create(2, 2), micro_batches=2, balance=[1, 4]
    )
    pipe.compile(optimizer="adam", loss=loss(), jit_compile=False)
    pipe.build((None, SEQ), "int32")
    assert [row[0].sparse for row in pipe.stages] == [[True], [False] * 4]
    model = embedding_model()
    x, y = tokens(0)
    with tf.GradientTape() as tape:
        value = loss()(y, model(x))
    want = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(value, model.trainable_weights)]
    for got, expected in zip(pipe.gradients(x, y), want, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-6)
    densified = embedding_model()
    densified.compile(keras.optimizers.Adam(1e-2), loss())
    with tf.GradientTape() as tape:
        value = loss()(y, densified(x))
    grads = [tf.convert_to_tensor(g) for g in tape.gradient(value, densified.trainable_weights)]
    densified.optimizer.apply(grads, densified.trainable_weights)
    sparse_model = embedding_model()
    sparse_model.compile(keras.optimizers.Adam(1e-2), loss())
    sparse_model.train_on_batch(x, y)
    gap = np.abs(densified.get_weights()[0] - sparse_model.get_weights()[0]).max()
    assert gap > 1e-3, gap


def test_slices_are_gathered_in_replica_order_by_every_method():
    """Across a replica group IndexedSlices are concatenated in replica order on every
    device, by the local sum and by the collective alike (a mean divides the values)."""
    from hybrid.engine.step import collectives

    local = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]
    rng = np.random.default_rng(0)
    values = [rng.normal(size=(3, 2)).astype("float32") for _ in local]
    ids = [np.array([i, 0, i], "int64") for i in range(4)]
    dense = [rng.normal(size=(5,)).astype("float32") for _ in local]
    for method in ("sum", "collective"):
        group = collectives.ReplicaGroup(local, method=method)

        @tf.function(autograph=False)
        def reduce(group=group):
            per = []
            for device, v, i, d in zip(local, values, ids, dense, strict=True):
                with tf.device(device):
                    slices = tf.IndexedSlices(tf.constant(v), tf.constant(i), tf.constant([4, 2]))
                    per.append([tf.constant(d), slices])
            return group.all_reduce_sum(per), group.all_reduce_mean(per)

        sums, means = reduce()
        for row, mean_row in zip(sums, means, strict=True):
            np.testing.assert_allclose(row[0].numpy(), sum(dense), rtol=1e-6)
            np.testing.assert_array_equal(row[1].values.numpy(), np.concatenate(values))
            np.testing.assert_array_equal(row[1].indices.numpy(), np.concatenate(ids))
            np.testing.assert_allclose(mean_row[1].values.numpy(), np.concatenate(values) / 4)


def test_the_strategy_executor_gathers_slices_as_mirrored_strategy_does():
    """The step as one program per replica (``Pipeline(strategy=MirroredStrategy)``):
    the replica context's all_gather carries the slices."""
    from reference import mirrored_strategy

    pipe = hybrid.Pipeline(
        embedding_model(),
        hybrid.DeviceMesh.create(1, 2),
        strategy=mirrored_strategy(),
        micro_batches=2,
    )
    pipe.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss(), jit_compile=False)
    losses = [pipe.train_step(*tokens(step))["loss"] for step in range(2)]
    assert_as_keras((losses, pipe.get_weights()), keras_run("adam"))


def two_lookups_model() -> keras.Model:
    """One Embedding looked up on two inputs, the lookups on two stages."""
    keras.utils.set_random_seed(0)
    a, b = keras.Input((SEQ,), dtype="int32"), keras.Input((SEQ,), dtype="int32")
    shared = keras.layers.Embedding(VOCAB, 4, name="shared")
    h = keras.layers.Dense(4)(shared(a))
    h = keras.layers.Add()([h, shared(b)])
    return keras.Model([a, b], keras.layers.Dense(CLASSES)(keras.layers.Flatten()(h)))


def test_an_embedding_looked_up_on_two_stages_joins_both_stages_slices():
    """Keras joins the slices of both lookups; the tie group concatenates the stages'."""
    x, y = tokens(0)
    xs = [x, x[::-1].copy()]
    want = two_lookups_model()
    start = want.get_weights()
    want.compile(keras.optimizers.Adam(1e-2), loss())
    for _ in range(2):
        want.train_on_batch(xs, y)
    model = two_lookups_model()
    model.set_weights(start)
    pipe = hybrid.Pipeline(
        model, mesh=hybrid.DeviceMesh.create(2, 2), micro_batches=2, balance=[2, 4]
    )
    pipe.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss(), jit_compile=False)
    for _ in range(2):
        pipe.train_step(xs, y)
    assert [row[0].sparse[0] for row in pipe.stages] == [True, True]  # held by both
    for g, w in zip(pipe.get_weights(), want.get_weights(), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-6)


class GatherInTraining(keras.layers.Layer):
    """A lookup by gather in training and by a one-hot product in inference (one value)."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=(VOCAB, 12), initializer="uniform")

    def call(self, ids, training=None):
        if training:
            return keras.ops.take(self.table, ids, axis=0)
        return keras.ops.matmul(keras.ops.one_hot(ids, VOCAB), self.table)


class PenalizedEmbedding(keras.layers.Embedding):
    """An embedding that adds a dense penalty of its table with add_loss."""

    def call(self, ids):
        self.add_loss(1e-2 * keras.ops.sum(keras.ops.square(self.embeddings)))
        return super().call(ids)


@pytest.mark.parametrize("layer", [GatherInTraining, PenalizedEmbedding])
def test_the_probe_sees_the_training_step_and_its_added_losses(layer):
    """Sparse in training only: slices, as Keras's training step has them; an add_loss that
    reads the table densely: dense. Both against Keras (review findings: the first was
    densified, the second crashed)."""

    def build():
        keras.utils.set_random_seed(3)
        ids = keras.Input((SEQ,), dtype="int32")
        h = layer(VOCAB, 12) if layer is PenalizedEmbedding else layer()
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(8)(h(ids)))
        return keras.Model(ids, keras.layers.Dense(CLASSES)(h))

    want = build()
    want.compile(keras.optimizers.Adam(1e-2), loss())
    pipe = hybrid.Pipeline(build(), mesh=hybrid.DeviceMesh.create(2, 2), balance=[1, 3])
    pipe.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss(), jit_compile=False)
    for step in range(2):
        np.testing.assert_allclose(
            pipe.train_step(*tokens(step))["loss"], want.train_on_batch(*tokens(step)), rtol=1e-5
        )
    assert pipe.stages[0][0].sparse == [layer is GatherInTraining]
    for g, w in zip(pipe.get_weights(), want.get_weights(), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-6)


class Unread(keras.layers.Layer):
    """A layer holding a weight its call never reads."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(3,), initializer="ones")

    def call(self, x):
        return x


def test_a_variable_keras_gets_no_gradient_for_is_left_alone():
    """Keras's optimizer skips a variable whose gradient is None (no weight decay, no
    update); the pipeline's copies are given None for it too (review finding: zeros, so
    AdamW decayed it: 0.01 off after two steps)."""

    def build():
        keras.utils.set_random_seed(3)
        ids = keras.Input((SEQ,), dtype="int32")
        h = Unread()(keras.layers.Embedding(VOCAB, 8)(ids))
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(8)(h))
        return keras.Model(ids, keras.layers.Dense(CLASSES)(h))

    def optimizer():
        return keras.optimizers.AdamW(1e-2, weight_decay=0.5)

    want = build()
    want.compile(optimizer(), loss())
    pipe = hybrid.Pipeline(build(), mesh=hybrid.DeviceMesh.create(2, 2), balance=[2, 3])
    pipe.compile(optimizer=optimizer(), loss=loss(), jit_compile=False)
    for step in range(2):
        want.train_on_batch(*tokens(step))
        pipe.train_step(*tokens(step))
    assert any(pipe.stages[0][0].unused)
    for g, w in zip(pipe.get_weights(), want.get_weights(), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-6)
    np.testing.assert_array_equal(pipe.get_weights()[1], np.ones(3))


class TiedHead(keras.layers.Layer):
    """Logits from an embedding's matrix: a dense use of its variable."""

    def __init__(self, embedding: keras.layers.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))


def test_a_tied_or_regularized_embedding_keeps_the_dense_gradient_keras_forms():
    """Keras adds a dense use's (or a penalty's) gradient to the slices: dense, summed."""
    from hybrid.engine.model import graph, sparse

    keras.utils.set_random_seed(0)
    ids = keras.Input((SEQ,), dtype="int32")
    embedding = keras.layers.Embedding(VOCAB, 4)
    regularized = keras.layers.Embedding(VOCAB, 4, embeddings_regularizer="l2")
    h = keras.layers.Add()([embedding(ids), regularized(ids)])
    model = keras.Model(ids, keras.layers.Dense(CLASSES)(TiedHead(embedding)(h)))
    found, _ = sparse.gradient_kinds(
        graph.graph_of(model), [tf.zeros((1, SEQ), "int32")], model.weights
    )
    assert found == set()
    free = embedding_model()
    found, _ = sparse.gradient_kinds(
        graph.graph_of(free), [tf.zeros((1, SEQ), "int32")], free.weights
    )
    assert found == {id(free.get_layer("tokens").embeddings)}


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
