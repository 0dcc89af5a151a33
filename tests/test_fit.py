"""The Keras workflow: ``fit``, ``evaluate`` and ``predict`` give what plain Keras gives.

The reference is ``model.compile(optimizer, loss, metrics)`` + ``model.fit(...,
shuffle=False)`` on one device with the same initial weights. The data has a partial last
batch (50 examples in batches of 16: the last has 2, which no mesh here splits into R·M
equal parts), so padding is exercised in every epoch, in training and in validation. The
History (loss, accuracy, AUC, val_*), the final weights and Adam's moments must agree to
float32 round-off.
"""

import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import hybrid
from hybrid.engine.api import feed

import reference as ref
import runner

EXAMPLES, BATCH = 50, 16


def model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((ref.IN_FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def data(examples=EXAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, ref.IN_FEATURES)).astype("float32")
    y = (x[:, :2].sum(axis=1) + 0.5 * rng.normal(size=examples) > 0).astype("float32")
    return x, y[:, None]


def compiled(optimizer, seed=0):
    return dict(
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        optimizer=optimizer,
        metrics=["accuracy", keras.metrics.AUC(from_logits=True, name="auc")],
    )


def pair(stages, replicas, micro_batches, schedule="gpipe", optimizer=None, prefetch=2):
    """A compiled Keras model and a pipeline of a copy of it, with equal weights."""
    optimizer = optimizer or (lambda: keras.optimizers.Adam(0.01, epsilon=1e-3))
    keras_model = model()
    keras_model.compile(**compiled(optimizer()))
    template = model(seed=1)
    template.set_weights(keras_model.get_weights())
    pipe = hybrid.Pipeline(
        template,
        mesh=hybrid.DeviceMesh.create(stages, replicas),
        micro_batches=micro_batches,
        schedule=schedule,
        prefetch=prefetch,
    )
    pipe.compile(jit_compile=False, **compiled(optimizer()))
    return keras_model, pipe


def assert_history_equal(got, want, rtol=1e-5):
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=1e-6, err_msg=key)


def adam_moments(optimizers):
    return [v.numpy() for o in optimizers for v in o.variables if len(v.shape) > 0]


@pytest.mark.parametrize(
    "stages,replicas,micro_batches,schedule,source,prefetch",
    [
        (2, 1, 2, "gpipe", "arrays", 0),
        (1, 2, 1, "1f1b", "dataset", 2),
        (2, 2, 2, "1f1b", "weighted", 1),
    ],
)
def test_fit_matches_keras(stages, replicas, micro_batches, schedule, source, prefetch):
    """Prefetch 0 prepares each batch at its step; 1 and 2 prepare them on a feeding thread
    and copy them onto the devices ahead of the step: the same training either way."""
    keras_model, pipe = pair(stages, replicas, micro_batches, schedule, prefetch=prefetch)
    x, y = data()
    validation = data(20, seed=1)  # batches of 16 and 4
    if source == "dataset":
        train = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
    else:
        train = dict(x=x, y=y, batch_size=BATCH)
    if source == "weighted":
        train["sample_weight"] = np.random.default_rng(3).uniform(0, 2, EXAMPLES)
    kwargs = dict(epochs=2, validation_data=validation, shuffle=False, verbose=0)
    want = keras_model.fit(**train, **kwargs).history
    got = pipe.fit(**train, **kwargs).history
    assert_history_equal(got, want)
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())
    stage_optimizers = [row[0].optimizer for row in pipe.stages]
    ref.assert_weights_close(adam_moments(stage_optimizers), adam_moments([keras_model.optimizer]))
    assert int(pipe.optimizer.iterations.numpy()) == 2 * 4  # 4 batches per epoch
    x_test, y_test = data(37, seed=2)  # two full batches of 16 (Keras's default 32) and 5
    np.testing.assert_allclose(
        pipe.evaluate(x_test, y_test, verbose=0),
        keras_model.evaluate(x_test, y_test, verbose=0),
        rtol=1e-5,
    )
    predicted = pipe.predict(x_test, verbose=0)
    assert predicted.shape == (37, 1)
    np.testing.assert_allclose(predicted, keras_model.predict(x_test, verbose=0), atol=1e-5)


