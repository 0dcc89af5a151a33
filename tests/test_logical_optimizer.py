"""One optimizer, really: every write a user or a callback makes through ``pipe.optimizer``
or the user's own model reaches every device's copy, and training goes on as plain Keras's.

The reference is the same model compiled by plain Keras (``jit_compile=True``: XLA against
XLA) on one device, given the same writes between the same ``fit`` calls. Each test checks
the replicas agree exactly and the weights (and optimizer variables) equal Keras's.
"""

import keras
import numpy as np
import pytest

import hybrid

BATCH = 32


def data(examples=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 8)).astype("float32")
    return x, np.argmax(x[:, :3], 1)


def model(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3),
        ]
    )


def pair(make_optimizer=lambda: keras.optimizers.Adam(1e-2), stages=2, replicas=2, **layout):
    """Plain Keras and a pipeline of an equal model, compiled alike."""
    reference = model()
    template = model(seed=2)
    template.set_weights(reference.get_weights())
    mesh = hybrid.DeviceMesh.create(stages, replicas)
    pipe = hybrid.Pipeline(template, mesh, micro_batches=2, **layout)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference.compile(make_optimizer(), loss, jit_compile=True)
    pipe.compile(make_optimizer(), loss)
    return pipe, reference, template


def fit(m, x, y, **kwargs):
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, **kwargs)


def assert_replicas_agree(pipe):
    for r in range(1, pipe.mesh.num_replicas):
        for a, b in zip(pipe.replica_weights(0), pipe.replica_weights(r), strict=True):
            np.testing.assert_array_equal(a, b)
    for copies in [[c.optimizer for row in pipe.stages for c in row]]:
        rates = {float(c.learning_rate.numpy()) for c in copies}
        steps = {int(c.iterations.numpy()) for c in copies}
        assert len(rates) == 1 and len(steps) == 1, (rates, steps)


def assert_like_keras(pipe, reference):
    assert_replicas_agree(pipe)
    for a, b in zip(pipe.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)

    # Slot names follow each model's own variable paths: compare kinds and shapes.
    def kinds(variables):
        return [(v.name.rsplit("_", 1)[-1], tuple(v.shape)) for v in variables]

    assert kinds(pipe.optimizer.variables) == kinds(reference.optimizer.variables)
    for a, b in zip(pipe.optimizer.variables, reference.optimizer.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=2e-6, err_msg=b.name)


def test_learning_rate_assign_reaches_every_copy():
    """The issue's script: ``optimizer.learning_rate.assign`` between two fits (failed when
    only stage 0 / replica 0 took the new rate: replicas then differed by 0.0199)."""
    x, y = data()
    pipe, reference, _ = pair()
    for m in (pipe, reference):
        fit(m, x, y)
        m.optimizer.learning_rate.assign(1e-4)
        fit(m, x, y)
    assert [float(c.learning_rate.numpy()) for c in pipe.optimizer.copies] == [
        pytest.approx(1e-4)
    ] * 4
    assert_like_keras(pipe, reference)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: keras.optimizers.Adam(1e-2),
        lambda: keras.optimizers.SGD(0.05, momentum=0.9, use_ema=True),
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.AdamW(1e-2)),
    ],
    ids=["adam", "sgd-momentum-ema", "loss-scale-adamw"],
)
def test_variables_set_weights_and_store_act_on_every_copy(make_optimizer):
    """``variables`` in Keras's order and values; ``set_weights``, ``iterations.assign``,
    ``load_own_variables`` and a hyper-parameter written between fits, as on Keras."""
    x, y = data()
    pipe, reference, _ = pair(make_optimizer)
    for m in (pipe, reference):
        fit(m, x, y)
    assert_like_keras(pipe, reference)
    # A state from elsewhere (Keras's own, moved on by one more fit) set into both.
    other = keras.models.clone_model(reference)
    other.set_weights(reference.get_weights())
    other.compile(make_optimizer(), reference.loss, jit_compile=True)
    fit(other, *data(seed=3))
    state = [v.numpy() for v in other.optimizer.variables]
    store = {}
    other.optimizer.save_own_variables(store)
    pipe.optimizer.set_weights(state)
    # Keras's LossScaleOptimizer.set_weights zips its own 4 variables with the list and drops
    # the rest (its inner optimizer's); the pipeline sets every variable of ``variables``.
    for variable, value in zip(reference.optimizer.variables, state, strict=True):
        variable.assign(value)
    fit(pipe, x, y)
    fit(reference, x, y)
    assert_like_keras(pipe, reference)
    for m in (pipe, reference):
        m.optimizer.load_own_variables(store)
        m.optimizer.iterations.assign(1)
    fit(pipe, x, y)
    fit(reference, x, y)
    assert_like_keras(pipe, reference)


