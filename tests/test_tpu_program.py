"""The pipeline's step as one program per replica (``Pipeline(strategy=...)``): traced by a real
``TPUStrategy`` on an offline slice, and run on CPUs under ``MirroredStrategy``.

Traces (``hybrid.platforms.tpu_offline``: no TPU, the program is never run), for every
schedule and the meshes 2×2, 4×2, 2×4, and for a functional model with a skip and a tied
embedding. Each asserts on the traced TPU program:
  * every op of an action of stage s (its name scope ``F_s.._m..``) is on the core of s's
    pipeline row, and no op of the replicated computation is left unplaced;
  * exactly one CrossReplicaSum per model stage, on its core, and one for the loss divisors
    (on the last core), none elsewhere;
  * each core's actions follow the schedule by *data*: every action's ops depend on the
    previous action of its core through data edges alone (what XLA keeps);
  * each core reads exactly the variables of its stages and their optimizer slots, with
    their shapes: the model's memory is split by stage.
Numerics: the same program under ``MirroredStrategy`` on 2 CPU devices (the replica
context's all-reduce in place of the TPU's CrossReplicaSum) equals plain Keras on one device
for the recipes of ``test_keras_exact`` whose reductions it does (losses, evaluate, weights,
optimizer state), the reference models and ``fit`` with metrics and a checkpoint round trip;
the replicas stay bit-identical; BatchNormalization behaves as on the mesh engine. The
launcher's TPU attempt builds the step on an offline slice and stops where a TPU is needed.
"""

import collections
import re
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
import test_any_model as any_model
import test_fit as fit_tests
import test_keras_exact as exact
from tensorflow.python.ops import handle_data_util
from test_tpu_mesh import build_topology

import hybrid
from hybrid.core import schedule as sched
from hybrid.platforms.tpu_offline import offline_strategy

import reference as ref
import runner

# An action's name scope; its tape's gradient ops are named gradient_tape/<forward scope>/.
SCOPE = re.compile(r"^(?:gradient_tape/)?([FBW])_s(\d+)_m(\d+)/")
SCAFFOLD = ("TPUReplicateMetadata",)  # the replication's own ops, on no core
# An action with only these computes nothing (stage 0's B in a split schedule: no dx, and
# its dW comes in W): there is nothing to order.
BOOKKEEPING = ("XlaOptimizationBarrier", "Identity", "Const", "NoOp")


def topology(cores):
    """One host's slice: 4 cores (2×2 chips) or 8 (2×2×2 chips)."""
    chips = (2, 2, 1) if cores == 4 else (2, 2, 2)
    return build_topology(chips, 1, host=chips)[0]


def traced(
    stages,
    replicas,
    schedule,
    model=None,
    objective=None,
    batch=None,
    micro_batches=4,
    optimizer=None,
):
    strategy, tpu = offline_strategy(topology(stages * replicas), stages, replicas)
    virtual = 2 if schedule == "interleaved" else 1
    pipe = hybrid.Pipeline(
        model if model is not None else ref.mlp_layers(),
        tpu.mesh,
        strategy=strategy,
        micro_batches=micro_batches,
        schedule=schedule,
        virtual_stages=virtual,
        remat="never",
    )
    pipe.compile(
        optimizer=optimizer or keras.optimizers.Adam(1e-3),
        **objective or {"loss": ref.loss_fn()},
    )
    x, y = batch if batch is not None else ref.batch(8 * replicas * micro_batches)
    return pipe, pipe.traced_train_step(x, y)


def in_program(op):
    return "_tpu_replicate" in op.node_def.attr


def core_of(device):
    return int(device.rsplit(":", 1)[1])


def action_of(op):
    """(op, stage, micro-batch) of the action whose scope ``op`` is in (a gradient op of a
    taped forward: that forward's), else None."""
    found = SCOPE.search(op.name)
    return (found.group(1), int(found.group(2)), int(found.group(3))) if found else None