class Counter(keras.callbacks.Callback):
    """Counts the hooks it receives and keeps the logs' keys."""

    def __init__(self):
        super().__init__()
        self.calls = {}
        self.keys = set()

    def _count(self, hook, logs):
        self.calls[hook] = self.calls.get(hook, 0) + 1
        self.keys.update(logs or {})

    def on_epoch_begin(self, epoch, logs=None):
        self._count("epoch_begin", logs)

    def on_train_batch_end(self, batch, logs=None):
        self._count("train_batch_end", logs)

    def on_test_batch_end(self, batch, logs=None):
        self._count("test_batch_end", logs)

    def on_epoch_end(self, epoch, logs=None):
        self._count("epoch_end", logs)
        # what a callback may use of its model
        self.calls.setdefault("learning_rates", []).append(
            float(self.model.optimizer.learning_rate.numpy())
        )


def test_callbacks_see_what_they_see_in_keras(tmp_path):
    """EarlyStopping stops at Keras's epoch, LearningRateScheduler sets every copy's rate,
    ModelCheckpoint writes a .keras file Keras loads, a custom callback gets the same hooks
    and logs; SGD with EMA ends with the averaged weights, as Keras's fit does."""

    def optimizer():
        return keras.optimizers.SGD(0.5, momentum=0.9, use_ema=True)

    keras_model, pipe = pair(2, 2, 2, "gpipe", optimizer=optimizer)
    x, y = data()

    def callbacks(name):
        return [
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=1),
            keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.5 / (epoch + 1)),
            keras.callbacks.ModelCheckpoint(str(tmp_path / f"{name}.keras")),
            Counter(),
        ]

    kwargs = dict(batch_size=BATCH, epochs=12, validation_split=0.2, shuffle=False, verbose=0)
    want_callbacks, got_callbacks = callbacks("keras"), callbacks("pipe")
    want = keras_model.fit(x, y, callbacks=want_callbacks, **kwargs)
    got = pipe.fit(x, y, callbacks=got_callbacks, **kwargs)
    assert len(want.epoch) < 12, "the reference did not stop early: the test proves nothing"
    assert got.epoch == want.epoch
    assert_history_equal(got.history, want.history)
    assert got_callbacks[-1].calls == want_callbacks[-1].calls
    assert got_callbacks[-1].keys == want_callbacks[-1].keys
    rates = {
        float(o.learning_rate.numpy()) for row in pipe.stages for o in (c.optimizer for c in row)
    }
    assert rates == {float(np.float32(0.5 / len(want.epoch)))}  # set on every copy
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())
    # the checkpoint of the last epoch (written before fit swaps in the EMA weights)
    saved = keras.saving.load_model(str(tmp_path / "pipe.keras"))
    written = keras.saving.load_model(str(tmp_path / "keras.keras"))
    ref.assert_weights_close(saved.get_weights(), written.get_weights())


def test_progress_bar_shows_loss_and_metrics(capsys):
    _, pipe = pair(2, 1, 2)
    x, y = data()
    pipe.fit(x, y, batch_size=BATCH, epochs=1, verbose=1)
    out = capsys.readouterr().out
    assert "4/4" in out and "loss:" in out and "accuracy:" in out and "auc:" in out


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"])
def test_a_batch_of_any_size_trains_as_keras_trains_it(reduction):
    """13 examples on a 2×2 mesh with M=2 (R·M = 4): padded to 16 with examples that count
    for nothing; loss, metrics and weights are Keras's on the 13."""
    loss = keras.losses.BinaryCrossentropy(from_logits=True, reduction=reduction)
    keras_model = model()
    keras_model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=["accuracy"])
    template = model(seed=1)
    template.set_weights(keras_model.get_weights())
    pipe = hybrid.Pipeline(template, hybrid.DeviceMesh.create(2, 2), micro_batches=2)
    pipe.compile(
        optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=["accuracy"], jit_compile=False
    )
    x, y = data(13)
    w = np.random.default_rng(5).uniform(0, 2, 13).astype("float32")
    want = keras_model.train_on_batch(x, y, sample_weight=w, return_dict=True)
    got = pipe.train_step(x, y, sample_weight=w)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())


