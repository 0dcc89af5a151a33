"""The Pipeline API beyond training equivalence: inference, weights, balance, bad input."""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import hybrid

import reference as ref
import runner


def make(stages=2, replicas=1, micro_batches=2, layers=None, **kwargs):
    """The test MLP's pipeline; stage programs as TensorFlow graphs (the API is the point
    here: the equivalence tests compile them with XLA)."""
    kwargs.setdefault("optimizer", keras.optimizers.Adam(1e-3))
    kwargs.setdefault("jit_compile", False)
    return ref.pipeline(stages, replicas, layers=layers, micro_batches=micro_batches, **kwargs)


def test_layout_in_the_constructor_and_keras_compile_trains_as_keras():
    """Pipeline(model, mesh, **layout) then compile(...) as keras.Model.compile: the same
    step as Keras's on one device, with compile's defaults (RMSprop)."""
    keras_model = keras.Sequential([keras.Input((ref.IN_FEATURES,)), *ref.mlp_layers()])
    keras_model.compile(loss=ref.loss_fn())  # optimizer="rmsprop", Keras's default
    template = keras.Sequential([keras.Input((ref.IN_FEATURES,)), *ref.mlp_layers()])
    template.set_weights(keras_model.get_weights())
    pipe = hybrid.Pipeline(template, hybrid.DeviceMesh.create(2, 2), micro_batches=2)
    assert not pipe.compiled
    pipe.compile(loss=ref.loss_fn(), jit_compile=False)
    assert pipe.compiled
    for step in range(2):
        x, y = ref.batch(16, seed=step)
        want = keras_model.train_on_batch(x, y)
        np.testing.assert_allclose(pipe.train_step(x, y)["loss"], want, rtol=1e-5)
    assert type(pipe.optimizer.copies[0]) is keras.optimizers.RMSprop
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())


def test_compile_wraps_a_mixed_float16_optimizer_as_keras_compile_does():
    """auto_scale_loss: a LossScaleOptimizer exactly where Keras's compile puts one."""
    wanted = []
    for auto_scale_loss in (True, False):
        keras.mixed_precision.set_dtype_policy("mixed_float16")  # the model's own policy
        try:
            inputs = keras.Input((3,))
            out = keras.layers.Dense(2, dtype="float32")(keras.layers.Dense(4)(inputs))
            keras_model = keras.Model(inputs, out)
        finally:
            keras.mixed_precision.set_dtype_policy("float32")
        keras_model.compile(optimizer="sgd", loss="mse", auto_scale_loss=auto_scale_loss)
        pipe = hybrid.Pipeline(keras_model, hybrid.DeviceMesh.create(2, 1))
        pipe.compile(optimizer="sgd", loss="mse", auto_scale_loss=auto_scale_loss)
        pipe.build((None, 3))
        want = type(keras_model.optimizer)
        assert [type(row[0].optimizer) for row in pipe.stages] == [want, want], auto_scale_loss
        wanted.append(want)
    assert wanted == [keras.optimizers.LossScaleOptimizer, keras.optimizers.SGD]


def test_a_planned_config_is_taken_whole():
    config = hybrid.RunConfig(stages=2, replicas=1, micro_batches=4, schedule="1f1b", remat="never")
    pipe = hybrid.Pipeline(ref.mlp_layers(), config=config)  # the mesh from the config
    assert pipe.mesh == hybrid.DeviceMesh.create(2, 1)
    assert (pipe.micro_batches, pipe.config.schedule, pipe.remat) == (4, "1f1b", "never")
    with pytest.raises(TypeError, match=r"comes with \['micro_batches'\]; give the layout once"):
        hybrid.Pipeline(ref.mlp_layers(), config=config, micro_batches=2)
    with pytest.raises(ValueError, match="the config is for 2 stage.* and the mesh is 1 × 2"):
        hybrid.Pipeline(ref.mlp_layers(), hybrid.DeviceMesh.create(1, 2), config=config)
    with pytest.raises(TypeError, match="config=.* give a hybrid.RunConfig"):
        hybrid.Pipeline(ref.mlp_layers(), config={"stages": 2})