def check_program(pipe, graph):
    ops = [op for op in graph.get_operations() if in_program(op)]
    schedule = pipe.schedule
    # Placed: nothing of the replicated computation is left to the compiler's default.
    unplaced = [
        (op.type, op.name)
        for op in ops
        if not op.device
        and op.type not in SCAFFOLD
        and not (op.type == "Identity" and op.inputs[0].op.type == "TPUReplicatedInput")
    ]
    assert not unplaced, unplaced[:10]
    assert all("TPU_REPLICATED_CORE" in op.device for op in ops if op.device)
    # Every action's ops on its stage's core.
    by_action = collections.defaultdict(list)
    for op in ops:
        action = action_of(op)
        if action is not None:
            if not op.name.startswith("gradient_tape/"):
                by_action[action].append(op)
            want = schedule.device_of(action[1])
            assert core_of(op.device) == want, (op.name, op.device, want)
    # One all-reduce per model stage on its core, one more for the divisors on the last.
    sums = collections.Counter(core_of(op.device) for op in ops if op.type == "CrossReplicaSum")
    want = collections.Counter(schedule.device_of(k) for k in range(schedule.num_model_stages))
    if not pipe._loss.late:  # the divisors are known from the labels: summed before the B
        want[schedule.device_of(schedule.num_model_stages - 1)] += 1
    for k, row in enumerate(pipe.stages):  # the all_gather of sparse gradients' slices
        want[schedule.device_of(k)] += any(row[0].sparse)
    assert sums == want
    assert [
        op for op in graph.get_operations() if "CrossReplica" in op.type and not in_program(op)
    ] == []
    check_order(pipe, by_action)
    check_memory(pipe, ops)


def check_order(pipe, by_action):
    """On each core, every action depends by data alone on the one before it."""
    schedule = pipe.schedule
    fused = {(b.stage, b.microbatch) for b in pipe._steps.fused}
    per_device = collections.defaultdict(list)
    for a in pipe._steps.order:  # the order the step was lowered in
        key = (a.op.name, a.stage, a.microbatch)
        if a.op.name != "F" and (a.stage, a.microbatch) in fused:
            continue  # run inside the fused forward's scope
        if any(op.type not in BOOKKEEPING for op in by_action.get(key, [])):
            per_device[schedule.device_of(a.stage)].append(key)
    assert sum(map(len, per_device.values())) >= schedule.num_microbatches * 2
    for device, keys in per_device.items():
        for before, after in zip(keys, keys[1:], strict=False):
            targets = {id(op) for op in by_action[before]}
            seen, stack = set(), list(by_action[after])
            reached = False
            while stack and not reached:
                op = stack.pop()
                for t in op.inputs:  # data edges only, never control inputs
                    source = t.op
                    if id(source) in targets:
                        reached = True
                        break
                    if id(source) not in seen:
                        seen.add(id(source))
                        stack.append(source)
            assert reached, f"core {device}: {after} does not wait by data for {before}"


def check_memory(pipe, ops):
    """Each core uses exactly its stages' variables and their optimizer slots: the distinct
    replicated variables that ops on core d take (reads, updates, a conditional update's
    inputs) have the shapes of those of row d, and no variable is used on two cores."""
    used = {}  # replicated input -> (core, shape)
    for op in ops:
        for t in op.inputs:
            if t.dtype != tf.resource:
                continue
            source = t.op
            while source.type == "Identity":
                source = source.inputs[0].op
            if source.type != "TPUReplicatedInput":
                continue
            held = handle_data_util.get_resource_handle_data(source.outputs[0])
            shape = tuple(d.size for d in held.shape_and_type[0].shape.dim)
            core = core_of(op.device)
            assert used.setdefault(source.name, (core, shape)) == (core, shape), source.name
    for d in range(pipe.mesh.num_stages):
        want = collections.Counter()
        for k, row in enumerate(pipe.stages):
            if pipe.schedule.device_of(k) == d:
                held = list(row[0].variables) + list(row[0].optimizer.variables)
                want.update(tuple(v.shape) for v in held if len(v.shape))
        got = collections.Counter(shape for core, shape in used.values() if core == d and shape)
        assert got == want, d


TRACES = [
    pytest.param(name, s, r, id=f"{name}-{s}x{r}")
    for name, (s, r) in [(n, (2, 2)) for n in sched.names()]
    + [("1f1b", (4, 2)), ("gpipe", (2, 4)), ("zb-h1", (4, 2)), ("interleaved", (2, 4))]
]


@pytest.mark.parametrize("schedule,stages,replicas", TRACES)
def test_traced_tpu_step(schedule, stages, replicas):
    pipe, graph = traced(stages, replicas, schedule)
    check_program(pipe, graph)


