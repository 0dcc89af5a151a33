"""The Keras internals the engine relies on (``hybrid/engine/keras_private.py``) behave as the
engine assumes, and the loss split of ``hybrid/engine/losses.py`` equals Keras's own loss."""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from hybrid.engine import keras_private
from hybrid.engine.model import losses

import reference as ref
import runner


def batch(seed=0, n=6, classes=4):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, classes)).astype("float32")
    labels = rng.integers(0, classes, size=(n,)).astype("int32")
    weights = rng.uniform(0, 2, size=(n,)).astype("float32")
    weights[0] = 0.0
    return labels, logits, weights


@pytest.mark.parametrize(
    "reduction", ["sum", "sum_over_batch_size", "mean", "mean_with_sample_weight"]
)
@pytest.mark.parametrize("weighted", [False, True])
def test_loss_terms_over_parts_equal_keras_on_the_whole(reduction, weighted):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    y, p, w = batch()
    w = w if weighted else None
    want = float(loss(y, p, sample_weight=w))
    parts = [
        losses.loss_terms(loss, y[i : i + 2], p[i : i + 2], None if w is None else w[i : i + 2])
        for i in range(0, 6, 2)
    ]
    numerator = sum(float(n) for n, _ in parts)
    denominator = float(losses.divisor(loss, tf.constant(sum(float(d) for _, d in parts))))
    np.testing.assert_allclose(numerator / denominator, want, rtol=1e-6)


def test_plain_functions_and_names_reduce_like_compile():
    y, p, _ = batch()
    want = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, p))
    fn = losses.as_keras_loss(
        lambda t, q: keras.losses.sparse_categorical_crossentropy(t, q, from_logits=True)
    )
    numerator, denominator = losses.loss_terms(fn, y, p)
    np.testing.assert_allclose(float(numerator) / float(denominator), want, rtol=1e-6)
    assert losses.as_keras_loss("mse").reduction == "sum_over_batch_size"
    with pytest.raises(TypeError, match="loss must be a keras.losses.Loss"):
        losses.as_keras_loss(3)


def test_same_rank_lines_up_values_and_weights_as_keras_does():
    values, weights = keras_private.same_rank(tf.ones((4, 1)), tf.ones((4,)))
    assert values.shape == (4, 1) and weights.shape == (4, 1)
    values, weights = keras_private.same_rank(tf.ones((4, 3)), tf.ones((4, 3, 1)))
    assert values.shape == (4, 3) and weights.shape == (4, 3)


def test_output_mask_is_the_mask_a_layer_attaches():
    x = tf.constant([[[0.0], [1.0]]])
    assert keras_private.output_mask(keras.layers.Masking()(x)) is not None
    assert keras_private.output_mask(keras.layers.Dense(2)(x)) is None


def test_a_batch_norm_training_call_normalizes_with_the_moments_it_is_given():
    """Inside ``batch_norm_moments_from`` a training call normalizes with (and updates its
    moving statistics from) the given moments; outside, with its own again."""
    norm = keras.layers.BatchNormalization(synchronized=True, momentum=0.5, epsilon=0.0)
    x = tf.constant([[1.0, 2.0], [3.0, 6.0]])
    norm.build(x.shape)
    given = (tf.constant([0.0, 2.0]), tf.constant([4.0, 16.0]))
    seen = []

    def moments(inputs, axes):
        seen.append((inputs.dtype, list(axes)))
        return given

    with keras_private.batch_norm_moments_from([norm], moments):
        y = norm(x, training=True)
    np.testing.assert_allclose(y, (x - given[0]) / tf.sqrt(given[1]), rtol=1e-6)
    np.testing.assert_allclose(norm.moving_mean, 0.5 * given[0], rtol=1e-6)
    np.testing.assert_allclose(norm.moving_variance, 0.5 + 0.5 * given[1], rtol=1e-6)
    assert seen == [(tf.float32, [0])]
    own = norm(x, training=True)  # its own moments (no replica context: this batch's)
    np.testing.assert_allclose(own, [[-1.0, -1.0], [1.0, 1.0]], rtol=1e-5)
    assert "_moments" not in vars(norm)


def test_weight_decay_exclusions_carry_over_to_copies_of_the_variables():
    def dense_pair():
        layers = [keras.layers.Dense(3, name="a"), keras.layers.LayerNormalization(name="n")]
        keras.Sequential([keras.Input((2,)), *layers])
        return [v for layer in layers for v in layer.trainable_variables]

    original, copies = dense_pair(), dense_pair()
    source = keras.optimizers.AdamW(weight_decay=0.1)
    source.exclude_from_weight_decay(var_list=[original[0]], var_names=["gamma"])
    copy = keras.optimizers.AdamW.from_config(source.get_config())
    assert all(copy._use_weight_decay(v) for v in copies)  # get_config drops the exclusions
    keras_private.copy_weight_decay_exclusions(source, copy, original, copies)
    used = [copy._use_weight_decay(v) for v in copies]
    assert used == [source._use_weight_decay(v) for v in original]
    assert used == [False, True, False, True]  # kernel and gamma excluded; biases, beta not