def two_outputs(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((ref.IN_FEATURES,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    deeper = keras.layers.Add()([hidden, keras.layers.Dense(16, activation="tanh")(hidden)])
    logits = keras.layers.Dense(ref.CLASSES, name="logits")(deeper)
    return keras.Model(inputs, [logits, keras.layers.Dense(1, name="value")(deeper)])


def test_fit_of_a_model_with_two_outputs_logs_what_keras_logs():
    """Each output's own loss (``logits_loss``, ``value_loss``), its metrics by output name,
    the total weighted by ``loss_weights``: History equal to Keras's."""
    options = dict(
        loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
        loss_weights=[1.0, 0.5],
        metrics=[["accuracy"], []],
    )
    keras_model = two_outputs()
    keras_model.compile(optimizer=keras.optimizers.SGD(0.1), **options)
    template = two_outputs(seed=1)
    template.set_weights(keras_model.get_weights())
    pipe = hybrid.Pipeline(template, hybrid.DeviceMesh.create(2, 1), micro_batches=2)
    pipe.compile(optimizer=keras.optimizers.SGD(0.1), jit_compile=False, **options)
    x, _ = data()
    y = [np.random.default_rng(1).integers(0, ref.CLASSES, EXAMPLES), x[:, :1]]
    kwargs = dict(batch_size=BATCH, epochs=2, validation_data=(x[:20], [y[0][:20], y[1][:20]]))
    want = keras_model.fit(x, y, shuffle=False, verbose=0, **kwargs).history
    got = pipe.fit(x, y, shuffle=False, verbose=0, **kwargs).history
    assert "logits_loss" in want and "val_value_loss" in want
    assert_history_equal(got, want)
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())


def test_padding_warns_when_a_layer_sees_the_whole_batch():
    layers = [
        keras.layers.Dense(8),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.Dense(1),
    ]
    pipe = hybrid.Pipeline(layers, hybrid.DeviceMesh.create(1, 2))
    pipe.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        jit_compile=False,
    )
    x, y = data(16)
    pipe.train_step(x, y)  # splits evenly: no padding
    with pytest.warns(UserWarning, match=r"padded with copies of its first example.*\['bn'\]"):
        pipe.train_step(*data(13))
    with warnings.catch_warnings():  # inference normalizes with the moving statistics
        warnings.simplefilter("error")
        pipe.predict(data(13)[0], verbose=0)
        pipe.evaluate(*data(13), verbose=0)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))


def test_steps_per_epoch_on_an_infinite_dataset_with_prefetch():
    """An infinite dataset read ``steps_per_epoch`` batches per epoch: the prefetching thread
    carries on across epochs from where the last one stopped, as Keras's iterator does (2
    epochs of 3 steps: batches 0..5 of the repeated data, the same weights as Keras)."""
    keras_model, pipe = pair(2, 2, 2, "gpipe", prefetch=2)
    x, y = data(48)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
    kwargs = dict(epochs=2, steps_per_epoch=3, verbose=0)
    want = keras_model.fit(train, **kwargs).history
    got = pipe.fit(train, **kwargs).history
    assert_history_equal(got, want)
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())