@pytest.mark.parametrize("name", ["skip", "tied_lm", "two_inputs", "two_outputs", "masked_tokens"])
def test_traced_tpu_step_of_the_reference_models(name):
    """``test_any_model``'s models: a skip across stages, a tied embedding read by both
    stages, a dict of inputs, two outputs with their losses, a masked (late-divisor) loss."""
    make, batch, _, _ = any_model.MODELS[name]
    objective = any_model.objective(name)
    pipe, graph = traced(2, 2, "1f1b", make(), objective, batch(0), micro_batches=2)
    if name == "tied_lm":
        assert pipe.placement.ties()  # the embedding is read by both stages
    check_program(pipe, graph)


RECIPE_TRACES = [
    "accumulation", "global_clipnorm", "regularizers", "activity", "float16", "batch_norm",
]  # fmt: skip


def batch_norm_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((ref.IN_FEATURES,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(ref.CLASSES),
        ]
    )


@pytest.mark.parametrize("recipe", RECIPE_TRACES)
def test_traced_tpu_step_of_the_keras_recipes(recipe):
    """Gradient accumulation (the update under a conditional), global clipping, weight and
    activity penalties, and mixed_float16 with its LossScaleOptimizer lower onto the cores
    like the rest (their numerics: the MirroredStrategy runs below and test_keras_exact)."""
    if recipe == "batch_norm":
        model, optimizer = batch_norm_model(), keras.optimizers.SGD(0.1)
    elif recipe == "float16":
        model = exact.float16_model()
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    else:
        model = exact.model(recipe=recipe)
        optimizer = exact.optimizer_for(recipe, model)
    pipe, graph = traced(2, 2, "1f1b", model=model, optimizer=optimizer, micro_batches=2)
    scaled = isinstance(pipe.stages[0][0].optimizer, keras.optimizers.LossScaleOptimizer)
    assert scaled == (recipe == "float16")
    check_program(pipe, graph)


def test_a_strategy_that_does_not_fit_the_mesh_is_refused():
    strategy, tpu = offline_strategy(topology(4), 2, 2)
    with pytest.raises(ValueError, match="runs 2 replica"):
        hybrid.Pipeline(
            ref.mlp_layers(), hybrid.DeviceMesh.create(2, 4), strategy=strategy
        ).compile(optimizer="adam", loss=ref.loss_fn())
    with pytest.raises(ValueError, match="2 core.* per replica and the pipeline 1 stages"):
        hybrid.Pipeline(
            ref.mlp_layers(), hybrid.DeviceMesh.create(1, 2), strategy=strategy
        ).compile(optimizer="adam", loss=ref.loss_fn())


# -- numerics: the same program on CPUs ----------------------------------------------------

# The recipes whose reductions the replicated program does itself (a reduction-None loss,
# sample weights, global clipping, weight and activity penalties) and two the optimizer
# copies do (weight-decay exclusions, clipnorm with EMA); the schedules and micro-batch
# counts in turn. (Gradient accumulation: see docs/guide/tpu.md; on a TPU it traces, above.)
MIRRORED_RECIPES = [
    "none", "sum", "global_clipnorm", "weight_decay", "clipnorm_ema", "regularizers", "activity",
]  # fmt: skip
MIRRORED = [
    pytest.param(recipe, m, schedule, id=f"{recipe}-M{m}-{schedule}")
    for recipe, (m, schedule) in zip(
        MIRRORED_RECIPES,
        [(1, "1f1b"), (2, "gpipe"), (2, "zb-h1"), (2, "interleaved"), (4, "1f1b"),
         (1, "zb-h1"), (2, "interleaved")],
        strict=True,
    )
]  # fmt: skip


