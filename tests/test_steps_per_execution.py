"""``compile(steps_per_execution=N)``: N steps per call, with Keras's meaning.

The reference is plain Keras on one device compiled with the same ``steps_per_execution``:
``fit``'s History, every batch-end callback (Keras calls them once per execution, with the
index of the execution's last step), ``evaluate``, ``predict`` and its callbacks' outputs,
the weights and Adam's moments. The data (100 examples in batches of 16: 7 batches, the
last of 4 padded to the mesh's R·M) ends inside an execution, and the padded batch cannot
run in one function with the full ones: an execution of 4 is then 3 steps in one call and
a single step.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import hybrid
from hybrid.run.train_config import TrainConfig
from hybrid.run.trainer import train

EXAMPLES, BATCH, FEATURES, CLASSES = 100, 16, 8, 3


def model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    h = keras.layers.Dense(16, activation="tanh")(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


def data(examples=EXAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, FEATURES)).astype("float32")
    return x, np.argmax(x[:, :CLASSES], axis=1)


class Seen(keras.callbacks.Callback):
    """Every batch-end hook's batch index and loss (or outputs' shape)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(("train", batch, round(logs["loss"], 5)))

    def on_test_batch_end(self, batch, logs=None):
        self.seen.append(("test", batch, round(logs["loss"], 5)))

    def on_predict_batch_end(self, batch, logs=None):
        self.seen.append(("predict", batch, logs["outputs"].shape))


def compile_args(steps, jit_compile=False):
    """XLA (for the pipeline's stage programs and Keras's step alike) where a test says so:
    compiling is most of these tests' time."""
    return dict(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps,
        jit_compile=jit_compile,
    )


def workflow(m, steps, jit_compile=False, **fit_args):
    """fit (with validation), evaluate and predict, as a user would call them."""
    m.compile(**compile_args(steps, jit_compile))
    seen = Seen()
    x, y = data()
    history = m.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[seen],
        validation_data=data(40, seed=1),
        **fit_args,
    ).history
    x_test, y_test = data(37, seed=2)
    evaluated = m.evaluate(x_test, y_test, batch_size=BATCH, verbose=0, callbacks=[seen])
    predicted = m.predict(x_test, batch_size=BATCH, verbose=0, callbacks=[seen])
    return history, evaluated, predicted, seen.seen