def test_uncompiled_and_uncompilable_are_refused_as_keras_refuses():
    pipe = hybrid.Pipeline(ref.mlp_layers(), hybrid.DeviceMesh.create(2, 1))
    x, y = ref.batch(8)
    for name, call in (
        ("fit", lambda: pipe.fit(x, y, verbose=0)),
        ("evaluate", lambda: pipe.evaluate(x, y, verbose=0)),
        ("predict", lambda: pipe.predict(x, verbose=0)),
        ("train_step", lambda: pipe.train_step(x, y)),
        ("build", lambda: pipe.build((None, ref.IN_FEATURES))),
    ):
        with pytest.raises(
            ValueError, match=rf"You must call `compile\(\)` before calling `{name}\(\)`"
        ):
            call()
    for arguments, match in (
        ({"loss": None}, "loss=None"),
        ({"loss": "mse", "run_eagerly": True}, "run_eagerly=True"),
        ({"loss": "mse", "steps_per_execution": 0}, "steps_per_execution=0"),
        ({"loss": "mse", "jit_compile": "yes"}, "jit_compile='yes'"),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            pipe.compile(**arguments)
    pipe.compile(loss=ref.loss_fn(), jit_compile=False)
    pipe.train_step(x, y)
    with pytest.raises(ValueError, match="compile\\(\\) after the pipeline was built"):
        pipe.compile(loss="mse")


def test_a_strategy_gives_the_replicated_step():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    pipe = hybrid.Pipeline(ref.mlp_layers(), hybrid.DeviceMesh.create(1, 1), strategy=strategy)
    assert pipe.strategy is strategy
    # what the replicated step cannot do yet is refused when asked for, with the reason
    with pytest.raises(ValueError, match="timeline_every: timed steps need the devices' clocks"):
        pipe.timeline_every = 2
    pipe.timeline_every = 0
    pipe.compile(optimizer="sgd", loss=ref.loss_fn())
    x, y = ref.batch(4)
    with pytest.raises(ValueError, match="gradients: a replicated step applies its gradients"):
        pipe.gradients(x, y)
    with pytest.raises(ValueError, match="timed_train_step: timed steps need"):
        pipe.timed_train_step(x, y)
    assert hybrid.Pipeline(ref.mlp_layers(), hybrid.DeviceMesh.create(1, 1)).strategy is None


def test_predict_and_evaluate_match_keras():
    model = keras.Sequential([keras.Input((ref.IN_FEATURES,))] + ref.mlp_layers())
    pipe = make(stages=4, replicas=2, micro_batches=2)
    pipe.build((None, ref.IN_FEATURES))
    pipe.set_weights(model.get_weights())
    x, y = ref.batch(32)
    np.testing.assert_allclose(pipe.predict(x, verbose=0), model(x).numpy(), rtol=1e-5, atol=1e-6)
    want = float(ref.loss_fn()(y, model(x)))
    np.testing.assert_allclose(pipe.evaluate(x, y, verbose=0), want, rtol=1e-5)
    assert pipe.predict(x, verbose=0).shape == (32, ref.CLASSES)


def test_get_weights_order_matches_sequential():
    layers = ref.mlp_layers()
    model = keras.Sequential([keras.Input((ref.IN_FEATURES,))] + layers)
    pipe = make(stages=3, layers=layers)
    pipe.build((None, ref.IN_FEATURES))
    got, want = pipe.get_weights(), model.get_weights()
    assert [w.shape for w in got] == [w.shape for w in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)  # copies start from the model's own weights


def test_set_weights_reaches_every_replica():
    pipe = make(stages=2, replicas=2)
    pipe.build((None, ref.IN_FEATURES))
    new = [np.full_like(w, i) for i, w in enumerate(pipe.get_weights())]
    pipe.set_weights(new)
    for r in range(2):
        for a, b in zip(pipe.replica_weights(r), new, strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=f"expected {len(new)} weight arrays, got 1"):
        pipe.set_weights(new[:1])


def test_first_call_builds_and_trains():
    pipe = make(stages=2, replicas=2, micro_batches=2)
    x, y = ref.batch(16)
    first = pipe.train_step(x, y)["loss"]
    for _ in range(20):
        last = pipe.train_step(x, y)["loss"]
    assert pipe.built and last < first


def test_summary_and_repr_say_what_the_pipeline_is():
    x_in = keras.Input((8,))
    h = keras.layers.Dense(16, name="first")(x_in)
    long = "inner_projection_of_the_residual_branch_with_a_long_name"  # wider than its column
    r = keras.layers.Dense(16, name=long)(keras.layers.LayerNormalization(name="norm")(h))
    h = keras.layers.Add(name="join")([h, r])
    model = keras.Model(x_in, keras.layers.Dense(3, name="out")(h))
    pipe = hybrid.Pipeline(
        model, mesh=hybrid.DeviceMesh.create(2, 2), micro_batches=4, balance=[2, 3], schedule="1f1b"
    )
    pipe.compile(optimizer="sgd", loss="mse", jit_compile=False)  # fmt: skip
    assert repr(pipe) == (
        "Pipeline(mesh stage:2;replica:2, M=4, 1f1b, remat=except_last, balance (2, 3), not built)"
    )
    with pytest.raises(RuntimeError, match="call pipe.build"):
        pipe.summary()
    pipe.build((None, 8))
    assert repr(pipe).endswith("remat=except_last, balance (2, 3))")
    shown = []
    assert pipe.summary(print_fn=shown.append) is None  # as keras.Model.summary
    (text,) = shown
    lines = text.splitlines()
    assert lines[0] == "Pipeline: " + repr(pipe)[len("Pipeline(") : -1]
    stage0, in0, stage1, in1 = lines[3:7]
    assert stage0.split()[:5] == ["0", "device:CPU:0,", "device:CPU:1", "first,", "norm"]
    assert "(2)" in stage0 and f"{8 * 16 + 16 + 2 * 16:,}" in stage0  # first + norm
    assert in0.split() == ["in:", "(batch,", "8)", "float32"]
    assert stage1.split()[:5] == ["1", "device:CPU:2,", "device:CPU:3", long, "…"]
    assert "out (3)" in stage1 and f"{16 * 16 + 16 + 16 * 3 + 3:,}" in stage1
    end = lines[1].index("params") + len("params")  # the columns line up under the titles
    assert stage0[:end].endswith(f"{8 * 16 + 16 + 2 * 16:,}")
    assert stage1[:end].endswith(f"{16 * 16 + 16 + 16 * 3 + 3:,}")
    # the skip crosses the cut beside the activation
    assert in1.split() == ["in:", "(batch,", "16)", "float32,", "(batch,", "16)", "float32"]
    # built without a batch size: no memory predicted ("?")
    assert stage0.split()[-1] == stage1.split()[-1] == "?"
    shares = [float(line.split()[-2].rstrip("%")) for line in (stage0, stage1)]
    assert sum(shares) == pytest.approx(100.0, abs=0.2) and shares[1] > shares[0]
    assert lines[-2].startswith("bubble ") and "schedule 1f1b, M=4" in lines[-2]
    assert lines[-1].startswith("memory: ? (build with the batch size")


def test_balance_params_and_explicit():
    pipe = make(stages=2, balance="params")
    pipe.build((None, ref.IN_FEATURES))
    assert pipe.balance == (5, 3)  # the parameter-count optimum for mlp_layers()
    explicit = make(stages=2, balance=[2, 6])
    assert explicit.balance == (2, 6)
    explicit.build((None, ref.IN_FEATURES))
    assert [len(s[0].layers) for s in explicit.stages] == [2, 6]


def _cnn():
    """Compute at the start (four 3×3 convolutions on 16×16×8), parameters at the end (a
    Dense on the 2,048 flattened features)."""
    inputs = keras.Input((16, 16, 8))
    h = inputs
    for _ in range(4):
        h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
    h = keras.layers.Dense(64, activation="relu")(keras.layers.Flatten()(h))
    return keras.Model(inputs, keras.layers.Dense(10)(h))


def test_the_default_cut_balances_compute_and_summary_names_it():
    """Work per example (``layer_costs.call_work``: weights × positions + output elements):
    each convolution 584 × 256 + 2,048 = 151,552, the flatten 2,048, the Dense layers
    131,136 + 64 and 650 + 10; parameters 584 per convolution, 131,136 and 650. By
    parameters the cut is (4 convolutions, flatten | Dense, Dense): stage 0 does 82.2 % of
    the work; by compute (the default) (2 | 5): 59.0 %."""
    model = _cnn()
    pipes = {}
    for balance in (None, "params"):
        pipes[balance] = hybrid.Pipeline(model, hybrid.DeviceMesh.create(2, 1), balance=balance)
        pipes[balance].compile(optimizer="sgd", loss="mse", jit_compile=False)
        pipes[balance].build((4, 16, 16, 8))
    assert pipes["params"].balance == (5, 2)
    assert pipes[None].balance == (2, 5)
    lines = []
    pipes["params"].summary(print_fn=lines.append)
    (advice,) = [line for line in lines[0].splitlines() if "of the compute" in line]
    assert advice == (
        "the largest stage does 82.2% of the compute: balance=[2, 5] (the compute cut, "
        'balance="compute", the default) would make it 59.0%'
    )
    lines = []
    pipes[None].summary(print_fn=lines.append)
    assert "of the compute" not in lines[0]
    x = np.random.default_rng(0).normal(size=(4, 16, 16, 8)).astype("float32")
    for pipe in pipes.values():  # either cut computes the model's function
        np.testing.assert_allclose(
            pipe.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6
        )


def test_balance_time_profiles_layers():
    pipe = make(stages=2, balance="time")
    pipe.build((None, ref.IN_FEATURES))
    assert sum(pipe.balance) == 8 and len(pipe.balance) == 2


def test_balance_time_profiles_layers_that_take_no_training_argument():
    """A functional graph's merge layers (Add, Multiply, Concatenate) and activations take
    no ``training``: each is profiled as the graph calls it (a crash at build before)."""
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    h = keras.layers.BatchNormalization()(h)
    gate = keras.layers.Activation("hard_sigmoid")(keras.layers.GlobalAveragePooling2D()(h))
    h = keras.layers.Multiply()([h, keras.layers.Reshape((1, 1, 8))(gate)])
    h = keras.layers.Add()([h, keras.layers.Conv2D(8, 1)(h)])
    h = keras.layers.Concatenate()([h, keras.layers.Dropout(0.1)(h)])
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    pipe = hybrid.Pipeline(model, hybrid.DeviceMesh.create(2, 1), micro_batches=2, balance="time")
    pipe.compile(optimizer="sgd", loss="mse", jit_compile=False)
    pipe.build((4, 8, 8, 3))
    assert len(pipe.balance) == 2 and sum(pipe.balance) == len(pipe.stages[0][0].layers) + len(
        pipe.stages[1][0].layers
    )


def test_optimizer_factory_and_plain_callable_loss():
    pipe = hybrid.Pipeline(ref.mlp_layers(), mesh=hybrid.DeviceMesh.create(2, 1), micro_batches=2)
    pipe.compile(
        optimizer=lambda: keras.optimizers.SGD(0.1),
        loss=lambda y_true, y_pred: keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True
        ),
    )
    x, y = ref.batch(8)
    model = keras.Sequential([keras.Input((ref.IN_FEATURES,))] + ref.mlp_layers())
    pipe.build((None, ref.IN_FEATURES))
    pipe.set_weights(model.get_weights())
    np.testing.assert_allclose(
        pipe.train_step(x, y)["loss"], float(ref.loss_fn()(y, model(x))), rtol=1e-5
    )
    assert pipe.stages[0][0].optimizer is not pipe.stages[1][0].optimizer