def test_the_launchers_optimizer_names_are_kerass():
    """--optimizer is checked against a list (no Keras import while flags are parsed): it
    must be every optimizer class of keras.optimizers, each made from its name."""
    from hybrid.launch.model_flags import KERAS_OPTIMIZERS
    from hybrid.run.user_model import optimizer_class

    classes = {
        name.lower()
        for name, cls in vars(keras.optimizers).items()
        if isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)
    }
    assert set(KERAS_OPTIMIZERS) == classes - {"optimizer", "lossscaleoptimizer", "multioptimizer"}
    for name in KERAS_OPTIMIZERS:
        assert issubclass(optimizer_class(name), keras.optimizers.Optimizer), name


def test_the_launchers_mixed_float16_scales_the_loss_as_compile_does():
    from hybrid.run.train_config import TrainConfig
    from hybrid.run.user_model import optimizer_for

    scaled = optimizer_for(TrainConfig.of(optimizer="adamw", precision="mixed_float16"))
    assert isinstance(scaled, keras.optimizers.LossScaleOptimizer)
    assert isinstance(scaled.inner_optimizer, keras.optimizers.AdamW)
    assert not isinstance(optimizer_for(TrainConfig()), keras.optimizers.LossScaleOptimizer)


@pytest.mark.parametrize("local", [False, True])
def test_an_optimizer_in_a_replica_context_sums_gradients_unless_kept_local(local):
    """Keras's TensorFlow optimizer, applied inside ``strategy.run``, sums the replicas'
    gradients itself; ``keep_gradients_local`` makes it apply them as given (the engine
    hands it gradients it has already reduced)."""
    strategy = ref.mirrored_strategy()
    with strategy.scope():
        variable = keras.Variable(np.zeros(3, "float32"))
        optimizer = keras.optimizers.SGD(1.0)
        optimizer.build([variable])
    if local:
        keras_private.keep_gradients_local(optimizer)

    @tf.function(autograph=False)
    def step():
        strategy.run(lambda: optimizer.apply([tf.ones(3)], [variable]))

    step()
    replicas = strategy.num_replicas_in_sync
    np.testing.assert_array_equal(variable.numpy(), -np.ones(3) * (1 if local else replicas))


def test_a_program_given_an_optimizers_tf_variables_updates_whichever_it_is_given():
    """``tf_variable`` is the ``tf.Variable`` Keras's TensorFlow optimizer writes (dense
    assigns and sparse scatters): one traced ``apply`` of optimizer ``a`` over its own
    variables, given ``b``'s variables and optimizer state as arguments, updates ``b``
    exactly as ``b.apply`` does and leaves ``a`` alone (a trace made on other variables
    than those the function reads would capture them instead) (``hybrid/engine/step/update.py``)."""

    def copy():
        weights = [
            keras.Variable(np.ones((4, 2), "float32")),
            keras.Variable(np.ones(2, "float32")),
        ]
        optimizer = keras.optimizers.Adam(0.1, use_ema=True)
        optimizer.build(weights)
        return weights, optimizer

    (wa, a), (wb, b), (wc, c) = copy(), copy(), copy()
    sparse = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([2]), tf.constant([4, 2]))
    grads = [sparse, tf.constant([0.5, -1.0])]

    def state(weights, optimizer):
        return [keras_private.tf_variable(v) for v in [*weights, *optimizer.variables]]

    program = tf.function(lambda g, s: a.apply(g, wa), autograph=False)
    traced = program.get_concrete_function(grads, state(wa, a))  # traced on a's own
    assert not traced.variables  # a's variables are its inputs, none captured
    for _ in range(2):
        program(grads, state(wb, b))
        c.apply(grads, wc)
    assert program.experimental_get_tracing_count() == 1
    for mine, want in zip(state(wb, b), state(wc, c), strict=True):
        np.testing.assert_array_equal(mine.numpy(), want.numpy())
    assert int(a.iterations.numpy()) == 0 and int(b.iterations.numpy()) == 2
    np.testing.assert_array_equal(wa[0].numpy(), np.ones((4, 2)))
    with pytest.raises(TypeError, match="not a tf.Variable"):
        keras_private.tf_variable(keras.Variable(1.0).value.read_value())