def assert_same_as_keras(pipe, keras_model, got, want):
    assert got[3] == want[3]  # every callback hook: same batch indices, same losses
    assert got[0].keys() == want[0].keys()
    for key in want[0]:
        np.testing.assert_allclose(got[0][key], want[0][key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    np.testing.assert_allclose(got[2], want[2], atol=1e-5)
    for ours, theirs in zip(pipe.get_weights(), keras_model.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
    moments = [v.numpy() for v in pipe.optimizer.variables if len(v.shape) > 0]
    keras_moments = [v.numpy() for v in keras_model.optimizer.variables if len(v.shape) > 0]
    for ours, theirs in zip(moments, keras_moments, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)


def pair(stages, replicas, micro_batches, **pipeline_args):
    keras_model = model()
    template = keras.models.clone_model(keras_model)
    template.set_weights(keras_model.get_weights())
    pipe = hybrid.Pipeline(
        template,
        hybrid.DeviceMesh.create(stages, replicas),
        micro_batches=micro_batches,
        remat="never",
        **pipeline_args,
    )
    return keras_model, pipe


@pytest.mark.parametrize(
    "stages,replicas,micro_batches,steps,prefetch,traces",
    # traces: the numbers of batches run in one call. 7 batches, the last padded; the pipeline's
    # first step runs alone. N=4: 1 + 3, 2 + 1 | 4, 2 + 1.  N=3: 1 + 2, 3, 1 | 3, 3, 1.
    [(2, 2, 2, 4, 2, 3), (2, 1, 4, 3, 0, 2)],
)
def test_fit_evaluate_predict_match_keras(stages, replicas, micro_batches, steps, prefetch, traces):
    keras_model, pipe = pair(stages, replicas, micro_batches, prefetch=prefetch)
    want = workflow(keras_model, steps)
    got = workflow(pipe, steps)
    assert_same_as_keras(pipe, keras_model, got, want)
    assert int(pipe.step_counter.numpy()) == 14  # 7 batches, 2 epochs
    # one trace per number of batches stacked, however many executions ran
    assert pipe._steps.train_many.experimental_get_tracing_count() == traces


def test_an_execution_is_bit_identical_to_single_steps():
    """N steps in one call compute exactly what N calls of the single step compute."""
    x, y = data(128)
    pipes = []
    for steps in (1, 4):
        _, pipe = pair(2, 2, 2)
        pipe.compile(**compile_args(steps, jit_compile=True))
        pipe.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        pipes.append(pipe)
    assert pipes[1]._steps.train_many.experimental_get_tracing_count() == 2  # 1 + 3, 4
    for ours, theirs in zip(pipes[0].get_weights(), pipes[1].get_weights(), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_timed_steps_run_alone_inside_an_execution():
    keras_model, pipe = pair(2, 1, 2)
    pipe.timeline_every = 3
    want = workflow(keras_model, 2, jit_compile=True)  # timed steps run XLA programs
    got = workflow(pipe, 2, jit_compile=True)
    assert_same_as_keras(pipe, keras_model, got, want)
    assert pipe.last_timeline is not None  # step 12, timed, inside the execution 11-12


def test_under_a_strategy():
    keras_model, pipe = pair(1, 1, 2, strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
    want = workflow(keras_model, 3)
    got = workflow(pipe, 3)
    assert_same_as_keras(pipe, keras_model, got, want)


@pytest.mark.parametrize("steps", [0, -2, 1.5, "auto", True, None])
def test_bad_steps_per_execution_is_refused_naming_it(steps):
    _, pipe = pair(2, 1, 2)
    with pytest.raises(ValueError, match=rf"steps_per_execution={steps!r}.*integer >= 1"):
        pipe.compile(**compile_args(steps))


def test_the_launcher_runs_executions_checkpoints_between_them_and_resumes(tmp_path):
    """``--steps_per_execution=3`` trains exactly the steps an N=1 run trains: 7 steps are
    executions 1-3, 4-6 and a short 7; checkpoints come at 3, 6 and 7; a run resumed from
    step 7 with N=3 runs 8-10, and ends with the weights of N=1 run to 10."""
    config = TrainConfig.of(
        model="mlp",
        data="synthetic",
        mesh="stage:2;replica:1",
        micro_batches=2,
        global_batch_size=8,
        width=8,
        depth=1,
        log_every=3,
        jit_compile=False,
        prefetch=0,
    )
    lines = []
    executions = config.replace(
        model_dir=str(tmp_path / "n3"), steps_per_execution=3, checkpoint_every=3
    )
    result = train(executions.replace(train_steps=7), log=lines.append)
    said = "\n".join(lines)
    assert "compiled and ran steps 1-3 in" in said
    # the first execution of 3 steps in one call traces them: said, and kept out of the rate
    assert "traced the execution of steps 4-6" in said
    assert len(result.losses) == 3  # one per execution
    written = sorted(n for n in os.listdir(tmp_path / "n3") if n.endswith(".index"))
    assert written == ["ckpt-3.index", "ckpt-6.index", "ckpt-7.index"]
    resumed = train(executions.replace(train_steps=10), log=lines.append)
    assert resumed.start_step == 7 and len(resumed.losses) == 1
    single = train(config.replace(train_steps=10), log=lambda _: None)
    for ours, theirs in zip(
        resumed.pipeline.get_weights(), single.pipeline.get_weights(), strict=True
    ):
        np.testing.assert_array_equal(ours, theirs)
    assert resumed.losses[-1] == single.losses[-1]
    with pytest.raises(ValueError, match="--log_every=3 is not a multiple"):
        train(config.replace(steps_per_execution=2), log=lambda _: None)