def test_unbuilt_access():
    pipe = make()
    with pytest.raises(RuntimeError, match="call build"):
        pipe.get_weights()
    with pytest.raises(RuntimeError, match="call build"):
        _ = pipe.balance


# -- bad input: clear errors with the values and the remedy ------------------------------


def test_a_batch_not_divisible_by_r_times_m_is_padded_not_refused():
    """30 examples on R·M = 8: padded to 32 with examples that count for nothing; the
    loss is that of the 30 (``test_fit.py`` checks weights and metrics against Keras)."""
    pipe = make(stages=2, replicas=2, micro_batches=4)
    pipe.build((None, ref.IN_FEATURES))
    x, y = ref.batch(30)
    want = float(ref.loss_fn()(y, pipe.to_keras()(x)))
    np.testing.assert_allclose(pipe.train_step(x, y)["loss"], want, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot pad a batch of 30 examples to 28"):
        pipe._batch(x, y, pad_to=28)


def test_labels_batch_mismatch():
    pipe = make()
    x, y = ref.batch(8)
    with pytest.raises(ValueError, match=r"x has 8 examples but y has shape \(4,\)"):
        pipe.train_step(x, y[:4])


def test_more_stages_than_layers():
    with pytest.raises(
        ValueError, match="the run has 4 model stages but the model has only 3 layers"
    ):
        make(stages=4, layers=ref.mlp_layers()[:3])


@pytest.mark.parametrize(
    "balance,match",
    [
        ([3, 3], "sums to 6 but the model has 8 layers"),
        ([8], "has 1 entries but the mesh has 2 stages"),
        ("flops", "unknown balance 'flops'"),
    ],
)
def test_bad_balance(balance, match):
    with pytest.raises(ValueError, match=match):
        make(stages=2, balance=balance)


def test_unknown_schedule_and_remat():
    with pytest.raises(
        ValueError, match=r"unknown schedule 'gpip'; choose one of \['1f1b', 'gpipe'"
    ):
        make(schedule="gpip")
    with pytest.raises(
        ValueError, match=r"unknown remat mode 'sometimes'; choose one of \['never'"
    ):
        make(remat="sometimes")


@pytest.mark.parametrize("micro_batches", [0, -1, 2.5])
def test_bad_micro_batches(micro_batches):
    with pytest.raises(ValueError, match="micro_batches must be a positive integer"):
        make(micro_batches=micro_batches)


def test_micro_batches_auto_times_every_m_on_the_first_batch_and_trains_as_keras():
    keras_model = ref.Reference(ref.mlp_layers(), ref.OPTIMIZERS["sgd_momentum"]())
    pipe = ref.pipeline(2, 2, micro_batches="auto", schedule="1f1b", remat="never")
    pipe.build((None, ref.IN_FEATURES))
    pipe.set_weights(keras_model.model.get_weights())
    assert pipe.micro_batches == 1 and pipe.micro_batch_seconds == {}  # until a batch
    x, y = ref.batch(8)
    loss = pipe.train_step(x, y)["loss"]
    # 4 examples per replica: M in 1, 2, 4 timed; the fastest kept
    seconds = pipe.micro_batch_seconds
    assert sorted(seconds) == [1, 2, 4] and min(seconds.values()) > 0
    M = pipe.micro_batches
    assert seconds[M] == min(seconds.values())
    assert pipe.config.micro_batches == M and pipe.schedule.num_microbatches == M
    # choosing trained nothing: one step is the one Keras takes on the whole batch
    np.testing.assert_allclose(loss, keras_model.train_step(x, y), rtol=1e-5)
    ref.assert_weights_close(pipe.get_weights(), keras_model.model.get_weights())
    pipe.train_step(x, y)
    keras_model.train_step(x, y)
    assert sorted(pipe.micro_batch_seconds) == [1, 2, 4]  # chosen once
    ref.assert_weights_close(pipe.get_weights(), keras_model.model.get_weights())
    assert int(pipe.step_counter.numpy()) == 2


def test_micro_batches_auto_candidates_and_refusals(monkeypatch):
    from hybrid.core.config import RunConfig
    from hybrid.engine.api import micro_batching

    interleaved = RunConfig(2, 1, 2, "interleaved", "never", 2)
    assert micro_batching.candidates(interleaved, 16) == [2, 4, 8, 16]  # M % S == 0
    assert micro_batching.candidates(RunConfig(1, 2, 1), 64) == [1, 2, 4, 8, 16]  # up to 16
    assert micro_batching.candidates(RunConfig(2, 2, 2, "interleaved", "never", 2), 2) == []
    with pytest.raises(ValueError, match=r"micro_batches='fast': give a positive integer"):
        make(micro_batches="fast")
    with pytest.raises(ValueError, match="no micro-batch count that the 'interleaved'"):
        make(micro_batches="auto", schedule="interleaved", virtual_stages=2).train_step(
            *ref.batch(1)
        )
    with pytest.raises(ValueError, match="micro_batches='auto' times the gradient step"):
        hybrid.Pipeline(
            ref.mlp_layers(),
            hybrid.DeviceMesh.create(1, 1),
            strategy=tf.distribute.OneDeviceStrategy("/cpu:0"),
            micro_batches="auto",
        ).compile(optimizer=keras.optimizers.SGD(0.1), loss=ref.loss_fn())
    # a BatchNormalization model whose choice splits the batch is warned, as a given M is
    monkeypatch.setattr(micro_batching, "candidates", lambda config, examples: [2])
    norm = [keras.layers.Dense(4), keras.layers.BatchNormalization(), keras.layers.Dense(10)]
    pipe = make(stages=1, micro_batches="auto", layers=norm)
    with pytest.warns(UserWarning, match=r"normalize each micro-batch alone in training: 2 ex"):
        pipe.train_step(*ref.batch(4))
    assert pipe.micro_batches == 2


def test_bad_model_and_optimizer():
    with pytest.raises(
        TypeError,
        match=r"a Keras model \(functional or Sequential\) or a list of Keras layers, got object",
    ):
        make(layers=object())
    with pytest.raises(TypeError, match="layer 1 is int"):
        make(layers=[keras.layers.Dense(2), 3])
    with pytest.raises(TypeError, match="zero-argument factory"):
        make(optimizer=3)


def test_several_pipelines_in_a_process_do_not_warn_of_retracing(caplog):
    """TensorFlow warns when 5 of a function's last 10 calls traced it, counting every
    tf.function made of one Python function together: six pipelines (or six M) each tracing
    its own step once is no retracing, and no warning. A step that does retrace still
    warns (its own count)."""
    x, y = ref.batch(8)
    for _ in range(6):
        layers = [keras.layers.Dense(4), keras.layers.Dense(ref.CLASSES)]
        pipe = ref.pipeline(2, 1, layers=layers, jit_compile=False)
        pipe.train_step(x, y)
    assert "triggered tf.function retracing" not in caplog.text, caplog.text
    for size in range(4, 16, 2):  # a new batch shape every call: six traces of one step
        pipe.gradients(*ref.batch(size))
    assert "triggered tf.function retracing" in caplog.text, caplog.text


if __name__ == "__main__":
    sys.exit(runner.main(__file__))


def test_the_all_reduce_is_chosen_by_where_the_devices_are_and_both_agree():
    """CPU devices of one process add the group's tensors themselves; GPUs and devices on
    several hosts use a collective; on 4 simulated devices both give the same sums on every
    device, bit for bit."""
    from hybrid.engine.step import collectives

    local = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]
    assert collectives.method_for(local) == "sum"
    assert collectives.method_for(["/device:GPU:0", "/device:GPU:1"]) == "collective"
    remote = ["/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"]
    assert collectives.method_for(remote) == "collective"
    with pytest.raises(ValueError, match="all-reduce method 'ring': choose one of"):
        collectives.ReplicaGroup(local, method="ring")
    core = "/device:TPU_REPLICATED_CORE:1"  # a logical core of a replicated TPU program
    assert collectives.method_for([core]) == "cross_replica"
    with pytest.raises(ValueError, match="one logical device"):
        collectives.ReplicaGroup(local, method="cross_replica")

    rng = np.random.default_rng(0)
    values = [
        [rng.normal(size=(3, 5)).astype("float32"), rng.normal(size=7).astype("float32")]
        for _ in local
    ]
    results = {}
    for method in ("sum", "collective"):  # cross_replica: tests/test_tpu_program.py
        group = collectives.ReplicaGroup(local, method=method)

        @tf.function(autograph=False)
        def reduce(group=group):
            tensors = []
            for device, per in zip(local, values, strict=True):
                with tf.device(device):
                    tensors.append([tf.constant(v) for v in per])
            return group.all_reduce_sum(tensors), group.all_reduce_mean(tensors)

        sums, means = reduce()
        results[method] = [[t.numpy() for t in row] for row in sums]
        for row, mean_row in zip(sums, means, strict=True):
            wants = [sum(each) for each in zip(*values, strict=True)]
            for got, mean, want in zip(row, mean_row, wants, strict=True):
                np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
                np.testing.assert_allclose(mean.numpy(), want / 4, rtol=1e-6)
        for row in results[method][1:]:
            for got, first in zip(row, results[method][0], strict=True):
                np.testing.assert_array_equal(got, first)  # every device: the same bits


