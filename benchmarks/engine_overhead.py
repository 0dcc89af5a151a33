"""Engine speed side by side: what the Pipeline costs against what a user would write instead.

One process, 2 logical CPU devices (one intra-op thread each), one model (--depth ×
Dense(--width) + a head, batch --batch, SGD, ``remat="never"``, XLA), one fixed batch; every
candidate is timed in alternation (interleaved rounds, medians):

    keras_1_device          compile(jit_compile=True) + train_on_batch on one device
    handwritten_M8          one device, by hand: M XLA gradient calls on the micro-batches,
                            accumulated, one XLA apply (what the 1×1 pipeline does)
    pipeline_1x1_M8         Pipeline on a 1×1 mesh, M = --micro_batches
    pipeline_1x1_M8_deferred  the same with defer_weight_gradients=True (each weight
                            gradient once per step, over all micro-batches' rows)
    pipeline_2x1_M{1,2,4,8} 2 stages × 1 replica (pipelining), and M > 1 deferred
                            (``_deferred``); the planner, from this model's profiled
                            layers, predicts each and picks one
    pipeline_2x1_auto       2 × 1 deferred with micro_batches="auto": M timed at its
                            first step
    pipeline_1x2_M1         1 stage × 2 replicas (data parallelism)
    independent_2_devices   the host's ceiling: a plain one-device XLA step on half the
                            batch on each device at once, nothing exchanged
    mirrored_2_devices      tf.distribute.MirroredStrategy on the same 2 devices, a custom
                            loop with XLA-compiled gradients per replica (Keras's
                            compile(jit_compile=True) fails under the strategy: XLA cannot
                            read the other replica's variables)

and prints the issue-16 ratios:

    engine overhead      pipeline_1x1_M8 / handwritten_M8            (target <= 1.05)
    pipelining speedup   pipeline_1x1_M8 / pipeline_2x1_M8           (target >= 1.65, ideal 1.78)
    pipelined vs plain   keras_1_device / best pipeline_2x1          (target >= 1.2)
    deferred ...         the engine overhead, pipelining speedup and best 2×1 vs plain
                         with deferred weight gradients
    planned vs plain     keras_1_device / the planner's 2×1 (M, deferred)  (target >= 1.2)
    auto vs plain        keras_1_device / pipeline_2x1_auto                 (target >= 1.2)
    data parallelism     keras_1_device / pipeline_1x2_M1            (target >= 1.7)
    vs MirroredStrategy  mirrored_2_devices / pipeline_1x2_M1        (target >= 1.2)
    two-device ceiling   keras_1_device / independent_2_devices      (what the host allows)
    ... of the ceiling   independent_2_devices / pipeline_1x2_M1, and the pipelining
                         speedup / the ceiling (at most M / (M + 1): the 2×1 bubble)

    python benchmarks/engine_overhead.py [--rounds=7] [--steps_per_round=3]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from absl import app, flags

import common

common.define_timing_flags(rounds=7, steps_per_round=3)
common.define_model_flags(depth=4, batch=256)
flags.DEFINE_integer("micro_batches", 8, "M of the 1×1 and 2×1 pipelines and the hand loop.")
FLAGS = flags.FLAGS

LEARNING_RATE = 1e-3


def _model() -> Any:
    import keras

    layers = common.dense_stack(FLAGS.width, FLAGS.depth)
    return keras.Sequential([keras.Input((FLAGS.width,)), *layers])


def _loss() -> Any:
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def keras_step(x: Any, y: Any) -> Callable[[], float]:
    """``compile(jit_compile=True)`` + ``train_on_batch`` on one device."""
    import keras

    model = _model()
    model.compile(keras.optimizers.SGD(LEARNING_RATE), _loss(), jit_compile=True)
    return lambda: float(model.train_on_batch(x, y))


def mirrored_step(x: Any, y: Any, devices: list[str]) -> Callable[[], float]:
    """``tf.distribute.MirroredStrategy`` on ``devices`` as its guide writes a custom loop:
    each replica's gradients of its shard by one XLA call, summed across replicas, applied
    by the optimizer to the mirrored variables."""
    import keras
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        model = _model()
        optimizer = keras.optimizers.SGD(LEARNING_RATE)
        optimizer.build(model.trainable_variables)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    scale = 1.0 / FLAGS.batch

    @tf.function(jit_compile=True)
    def gradients(xr: Any, yr: Any) -> tuple[list[Any], Any]:
        with tf.GradientTape() as tape:
            value = loss(yr, model(xr, training=True)) * scale
        return tape.gradient(value, model.trainable_variables), value

    def replica_step(xr: Any, yr: Any) -> Any:
        grads, value = gradients(xr, yr)
        context = tf.distribute.get_replica_context()
        grads = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
        optimizer.apply(grads, model.trainable_variables)
        return value

    @tf.function
    def step(data: Any) -> Any:
        values = strategy.run(replica_step, args=data)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None)

    # Each replica's shard handed over as a value: a distributed tf.data iterator here kept
    # threads busy that slowed every other candidate of the process by about 25 % and the
    # strategy's own step by 2× (measured).
    shards = list(zip(tf.split(x, len(devices)), tf.split(y, len(devices)), strict=True))
    data = strategy.experimental_distribute_values_from_function(
        lambda context: shards[context.replica_id_in_sync_group]
    )
    return lambda: float(step(data))


def handwritten_step(x: Any, y: Any, micro_batches: int) -> Callable[[], float]:
    """One device, by hand: M XLA calls each adding one micro-batch's gradients (of the
    batch-mean loss) to the accumulators, then one XLA apply."""
    import keras
    import tensorflow as tf

    model, loss = _model(), _loss()
    variables = model.trainable_variables
    optimizer = keras.optimizers.SGD(LEARNING_RATE)
    optimizer.build(variables)
    xs, ys = tf.split(x, micro_batches), tf.split(y, micro_batches)

    @tf.function(jit_compile=True)
    def accumulate(xm: Any, ym: Any, sums: list[Any]) -> tuple[list[Any], Any]:
        with tf.GradientTape() as tape:
            value = loss(ym, model(xm, training=True)) / micro_batches
        grads = tape.gradient(value, variables)
        return [s + g for s, g in zip(sums, grads, strict=True)], value

    @tf.function(jit_compile=True)
    def apply(grads: list[Any]) -> None:
        optimizer.apply(grads, variables)

    def step() -> float:
        sums = [tf.zeros_like(v) for v in variables]
        total = 0.0
        for m in range(micro_batches):
            sums, value = accumulate(xs[m], ys[m], sums)
            total += value
        apply(sums)
        return float(total)

    return step


def _name(config: Any) -> str:
    """The candidate that runs a planned 2×1 configuration."""
    deferred = "_deferred" if config.defer_weight_gradients else ""
    return f"pipeline_2x1_M{config.micro_batches}{deferred}"


def planned_micro_batches(counts: list[int]) -> tuple[str, dict[str, float]]:
    """What the planner predicts for 2 stages × 1 replica (GPipe, ``remat="never"``) at each
    micro-batch count in ``counts``, with and without deferred weight gradients, from this
    model's layers profiled at the micro-batch sizes those counts make, on this host's
    cores: the candidate it picks and the predicted milliseconds per step of each."""
    import os

    import keras

    from hybrid import planning as planner

    result = planner.plan(
        common.dense_stack(FLAGS.width, FLAGS.depth),
        devices=2,
        global_batch=FLAGS.batch,
        hardware=planner.Hardware(host_cores=os.cpu_count() or 1),
        input_shape=(FLAGS.width,),
        loss=_loss(),
        optimizer=lambda: keras.optimizers.SGD(LEARNING_RATE),
        optimizer_slots=0,
        schedules=["gpipe"],
        remats=["never"],
        micro_batches=counts,
        stages=[2],
    )
    predicted = {_name(p.config): 1e3 * p.step_time for p in result.ranked}
    return _name(result.best.config), predicted


def candidates(counts: list[int]) -> tuple[dict[str, Callable[[], Any]], Any]:
    """Every candidate's step, by name, and the 2×1 ``micro_batches="auto"`` pipeline (its
    choice is read after the timing)."""
    import keras
    import tensorflow as tf

    import hybrid

    x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    M = FLAGS.micro_batches

    def pipeline(stages: int, replicas: int, micro_batches: int | str, defer: bool = False) -> Any:
        return common.dense_pipeline(
            FLAGS.width,
            FLAGS.depth,
            hybrid.DeviceMesh.create(stages, replicas),
            keras.optimizers.SGD(LEARNING_RATE),
            micro_batches=micro_batches,
            remat="never",
            defer_weight_gradients=defer,
        )

    auto = pipeline(2, 1, "auto", defer=True)  # chooses M at its first step
    pipes = {f"pipeline_1x1_M{M}": pipeline(1, 1, M)}
    pipes[f"pipeline_1x1_M{M}_deferred"] = pipeline(1, 1, M, defer=True)
    pipes.update({f"pipeline_2x1_M{m}": pipeline(2, 1, m) for m in counts})
    deferred = [m for m in counts if m > 1]
    pipes.update({f"pipeline_2x1_M{m}_deferred": pipeline(2, 1, m, True) for m in deferred})
    pipes.update({"pipeline_2x1_auto": auto, "pipeline_1x2_M1": pipeline(1, 2, 1)})
    steps = {
        "keras_1_device": keras_step(x, y),
        f"handwritten_M{M}": handwritten_step(x, y, M),
        **{name: common.train_step(pipe, x, y) for name, pipe in pipes.items()},
        "independent_2_devices": common.independent_step(
            _model, _loss, lambda: keras.optimizers.SGD(LEARNING_RATE), x, y, devices
        ),
        "mirrored_2_devices": mirrored_step(x, y, devices),
    }
    return steps, auto


def ratios(ms: dict[str, float], chosen: str) -> dict[str, float]:
    """The issue-16 ratios (see the module docstring), printed with their targets."""
    M = FLAGS.micro_batches
    best_2x1 = min(
        v for k, v in ms.items() if k.startswith("pipeline_2x1_M") and "deferred" not in k
    )
    best_deferred = min(v for k, v in ms.items() if k.endswith("_deferred") and "2x1" in k)
    values = {
        "planned_vs_plain": ms["keras_1_device"] / ms[chosen],
        "auto_vs_plain": ms["keras_1_device"] / ms["pipeline_2x1_auto"],
        "engine_overhead": ms[f"pipeline_1x1_M{M}"] / ms[f"handwritten_M{M}"],
        "pipelining_speedup": ms[f"pipeline_1x1_M{M}"] / ms[f"pipeline_2x1_M{M}"],
        "pipelined_vs_plain": ms["keras_1_device"] / best_2x1,
        "deferred_engine_overhead": ms[f"pipeline_1x1_M{M}_deferred"] / ms[f"handwritten_M{M}"],
        "deferred_pipelining_speedup": ms[f"pipeline_1x1_M{M}_deferred"]
        / ms[f"pipeline_2x1_M{M}_deferred"],
        "deferred_vs_plain": ms["keras_1_device"] / best_deferred,
        "data_parallel_vs_plain": ms["keras_1_device"] / ms["pipeline_1x2_M1"],
        "data_parallel_vs_mirrored": ms["mirrored_2_devices"] / ms["pipeline_1x2_M1"],
        "two_device_ceiling": ms["keras_1_device"] / ms["independent_2_devices"],
    }
    # how much of what two devices can do on this host each 2-device engine step reaches
    values["data_parallel_of_ceiling"] = ms["independent_2_devices"] / ms["pipeline_1x2_M1"]
    values["pipelining_of_ceiling"] = values["pipelining_speedup"] / values["two_device_ceiling"]
    targets = {
        "planned_vs_plain": ">= 1.2",
        "auto_vs_plain": ">= 1.2 (micro_batches='auto': M timed at the first step)",
        "engine_overhead": "<= 1.05",
        "pipelining_speedup": f">= 1.65 (ideal {2 * M / (M + 1):.2f})",
        "pipelined_vs_plain": ">= 1.2",
        "deferred_engine_overhead": "<= 1.05 (weight gradients deferred: below 1 wins)",
        "deferred_pipelining_speedup": f">= 1.65 (ideal {2 * M / (M + 1):.2f})",
        "deferred_vs_plain": ">= 1.2 (the best 2x1 with deferred weight gradients)",
        "data_parallel_vs_plain": ">= 1.7",
        "data_parallel_vs_mirrored": ">= 1.2",
        "two_device_ceiling": "what this host allows any 2-device step (no target)",
        "data_parallel_of_ceiling": "independent_2_devices / pipeline_1x2_M1 (1 = the ceiling)",
        "pipelining_of_ceiling": f"speedup / ceiling (at most {M / (M + 1):.2f}: the bubble)",
    }
    for name, value in values.items():
        print(f"  {name:28s} {value:6.3f}  (target {targets[name]})")
    return values


def main(argv: list[str]) -> None:
    del argv
    env = common.start("engine_overhead", devices=2)
    counts = sorted({1, 2, 4, FLAGS.micro_batches})
    chosen, predicted = planned_micro_batches(counts)
    steps, auto = candidates(counts)
    samples, ms = common.time_steps(steps, warmup=3)
    common.print_ms(ms, width=22)
    print(f"  the planner's 2x1 choice: {chosen}")
    errors = {}
    for name, value in predicted.items():
        measured = ms[name]
        errors[name] = value / measured - 1
        print(
            f"    {name:26s} predicted {value:7.2f} ms, measured {measured:7.2f} "
            f"({errors[name]:+.0%})"
        )
    timed = ", ".join(f"M={m} {1e3 * t:.1f}" for m, t in auto.micro_batch_seconds.items())
    print(f"  micro_batches='auto' on 2x1: M = {auto.micro_batches} (gradient step ms: {timed})")
    values = ratios(ms, chosen)
    common.write_timed(
        "engine_overhead",
        env,
        common.flag_values(*common.TIMING_FLAGS, *common.MODEL_FLAGS, "micro_batches"),
        samples,
        ms,
        "ms per step: the pipeline vs plain Keras, a hand loop, MirroredStrategy",
        ratios=values,
        planner={"chosen": chosen, "predicted_ms": predicted, "error": errors},
        auto={
            "chosen_micro_batches": auto.micro_batches,
            "gradient_step_ms": {m: 1e3 * t for m, t in auto.micro_batch_seconds.items()},
        },
    )
    print("SUMMARY engine_overhead " + " ".join(f"{k}={v:.3f}" for k, v in values.items()))


if __name__ == "__main__":
    app.run(main)
