"""Per-host input against the client-fed path: bytes the client sends per step, step time.

For each task count (2 and 4 loopback workers, one CPU device each), a client process
connects, lays a 2 × (tasks/2) mesh with ``--mesh_order=pipelines_in_host`` (each replica's
two stages on two tasks, so tasks/2 hosts read input) and trains the same model by
``fit`` in alternating rounds of two kinds:

    client_fed   a tf.data dataset of global batches on the client; the feed sends every
                 replica its shard (inputs to the first stage's task, labels to the last's)
    per_host     ``pipe.distribute_datasets_from_function``: each input host makes its
                 replicas' batches on its own CPU (stateless random examples, generated
                 there); the client sends no example bytes

The client's bytes are every byte its TCP sockets sent during the round (``ss -tin``:
the kernel's ``bytes_sent`` per socket, the client's sockets picked by pid), per step;
this counts the runtime's control messages too, so the per-host figure is the cost of
driving the step, the client-fed one adds the examples (the batch's bytes are printed
beside). Steps: the median round's wall time per step.

    python benchmarks/per_host_input.py [--tasks=2,4] [--rounds=5] [--steps=20]
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

import common

flags.DEFINE_list("tasks", ["2", "4"], "Worker counts to measure (even: 2 stages).")
flags.DEFINE_integer("rounds", 5, "Alternating rounds of each kind.")
flags.DEFINE_integer("steps", 20, "Steps per round.")
flags.DEFINE_integer("width", 1024, "Input features (float32) and hidden width.")
flags.DEFINE_integer("batch", 256, "Global batch.")
flags.DEFINE_integer("micro_batches", 2, "Micro-batches per replica.")
flags.DEFINE_string("client_of", None, "Internal: run as the client of this cluster spec.")
FLAGS = flags.FLAGS


def run(spec: str) -> None:
    """The client: both kinds of input on one mesh, alternating; prints a RESULT line."""
    import keras
    import tensorflow as tf

    from hybrid.platforms import cluster

    job = cluster.connect(spec, timeout_s=120)
    tasks = len(job.workers)
    mesh = cluster.mesh(job, 2, tasks // 2, order="pipelines_in_host")
    pipe = common.dense_pipeline(
        FLAGS.width, 2, mesh, keras.optimizers.SGD(1e-3), micro_batches=FLAGS.micro_batches
    )
    replicas, width = tasks // 2, FLAGS.width
    rows = FLAGS.batch // replicas

    def examples(step: tf.Tensor, rows: int, seed: int) -> tuple[tf.Tensor, tf.Tensor]:
        x = tf.random.stateless_normal([rows, width], tf.stack([step, seed]))
        y = tf.random.stateless_uniform([rows], tf.stack([step, seed]), 0, 10, tf.int32)
        return x, y

    client_fed = tf.data.Dataset.range(1 << 40).map(lambda s: examples(s, FLAGS.batch, 0))
    per_host = pipe.distribute_datasets_from_function(
        lambda c: tf.data.Dataset.range(1 << 40).map(
            lambda s: examples(s, rows, c.input_pipeline_id)
        )
    )
    kinds = {"client_fed": (pipe, client_fed), "per_host": (pipe, per_host)}
    with job.guard():
        seconds, sent = common.time_fits(kinds, FLAGS.rounds, FLAGS.steps)
    result = {
        "tasks": tasks,
        "mesh": [list(row) for row in mesh.devices],
        "input_hosts": len(per_host.hosts),
        "batch_bytes": FLAGS.batch * (width * 4 + 4),
        **{f"{k}_ms": 1e3 * v for k, v in seconds.items()},
        **{f"{k}_client_bytes_per_step": v for k, v in sent.items()},
    }
    print("RESULT " + json.dumps(result), flush=True)


def main(argv: list[str]) -> int:
    del argv
    if FLAGS.client_of:
        run(FLAGS.client_of)
        return 0
    from hybrid.platforms import local_workers

    env = common.environment()
    common.print_header("per_host_input", env)
    rows = []
    for tasks in map(int, FLAGS.tasks):
        with local_workers.start(tasks) as workers:
            forwarded = common.flag_args("rounds", "steps", "width", "batch", "micro_batches")
            (result,) = common.run_child(
                [os.path.abspath(__file__), f"--client_of={json.dumps(workers.spec)}", *forwarded]
            )
        rows.append(result)
        print(
            f"  {tasks} tasks, {result['input_hosts']} input hosts: client-fed "
            f"{result['client_fed_ms']:.1f} ms/step, "
            f"{result['client_fed_client_bytes_per_step'] / 1e3:.1f} kB sent/step "
            f"(batch {result['batch_bytes'] / 1e3:.1f} kB); per-host {result['per_host_ms']:.1f} "
            f"ms/step, {result['per_host_client_bytes_per_step'] / 1e3:.1f} kB sent/step",
            flush=True,
        )
    common.write_json("per_host_input", {"environment": env, "flags": common.flag_values(
        "rounds", "steps", "width", "batch", "micro_batches"), "rows": rows})  # fmt: skip
    common.write_csv("per_host_input", rows)
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
