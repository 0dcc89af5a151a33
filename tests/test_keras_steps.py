"""Keras's one-batch steps (``train_on_batch``, ``test_on_batch``, ``predict_on_batch``) and
its fault tolerance for ``fit`` (``BackupAndRestore``, ``ModelCheckpoint``), against plain
Keras on one device doing the same (``jit_compile=True``: XLA against XLA)."""

import keras
import numpy as np
import pytest

import hybrid

BATCH, EXAMPLES = 16, 64


def data(examples=EXAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 6)).astype("float32")
    return x, np.argmax(x[:, :3], 1)


def model(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(12, activation="relu"),
            keras.layers.Dense(12, activation="relu"),
            keras.layers.Dense(3),
        ]
    )


def compiled(m, metrics=("accuracy",)):
    kwargs = dict(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
    )
    if isinstance(m, keras.Model):
        kwargs["jit_compile"] = True
    m.compile(**kwargs)
    return m


def pair(stages=2, replicas=2, micro_batches=2):
    reference = compiled(model())
    template = model(seed=2)
    template.set_weights(reference.get_weights())
    mesh = hybrid.DeviceMesh.create(stages, replicas)
    pipe = compiled(hybrid.Pipeline(template, mesh, micro_batches=micro_batches))
    return pipe, reference


def assert_same(pipe, reference, atol=2e-6):
    for a, b in zip(pipe.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)
    for a, b in zip(pipe.optimizer.variables, reference.optimizer.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=atol)


def test_one_batch_steps_return_what_keras_returns():
    """Each call's value (a list in Keras's order, or a dict), sample and class weights, a
    batch R·M does not divide (30 examples), and the weights after the steps."""
    x, y = data()
    pipe, reference = pair()
    weights = np.linspace(0.0, 2.0, 30).astype("float32")
    calls = [
        dict(x=x[:BATCH], y=y[:BATCH]),
        dict(x=x[:30], y=y[:30], sample_weight=weights),
        dict(x=x[30:60], y=y[30:60], class_weight={0: 0.5, 1: 2.0, 2: 1.0}, return_dict=True),
    ]
    for call in calls:
        got, want = pipe.train_on_batch(**call), reference.train_on_batch(**call)
        if isinstance(want, dict):
            assert list(got) == list(want)
            got, want = list(got.values()), list(want.values())
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert_same(pipe, reference)
    for call in [dict(x=x[:30], y=y[:30]), dict(x=x, y=y, return_dict=True)]:
        got, want = pipe.test_on_batch(**call), reference.test_on_batch(**call)
        if isinstance(want, dict):
            assert list(got) == list(want)
            got, want = list(got.values()), list(want.values())
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    got, want = pipe.predict_on_batch(x[:30]), reference.predict_on_batch(x[:30])
    assert got.shape == want.shape == (30, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot be specified at the same time"):
        pipe.train_on_batch(x[:BATCH], y[:BATCH], sample_weight=weights[:BATCH], class_weight={})


def test_a_loss_alone_is_a_scalar():
    x, y = data()
    pipe = compiled(hybrid.Pipeline(model(), hybrid.DeviceMesh.create(2, 1)), metrics=())
    reference = compiled(model(), metrics=())
    loss, want = (
        pipe.train_on_batch(x[:BATCH], y[:BATCH]),
        reference.train_on_batch(x[:BATCH], y[:BATCH]),
    )
    assert isinstance(loss, float) and loss == pytest.approx(want, rel=1e-5)


class Interrupt(keras.callbacks.Callback):
    """Raises after ``batch`` of ``epoch``: a job that dies mid-epoch."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("save_freq", ["epoch", 3])
def test_backup_and_restore_resumes_as_keras_does(tmp_path, save_freq):
    """A fit that dies in epoch 1 and is run again resumes from the backup (weights and
    optimizer state), as Keras's does; with save_freq="epoch" that is an uninterrupted run."""
    x, y = data()
    runs = {}
    for name, m in zip(["pipe", "keras"], pair(), strict=True):
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / name), save_freq=save_freq)
        fit = dict(batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
        with pytest.raises(RuntimeError, match="interrupted"):
            m.fit(x, y, callbacks=[backup, Interrupt(epoch=1, batch=1)], **fit)
        history = m.fit(x, y, callbacks=[backup], **fit)
        runs[name] = (m, history.epoch)
    pipe, reference = runs["pipe"][0], runs["keras"][0]
    assert runs["pipe"][1] == runs["keras"][1]
    assert_same(pipe, reference)
    if save_freq == "epoch":
        straight, _ = pair()
        straight.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
        for a, b in zip(pipe.get_weights(), straight.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)


def test_weights_checkpoints_hold_the_optimizer_as_keras_writes_it(tmp_path):
    """``ModelCheckpoint(save_weights_only=True)`` writes what Keras writes for a compiled
    model: a compiled Keras model loading the file gets the pipeline's weights and optimizer
    state, and a pipeline loading Keras's file gets Keras's."""
    x, y = data()
    pipe, reference = pair()
    path = str(tmp_path / "pipe.weights.h5")
    saver = keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
    pipe.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[saver])
    reference.fit(x[:BATCH], y[:BATCH], verbose=0)  # its optimizer state exists, other values
    reference.load_weights(path)
    assert_same(pipe, reference)
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "keras.weights.h5")
    reference.save_weights(path)
    pipe.load_weights(path)
    assert_same(pipe, reference)
    assert int(pipe.step_counter.numpy()) == int(reference.optimizer.iterations.numpy())