def test_mirror_writes_sees_every_eager_write_and_none_traced_or_stateless():
    """``mirror_writes``: Keras's ``assign``, ``assign_add``, ``assign_sub``, the optimizer's
    ``learning_rate`` setter and ``Layer.set_weights`` end in ``_direct_assign``; a write in
    a ``StatelessScope`` (how the stage programs run the user's layers) or traced into a
    function is not mirrored."""
    seen = []
    variable = keras.Variable(np.zeros(2, "float32"))
    keras_private.mirror_writes(variable, lambda value: seen.append(np.array(value)))
    variable.assign([1.0, 2.0])
    variable.assign_add([1.0, 1.0])
    variable.assign_sub([0.5, 0.5])
    assert [v.tolist() for v in seen] == [[1.0, 2.0], [2.0, 3.0], [1.5, 2.5]]
    with keras.StatelessScope(state_mapping=[(variable, tf.zeros(2))]):
        variable.assign([9.0, 9.0])
    tf.function(lambda: variable.assign([7.0, 7.0]), autograph=False)()
    assert len(seen) == 3 and variable.numpy().tolist() == [7.0, 7.0]
    again = []
    for _ in range(1500):  # one wrapper however often it is mirrored (no call-depth growth)
        keras_private.mirror_writes(variable, lambda value: None)
    keras_private.mirror_writes(variable, lambda value: again.append(np.array(value)))
    variable.assign([3.0, 3.0])
    assert len(seen) == 4 and again[0].tolist() == [3.0, 3.0]

    optimizer = keras.optimizers.SGD(0.1)
    rates = []
    keras_private.mirror_writes(optimizer._learning_rate, lambda v: rates.append(float(v)))
    optimizer.learning_rate = 0.5
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    kernels = []
    keras_private.mirror_writes(layer.kernel, lambda v: kernels.append(np.array(v)))
    layer.set_weights([np.ones((3, 2)), np.zeros(2)])
    assert rates == [0.5] and kernels[0].tolist() == np.ones((3, 2)).tolist()


def test_the_epoch_iterator_counts_the_epochs_whose_data_ran_out():
    """``ran_out`` counts a generator running out before a batch it was asked for (where
    Keras's TensorFlow trainer calls its train function once more), not an epoch that ends
    at its step count."""
    x = np.zeros((8, 2), "float32")

    def four():
        for i in range(4):
            yield (x[2 * i : 2 * i + 2],)

    iterator = keras_private.epoch_iterator(x=four())
    with iterator.catch_stop_iteration():
        assert len(list(iterator)) == 4
    assert iterator.ran_out == 1
    known = keras_private.epoch_iterator(x=x, batch_size=2)
    for _ in range(2):
        with known.catch_stop_iteration():
            assert len(list(known)) == 4
    assert known.ran_out == 0


if __name__ == "__main__":
    sys.exit(runner.main(__file__))


@pytest.mark.parametrize(
    "make",
    [
        lambda x: (x, x[:, :1]),
        lambda x: ({"b": x, "a": (x[:, :2], (x[:, :1],))}, x[:, 3]),
        lambda x: x,
    ],
    ids=["tuple", "dicts-in-order-and-nested", "one-tensor"],
)
def test_dataset_elements_are_the_iterators_read_by_its_op(make):
    """The same elements, in the same structure (a dict in its own key order, its values
    from tf.nest's sorted order), ending where the data ends: a partial last batch too."""
    x = np.arange(7 * 4, dtype="float32").reshape(7, 4)
    dataset = tf.data.Dataset.from_tensor_slices(make(x)).batch(3)
    got, want = list(keras_private.dataset_elements(dataset)), list(dataset)
    assert len(got) == len(want) == 3
    for a, b in zip(got, want, strict=True):
        assert tf.nest.map_structure(lambda t: t.shape, a) == (
            tf.nest.map_structure(lambda t: t.shape, b)
        )
        if isinstance(a, dict):
            assert list(a) == list(b) == ["b", "a"]
        for u, v in zip(tf.nest.flatten(a), tf.nest.flatten(b), strict=True):
            np.testing.assert_array_equal(u.numpy(), v.numpy())


def test_dataset_elements_of_ragged_tensors_come_from_the_iterator():
    ragged = tf.ragged.constant([[1, 2], [3], [4, 5, 6]])
    dataset = tf.data.Dataset.from_tensor_slices(ragged).batch(2)
    got = list(keras_private.dataset_elements(dataset))
    assert [t.to_list() for t in got] == [[[1, 2], [3]], [[4, 5, 6]]]