def test_boundary_codecs_round_trip_within_their_error():
    """bfloat16 keeps 8 mantissa bits (relative error ≤ 2⁻⁸); int8 one scale per tensor
    (absolute error ≤ scale / 2, zeros stay zeros); integer tensors and None cross as they
    are."""
    from hybrid.engine.step import compression

    t = tf.constant(np.random.default_rng(0).normal(size=(64, 16)).astype("float32"))
    ids = tf.constant([[1, 2, 3]])
    for name in ("bfloat16", "int8"):
        codec = compression.codec_for(compression.check_boundary_dtype(name))
        wires = codec.encode([t, ids, None, tf.zeros((4,))])
        assert wires[0].parts[0].dtype == {"bfloat16": tf.bfloat16, "int8": tf.int8}[name]
        back, same_ids, none, zeros = codec.decode(wires)
        assert back.dtype == tf.float32 and none is None and same_ids is ids
        np.testing.assert_array_equal(zeros.numpy(), np.zeros(4))
        error = np.abs(back.numpy() - t.numpy())
        if name == "bfloat16":
            assert np.all(error <= np.abs(t.numpy()) * 2.0**-8)
        else:
            assert np.all(error <= float(tf.reduce_max(tf.abs(t))) / 127 / 2 + 1e-7)
        assert error.max() > 0  # it did compress
    assert compression.check_boundary_dtype("float32") is None
    with pytest.raises(ValueError, match=r"boundary_dtype='float16': choose None or one of"):
        make(boundary_dtype="float16")