@pytest.mark.parametrize("recipe,micro_batches,schedule", MIRRORED)
def test_mirrored_program_matches_keras(recipe, micro_batches, schedule):
    keras_model = exact.model(recipe=recipe)
    keras_model.compile(
        optimizer=exact.optimizer_for(recipe, keras_model), loss=exact.loss_for(recipe)
    )
    template = exact.model(seed=1, recipe=recipe)
    template.set_weights(keras_model.get_weights())
    pipe = hybrid.Pipeline(
        template,
        hybrid.DeviceMesh.create(2, 2),
        strategy=ref.mirrored_strategy(),
        micro_batches=micro_batches,
        schedule=schedule,
        virtual_stages=2 if schedule == "interleaved" else 1,
    )
    pipe.compile(optimizer=exact.optimizer_for(recipe, template), loss=exact.loss_for(recipe))
    weighted = recipe in ("none", "sum", "sum_over_batch_size", "mean_with_sample_weight")
    for step in range(exact.STEPS):
        x, y = ref.batch(exact.BATCH, seed=step + 1)
        w = exact.sample_weights(step) if weighted else None
        want = keras_model.train_on_batch(x, y, sample_weight=w)
        got = pipe.train_step(x, y, sample_weight=w)["loss"]
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"loss of step {step}")
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())
    np.testing.assert_equal(pipe.replica_weights(1), pipe.replica_weights(0))
    x, y = ref.batch(exact.BATCH, seed=9)
    w = exact.sample_weights(9) if weighted else None
    np.testing.assert_allclose(
        pipe.evaluate(x, y, sample_weight=w, batch_size=exact.BATCH, verbose=0),
        keras_model.evaluate(x, y, sample_weight=w, batch_size=exact.BATCH, verbose=0),
        rtol=1e-5,
    )
    state = exact.optimizer_state(row[0].optimizer for row in pipe.stages)
    want = exact.optimizer_state([keras_model.optimizer])
    assert state.keys() == want.keys()
    for kind in want:
        ref.assert_weights_close(state[kind], want[kind])


@pytest.mark.parametrize("name", ["tied_lm", "two_outputs", "masked_tokens"])
def test_mirrored_program_trains_the_reference_models_as_keras(name):
    """A tied embedding (its gradient summed over both stages), two outputs with their own
    losses and sample weights, a masked loss whose divisor comes from the forward."""
    make, batch, _, _ = any_model.MODELS[name]
    keras_model = any_model.build(make, seed=0)
    # tied_lm: clipped by the global norm, which counts the tied embedding's gradient once
    # it is summed over both stages
    clip = 1e-3 if name == "tied_lm" else None
    optimizer = lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=clip)  # noqa: E731
    keras_model.compile(optimizer=optimizer(), **any_model.objective(name))
    template = any_model.build(make, seed=1)
    template.set_weights(keras_model.get_weights())
    pipe = hybrid.Pipeline(
        template,
        hybrid.DeviceMesh.create(2, 2),
        strategy=ref.mirrored_strategy(),
        micro_batches=2,
        schedule="1f1b",
    )
    pipe.compile(optimizer=optimizer(), **any_model.objective(name))
    for step in range(exact.STEPS):
        x, y = batch(step)
        w = any_model.sample_weights(name, step)
        want = keras_model.train_on_batch(x, y, sample_weight=w)
        want = want[0] if isinstance(want, list) else want
        got = pipe.train_step(x, y, sample_weight=w)["loss"]
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"loss of step {step}")
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())
    np.testing.assert_equal(pipe.replica_weights(1), pipe.replica_weights(0))


@pytest.mark.filterwarnings("ignore:.*BatchNormalization")
def test_mirrored_program_keeps_batch_norm_as_the_mesh_engine_defines_it():
    """BatchNormalization under micro-batching is defined, not Keras-exact (docs): the
    replicated program normalizes and updates the moving statistics exactly as the mesh
    engine does (statistics summed over the global batch across replicas)."""
    mesh_model, program_model = batch_norm_model(0), batch_norm_model(1)
    program_model.set_weights(mesh_model.get_weights())
    on_mesh = hybrid.Pipeline(mesh_model, hybrid.DeviceMesh.create(2, 2), micro_batches=2)
    on_mesh.compile(optimizer=keras.optimizers.SGD(0.1), loss=ref.loss_fn(), jit_compile=False)
    program = hybrid.Pipeline(
        program_model,
        hybrid.DeviceMesh.create(2, 2),
        strategy=ref.mirrored_strategy(),
        micro_batches=2,
    )
    program.compile(optimizer=keras.optimizers.SGD(0.1), loss=ref.loss_fn())
    for step in range(exact.STEPS):
        x, y = ref.batch(exact.BATCH, seed=step)
        np.testing.assert_allclose(
            program.train_step(x, y)["loss"], on_mesh.train_step(x, y)["loss"], rtol=1e-6
        )
    ref.assert_weights_close(program.get_weights(), on_mesh.get_weights())
    mean, variance = program.get_weights()[4:6]  # Dense (kernel, bias), BN (gamma, beta, ...)
    assert mean.shape == variance.shape == (16,)
    assert not np.allclose(mean, 0.0) and not np.allclose(variance, 1.0)  # they moved