def test_prefetched_shards_are_on_their_replicas_devices(monkeypatch):
    """Inputs go to each replica's first-stage device, labels, sample weights and valid flags
    to its last-stage device (2×2 mesh: replica r's stages are on devices (0, r), (1, r)),
    where a device does not share the host's memory (here: as if none did)."""
    _, pipe = pair(2, 2, 2)
    x, y = data(30)  # padded to 32
    prepared = pipe._batch(x, y, np.ones(30))
    kept = feed.on_devices(prepared, *pipe._shard_devices())  # simulated: no copies
    assert all(
        a is b for k, p in zip(kept, prepared, strict=True) for a, b in zip(k, p, strict=True)
    )
    monkeypatch.setattr(feed, "shares_host_memory", lambda device: False)
    parts = feed.on_devices(prepared, *pipe._shard_devices())
    for r, part in enumerate(parts):
        first, last = pipe.stages[0][r].device, pipe.stages[-1][r].device
        assert first != last
        assert [t.device.endswith(first) for t in part.xs] == [True]
        assert [t.device.endswith(last) for t in part.ys + part.ws + [part.valid]] == [True] * 3
        assert part.xs[0].shape[0] == 16
    np.testing.assert_array_equal(parts[1].valid.numpy(), [1.0] * 14 + [0.0] * 2)


@pytest.mark.parametrize("executions", [1, 2])
def test_batch_logs_are_kerass_and_come_back_with_the_steps(executions):
    """Every batch end's logs (loss, accuracy; validation's too) equal Keras's, read from what
    the traced step returned: the metrics' own read function is never called."""
    keras_model, pipe = pair(1, 1, 1)
    keras_model.compile(**compiled(keras.optimizers.SGD(0.1)), steps_per_execution=executions)
    pipe.compile(jit_compile=False, **compiled(keras.optimizers.SGD(0.1)))
    pipe.steps_per_execution = executions
    reads = []
    read = pipe._metrics._results
    pipe._metrics._results = lambda *a: reads.append(a) or read(*a)
    x, y = data(48)
    logs = {"keras": [], "pipe": []}
    for who, m in (("keras", keras_model), ("pipe", pipe)):
        seen = logs[who]
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda b, logs, seen=seen: seen.append(
                {k: float(v) for k, v in logs.items()}
            ),
            on_test_batch_end=lambda b, logs, seen=seen: seen.append(
                {k: float(v) for k, v in logs.items()}
            ),
        )
        m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              validation_data=(x[:16], y[:16]), callbacks=[record])  # fmt: skip
    assert len(logs["pipe"]) == len(logs["keras"]) > 4
    for got, want in zip(logs["pipe"], logs["keras"], strict=True):
        assert got.keys() == want.keys()
        np.testing.assert_allclose(list(got.values()), list(want.values()), rtol=1e-5, atol=1e-6)
    assert reads == []


def test_which_devices_share_the_hosts_memory():
    shared = ["/job:localhost/replica:0/task:0/device:CPU:3", "/device:CPU:0", "CPU:1"]
    apart = ["/job:worker/replica:0/task:1/device:CPU:0", "/device:GPU:0", "/device:TPU:2"]
    assert [feed.shares_host_memory(d) for d in shared + apart] == [True] * 3 + [False] * 3


def test_prefetch_must_be_a_count():
    with pytest.raises(ValueError, match=r"prefetch=-1: give the number of batches"):
        pair(1, 1, 1, prefetch=-1)


def test_prefetcher_keeps_order_raises_in_order_and_stops_when_closed():
    """Items come in order; the source's error is raised after the items before it; a
    closed prefetcher's thread stops reading (driven by events, not by time)."""
    import threading

    def failing():
        yield from range(3)
        raise KeyError("bad record")

    prefetched = feed.Prefetcher(failing(), depth=2)
    assert [next(prefetched) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError, match="bad record"):
        next(prefetched)
    with pytest.raises(StopIteration):
        next(prefetched)

    read = []
    room = threading.Event()

    def endless():
        while True:
            read.append(len(read))
            if len(read) == 4:
                room.set()  # the consumer's 1 + a full queue of 2 + the one waiting to go in
            yield read[-1]

    prefetched = feed.Prefetcher(endless(), depth=2)
    assert next(prefetched) == 0
    assert room.wait(timeout=60)
    prefetched.close()
    prefetched._thread.join(timeout=60)
    assert not prefetched._thread.is_alive()
    assert len(read) <= 5  # at most one read after the close
    with pytest.raises(StopIteration):
        next(prefetched)