@pytest.mark.parametrize("boundary_dtype,tolerance", [("bfloat16", 1e-2), ("int8", 0.35)])
def test_compressed_boundaries_train_close_to_float32(boundary_dtype, tolerance):
    """2×2 mesh, 1F1B, 3 SGD steps: the compressed run's losses, and each weight's change,
    stay within the codec's error of the float32 run's (relative to the largest change of
    that weight), and differ from them (the transfers were compressed); the replicas stay
    identical. Measured: bfloat16 within 1 % of each change; int8, whose one scale per
    tensor rounds a gradient's small entries away, up to 24 % (the first stage's, whose
    gradients crossed the boundary quantized)."""
    x, y = ref.batch(32)
    runs = {}
    for dtype in (None, boundary_dtype):
        pipe = make(
            stages=2,
            replicas=2,
            micro_batches=2,
            schedule="1f1b",
            jit_compile=False,
            optimizer=keras.optimizers.SGD(0.5),
            boundary_dtype=dtype,
            build=True,
        )
        start = pipe.get_weights()
        losses = [pipe.train_step(x, y)["loss"] for _ in range(3)]
        changes = [w - w0 for w, w0 in zip(pipe.get_weights(), start, strict=True)]
        runs[dtype] = losses, changes
        for a, b in zip(pipe.replica_weights(0), pipe.replica_weights(1), strict=True):
            np.testing.assert_array_equal(a, b)
    (want, want_changes), (got, got_changes) = runs[None], runs[boundary_dtype]
    np.testing.assert_allclose(got, want, rtol=tolerance)
    assert got[1:] != want[1:]
    for a, b in zip(got_changes, want_changes, strict=True):
        np.testing.assert_allclose(a, b, atol=tolerance * np.abs(b).max())