def test_mirrored_program_fits_evaluates_predicts_and_checkpoints_as_keras(tmp_path):
    """The Keras workflow on the replicated program (what the launcher runs): ``fit`` with
    compiled metrics and validation, ``evaluate``, ``predict`` against Keras; a checkpoint
    restored into a new replicated pipeline carries its weights, optimizer and step."""
    keras_model = fit_tests.model()
    keras_model.compile(**fit_tests.compiled(keras.optimizers.Adam(0.01, epsilon=1e-3)))
    template = fit_tests.model(seed=1)
    template.set_weights(keras_model.get_weights())

    def replicated(model):
        pipe = hybrid.Pipeline(
            model, hybrid.DeviceMesh.create(2, 2), strategy=ref.mirrored_strategy(), micro_batches=2
        )
        pipe.compile(**fit_tests.compiled(keras.optimizers.Adam(0.01, epsilon=1e-3)))
        return pipe

    pipe = replicated(template)
    x, y = fit_tests.data()
    kwargs = dict(batch_size=16, epochs=1, validation_data=fit_tests.data(20, seed=1),
                  shuffle=False, verbose=0)  # fmt: skip
    fit_tests.assert_history_equal(pipe.fit(x, y, **kwargs).history,
                                   keras_model.fit(x, y, **kwargs).history)  # fmt: skip
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())
    x_test, y_test = fit_tests.data(37, seed=2)
    np.testing.assert_allclose(
        pipe.evaluate(x_test, y_test, verbose=0), keras_model.evaluate(x_test, y_test, verbose=0),
        rtol=1e-5,
    )  # fmt: skip
    np.testing.assert_allclose(
        pipe.predict(x_test, verbose=0), keras_model.predict(x_test, verbose=0), atol=1e-5
    )
    saved = hybrid.Checkpointer(pipe, str(tmp_path)).save(int(pipe.step_counter.numpy()))
    restored = replicated(fit_tests.model(seed=2))
    restored.build((None, ref.IN_FEATURES))
    hybrid.Checkpointer(restored, str(tmp_path)).restore(saved)
    ref.assert_weights_close(restored.get_weights(), pipe.get_weights())
    np.testing.assert_equal(restored.replica_weights(1), restored.replica_weights(0))
    assert int(restored.step_counter.numpy()) == int(pipe.step_counter.numpy()) == 4
    stage_optimizers = [row[0].optimizer for row in restored.stages]
    ref.assert_weights_close(
        fit_tests.adam_moments(stage_optimizers), fit_tests.adam_moments([keras_model.optimizer])
    )


def test_the_launcher_builds_the_tpu_step_and_says_where_a_tpu_is_needed(tmp_path):
    """``--platform=tpu``'s attempt on a TPU system (here an offline one): the mesh placed
    on the topology, the Pipeline built under the layout's TPUStrategy; running
    the first step needs the TPU, and the error says so."""
    from hybrid.launch.train import train_on_tpu
    from hybrid.platforms.cloud_tpu.node import TPUSystem
    from hybrid.platforms.tpu_offline import offline_resolver
    from hybrid.run.train_config import TrainConfig

    slice_ = topology(4)
    resolver = offline_resolver(slice_)
    tpus = tuple(d.name for d in resolver.get_tpu_system_metadata().devices if "TPU" in d.name)
    config = TrainConfig.of(
        mesh="stage:2;replica:2", micro_batches=2, train_steps=2, model="mlp",
        data="synthetic", platform="tpu", model_dir=str(tmp_path),
    )  # fmt: skip
    lines = []
    with pytest.raises(RuntimeError, match="was built, but this process has no TPU device"):
        train_on_tpu(config, TPUSystem(resolver, slice_, tpus), log=lines.append)
    assert any(line.startswith("mesh stage:2;replica:2 devices") for line in lines)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
