"""TPU smoke test: what a user with a Cloud TPU slice runs first.

For each mesh shape S × R (``--meshes``, default every shape the slice can hold), the
pipeline's step as one TPU program per replica (``Pipeline(strategy=)`` under the layout's
``TPUStrategy``) trains --steps steps of a --depth × Dense(--width) MLP, and the same steps
run in plain Keras on the host CPU from the same initial weights (the one-device
reference). Reported per mesh:

    loss_error     the largest relative difference of a step's loss from the reference
    weight_error   the largest difference of a final weight, relative to the largest weight
    ok             both within --tolerance (TPUs multiply float32 in bfloat16 passes by
                   default, so the default tolerance is loose; on CPUs use 1e-4)
    step_ms        the median time of --timed_steps further steps; examples/s from it

Written to ``benchmarks/results/tpu_smoke.json`` and ``.png`` (step time per mesh); the
last line is ``SUMMARY tpu_smoke ...``. On a slice::

    python benchmarks/tpu_smoke.py --platform=tpu --tpu=NODE --tpu_zone=ZONE \\
        --gcp_project=PROJECT [--meshes=2x4,4x2]

Without a TPU, ``--platform=cpu`` runs the same checks on simulated CPU devices under
``MirroredStrategy`` (one device per replica, every stage of a replica on it): a dry run of
the script and of the replicated step, not a measurement of a TPU. What only a slice shows:
that the step compiles for the chips, that its numbers match, its speed per mesh shape, and
(in a profile of the timed steps) whether the stages' programs overlap on their cores.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from absl import app, flags

import common

common.define_model_flags(depth=8, batch=256, width=512)
flags.DEFINE_enum("platform", "cpu", ["cpu", "tpu"], "Where the replicated step runs.")
flags.DEFINE_string("tpu", None, "--platform=tpu: the Cloud TPU node's name (or 'local').")
flags.DEFINE_string("tpu_zone", None, "--platform=tpu: the node's zone.")
flags.DEFINE_string("gcp_project", None, "--platform=tpu: the node's GCP project.")
flags.DEFINE_list("meshes", None, "Mesh shapes SxR; default: every shape the slice holds "
                  "(--platform=cpu: 2x2 and 4x2).")  # fmt: skip
flags.DEFINE_integer("micro_batches", 4, "Micro-batches per replica.")
flags.DEFINE_string("schedule", "1f1b", "The pipeline schedule.")
flags.DEFINE_integer("steps", 3, "Steps checked against the one-device reference.")
flags.DEFINE_integer("timed_steps", 5, "Further steps timed.")
flags.DEFINE_float("tolerance", None, "Largest relative error accepted (default: 2e-2 on "
                   "TPU, 1e-4 on CPU).")  # fmt: skip
FLAGS = flags.FLAGS


def _shapes(spec: list[str] | None, feasible: list[tuple[int, int]]) -> list[tuple[int, int]]:
    if not spec:
        return feasible
    shapes = []
    for item in spec:
        stages, _, replicas = item.lower().partition("x")
        if not (stages.isdigit() and replicas.isdigit()):
            raise app.UsageError(f"--meshes: {item!r} is not SxR (e.g. 2x4)")
        shapes.append((int(stages), int(replicas)))
    return shapes


def tpu_strategies() -> tuple[list[tuple[int, int]], Any]:
    """The slice's mesh shapes and, per shape, (TPUStrategy, mesh) on its layout."""
    from hybrid.platforms import cloud_tpu, tpu_mesh

    if not (FLAGS.tpu and FLAGS.tpu_zone and FLAGS.gcp_project) and FLAGS.tpu != "local":
        raise app.UsageError("--platform=tpu needs --tpu, --tpu_zone and --gcp_project")
    system = cloud_tpu.resolve(FLAGS.tpu, FLAGS.tpu_zone, FLAGS.gcp_project)
    cores = len(system.devices)
    feasible = [(s, cores // s) for s in range(2, cores + 1) if cores % s == 0]
    shapes = _shapes(FLAGS.meshes, feasible)

    def make(stages: int, replicas: int) -> tuple[Any, Any]:
        tpu = tpu_mesh.layout(system.topology, stages, replicas)
        return tpu_mesh.tpu_strategy(system.resolver, tpu), tpu.mesh

    return shapes, make


def cpu_strategies() -> tuple[list[tuple[int, int]], Any]:
    """The dry run's mesh shapes and, per shape, (MirroredStrategy over R CPUs, mesh)."""
    import hybrid

    shapes = _shapes(FLAGS.meshes, [(2, 2), (4, 2)])
    hybrid.simulate_cpu_devices(max(s * r for s, r in shapes))
    import tensorflow as tf

    made: dict[int, Any] = {}  # one strategy per replica count (see tests/reference.py)

    def make(stages: int, replicas: int) -> tuple[Any, Any]:
        if replicas not in made:
            made[replicas] = tf.distribute.MirroredStrategy([f"/cpu:{r}" for r in range(replicas)])
        return made[replicas], hybrid.DeviceMesh.create(stages, replicas)

    return shapes, make


def check(stages: int, replicas: int, strategy: Any, mesh: Any) -> dict[str, Any]:
    """Trains the mesh and the reference on the same batches; errors and step time."""
    import keras

    import hybrid

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = keras.Sequential(
        [keras.Input((FLAGS.width,)), *common.dense_stack(FLAGS.width, FLAGS.depth)]
    )
    reference.compile(optimizer=keras.optimizers.SGD(1e-2, momentum=0.9), loss=loss)
    pipe = hybrid.Pipeline(
        common.dense_stack(FLAGS.width, FLAGS.depth, seed=1),
        mesh,
        strategy=strategy,
        micro_batches=FLAGS.micro_batches,
        schedule=FLAGS.schedule,
    )
    pipe.compile(optimizer=keras.optimizers.SGD(1e-2, momentum=0.9), loss=loss)
    pipe.build((None, FLAGS.width))
    pipe.set_weights(reference.get_weights())
    loss_error = 0.0
    for step in range(FLAGS.steps):
        x, y = (np.asarray(t) for t in common.synthetic_batch(FLAGS.batch, FLAGS.width, seed=step))
        want = float(reference.train_on_batch(x, y))
        got = pipe.train_step(x, y)["loss"]
        loss_error = max(loss_error, abs(got - want) / max(abs(want), 1e-12))
    scale = max(float(np.max(np.abs(w))) for w in reference.get_weights())
    weight_error = max(
        float(np.max(np.abs(a - b))) / scale
        for a, b in zip(pipe.get_weights(), reference.get_weights(), strict=True)
    )
    seconds = []
    for _ in range(FLAGS.timed_steps):
        start = time.perf_counter()
        pipe.train_step(x, y)
        seconds.append(time.perf_counter() - start)
    step_ms = 1e3 * common.median(seconds)
    tolerance = FLAGS.tolerance or (2e-2 if FLAGS.platform == "tpu" else 1e-4)
    return {
        "stages": stages,
        "replicas": replicas,
        "loss_error": loss_error,
        "weight_error": weight_error,
        "ok": loss_error <= tolerance and weight_error <= tolerance,
        "tolerance": tolerance,
        "step_ms": step_ms,
        "examples_per_s": FLAGS.batch / (step_ms / 1e3),
    }


def main(argv: list[str]) -> None:
    del argv
    shapes, make = tpu_strategies() if FLAGS.platform == "tpu" else cpu_strategies()
    env = common.environment()
    common.print_header("tpu_smoke", env)
    rows = []
    for stages, replicas in shapes:
        row = check(stages, replicas, *make(stages, replicas))
        rows.append(row)
        print(
            f"  {stages}x{replicas}: {'ok' if row['ok'] else 'MISMATCH'} "
            f"loss_error={row['loss_error']:.2e} weight_error={row['weight_error']:.2e} "
            f"step {row['step_ms']:.1f} ms ({row['examples_per_s']:.0f} examples/s)"
        )
    config = common.flag_values(
        *common.MODEL_FLAGS, "platform", "micro_batches", "schedule", "steps", "timed_steps"
    )
    common.write_json("tpu_smoke", {"environment": env, "config": config, "meshes": rows})
    common.bar_chart(
        "tpu_smoke",
        {f"{r['stages']}x{r['replicas']}": r["step_ms"] for r in rows},
        "ms per step",
        f"replicated step per mesh ({FLAGS.platform})",
    )
    fine = sum(r["ok"] for r in rows)
    print(f"SUMMARY tpu_smoke platform={FLAGS.platform} meshes={len(rows)} ok={fine}")


if __name__ == "__main__":
    app.run(main)