def test_sharded_optimizer_states_are_one_optimizer_too():
    """With ZeRO-1 each replica holds a share of the slots: ``variables`` reads each from
    the replica that holds it, and a write reaches that one."""
    x, y = data()
    pipe, reference, _ = pair(stages=1, replicas=2, shard_optimizer_states=True)
    for m in (pipe, reference):
        fit(m, x, y)
        m.optimizer.set_weights([v.numpy() * 0.5 for v in m.optimizer.variables])
        m.optimizer.learning_rate.assign(3e-3)
        fit(m, x, y)
    assert_like_keras(pipe, reference)


def test_optimizer_store_moves_between_keras_and_the_pipeline():
    x, y = data()
    pipe, reference, _ = pair()
    for m in (pipe, reference):
        fit(m, x, y)
    store = {}
    pipe.optimizer.save_own_variables(store)
    assert len(store) == len(reference.optimizer.variables)
    for i, v in enumerate(reference.optimizer.variables):
        np.testing.assert_allclose(store[str(i)], v.numpy(), rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="the store holds 3 optimizer variables"):
        pipe.optimizer.load_own_variables({"0": 1, "1": 2, "2": 3})
    with pytest.raises(ValueError, match="has shape"):
        pipe.optimizer.set_weights([np.zeros(5)] * len(store))


def test_the_users_model_writes_through_to_every_copy():
    """``model.set_weights``, ``layer.kernel.assign`` and ``load_weights`` on the model the
    pipeline was built from, after the build, are what the pipeline trains on."""
    x, y = data()
    pipe, reference, template = pair()
    for m in (pipe, reference):
        fit(m, x, y)
    fresh = model(seed=7).get_weights()
    template.set_weights(fresh)
    reference.set_weights(fresh)
    np.testing.assert_array_equal(pipe.get_weights()[0], fresh[0])
    kernel = np.full((16, 3), 0.01, np.float32)
    template.layers[-1].kernel.assign(kernel)
    reference.layers[-1].kernel.assign(kernel)
    template.layers[0].bias.assign_add(np.ones(16, np.float32))
    reference.layers[0].bias.assign_add(np.ones(16, np.float32))
    fit(pipe, x, y)
    fit(reference, x, y)
    assert_like_keras(pipe, reference)


def test_hyper_parameters_are_set_on_every_copy_or_refused():
    x, y = data()
    pipe, _, _ = pair(lambda: keras.optimizers.Adam(1e-2, global_clipnorm=1.0))
    fit(pipe, x, y)
    optimizer = pipe.optimizer
    optimizer.learning_rate = 0.5
    optimizer.beta_1 = 0.8
    assert {c.beta_1 for c in optimizer.copies} == {0.8}
    assert_replicas_agree(pipe)
    assert float(optimizer.learning_rate.numpy()) == 0.5
    assert optimizer.beta_1 == 0.8
    with pytest.raises(AttributeError, match="cannot set 'global_clipnorm'.*norm over every stage"):
        optimizer.global_clipnorm = 2.0
    with pytest.raises(AttributeError, match="cannot set 'use_ema'"):
        optimizer.use_ema = True
    with pytest.raises(AttributeError, match=r"apply_gradients\(\) would act on one device"):
        optimizer.apply_gradients([])
    with pytest.raises(AttributeError, match="one device's private state"):
        _ = optimizer._momentums
    assert not hasattr(optimizer, "inner_optimizer")  # as Keras's Adam: callbacks check it


def test_inner_optimizer_of_a_loss_scale_optimizer_writes_every_copy():
    x, y = data()
    make = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))  # noqa: E731
    pipe, reference, _ = pair(make)
    for m in (pipe, reference):
        fit(m, x, y)
        m.optimizer.inner_optimizer.learning_rate.assign(0.01)
        m.optimizer.inner_optimizer.learning_rate = 0.02
        fit(m, x, y)
    rates = [float(c.inner_optimizer.learning_rate.numpy()) for c in pipe.optimizer.copies]
    assert rates == [pytest.approx(0.02)] * 4
    assert_like_keras(pipe, reference)


def test_an_exhausted_generator_counts_the_steps_taken_and_warns():
    """Keras's fit without XLA adds one to ``iterations`` when a generator of unknown length
    runs out; with XLA (what the pipeline's programs are) it does not. The pipeline counts
    the steps taken, like Keras with ``jit_compile=True``, and says so once."""
    x, y = data(examples=128)

    def batches():
        for i in range(4):
            yield x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]

    pipe, reference, _ = pair()
    reference.fit(batches(), epochs=1, verbose=0)
    with pytest.warns(UserWarning, match="optimizer.iterations is 4, the steps taken") as seen:
        pipe.fit(batches(), epochs=1, verbose=0)
    assert sum("the data ran out" in str(w.message) for w in seen) == 1
    assert int(pipe.optimizer.iterations.numpy()) == int(reference.optimizer.iterations) == 4
    for m in (pipe, reference):
        fit(m, x, y)
    assert_like_keras(pipe, reference)
