"""Per-stage peak memory, measured in one process per stage and predicted by the planner.

A 2-stage × 1-replica pipeline of ``depth`` × Dense(width) + Dense(10), trained with Adam, runs
over TensorFlow's multi-host runtime on loopback: each stage's device is the one CPU device of
its own worker process (``benchmarks/memory_worker.py``), and a client process builds the
pipeline and runs two steps. Each worker reads its own allocator (BFC, so it keeps statistics:
``tf.config.experimental.get_memory_info("CPU:0")``) and reports, relative to the bytes held
once its server had started:

    measured peak      = allocator peak − baseline          (what the stage needed at most)
    measured resident  = allocator current at the end − baseline
                         (weights + optimizer slots + what the engine keeps between steps)
    measured transient = peak − resident (gradient accumulators, activations in flight,
                         received micro-batches, XLA temporaries)

Beside each, the cost model's prediction for that stage (``hybrid.planning.cost_model.evaluate``
on a profile measured on one device at the micro-batch size) and its terms: parameters,
gradients, optimizer state (Adam: 2 × parameters), activations. Every schedule × remat mode of
the grid runs in its own three processes.

    python benchmarks/memory.py                         # gpipe, 1f1b × never, always
    python benchmarks/memory.py --schedules=gpipe,1f1b --remats=never,except_last,always
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from absl import app, flags

import common

common.define_model_flags(depth=4, batch=512, width=256)
flags.DEFINE_integer("micro_batches", 4, "Micro-batches M.")
flags.DEFINE_list("schedules", ["gpipe", "1f1b"], "Schedules.")
flags.DEFINE_list("remats", ["never", "always"], "Remat modes.")
flags.DEFINE_bool("jit_compile", True, "XLA stage programs.")
flags.DEFINE_string("client", None, "Internal: 'schedule,remat,CLUSTER_JSON': run the client.")
FLAGS = flags.FLAGS

STAGES = 2
STEPS = 2
MB = 1024 * 1024
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_worker.py")
CHILD_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}


def build_pipeline(mesh: Any, schedule: str, remat: str) -> Any:
    """The benchmark's pipeline (the one place that calls the Pipeline API)."""
    import keras

    return common.dense_pipeline(
        FLAGS.width,
        FLAGS.depth,
        mesh,
        keras.optimizers.Adam(1e-4),
        micro_batches=FLAGS.micro_batches,
        schedule=schedule,
        remat=remat,
        jit_compile=FLAGS.jit_compile,
    )


def run_client(schedule: str, remat: str, spec: str) -> None:
    """In this process: connect to the workers, build (then print ``BUILT`` and wait for a
    line on stdin), train ``STEPS`` steps (then print ``STEPPED`` and wait again)."""
    import tensorflow as tf

    from hybrid.platforms import cluster

    job = cluster.connect(spec, timeout_s=60.0)
    mesh = cluster.mesh(job, stages=STAGES, replicas=1)
    # Connecting makes the first worker the default device: keep the Keras template model and
    # the batch in this process, so a worker holds only what its stage's programs put there.
    with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
        pipe = build_pipeline(mesh, schedule, remat)
        x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)
    print("DEVICES " + json.dumps([list(row) for row in mesh.devices]), flush=True)
    print("BUILT", flush=True)
    sys.stdin.readline()
    with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
        for _ in range(STEPS):
            pipe.train_step(x, y)
    print("STEPPED", flush=True)
    sys.stdin.readline()


def _line(process: subprocess.Popen, prefix: str) -> str:
    """The rest of the next line of ``process``'s stdout that starts with ``prefix``."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise RuntimeError(f"{process.args[1]} ended (exit {process.wait()}) before {prefix!r}")


def _snapshot(workers: list[subprocess.Popen]) -> list[dict[str, int]]:
    """Every worker's allocator figures, now."""
    for w in workers:
        assert w.stdin is not None
        w.stdin.write("\n")
        w.stdin.flush()
    return [json.loads(_line(w, "MEMORY ")) for w in workers]


def _go(client: subprocess.Popen) -> None:
    assert client.stdin is not None
    client.stdin.write("\n")
    client.stdin.flush()


def measure(schedule: str, remat: str) -> list[dict[str, float]]:
    """Per stage, in MiB of its worker process's allocator beyond the bytes held when its
    server started: ``built`` (after building), ``resident`` (after ``STEPS`` steps),
    ``peak`` (the high-water mark), ``transient`` (peak − resident)."""
    spec = json.dumps({"worker": [f"127.0.0.1:{p}" for p in common.free_ports(STAGES)]})
    env = {**os.environ, **CHILD_ENV}
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True, "env": env}
    workers = [
        subprocess.Popen(
            [sys.executable, WORKER, f"--cluster={spec}", f"--task_index={i}"], **pipes
        )
        for i in range(STAGES)
    ]
    client = None
    try:
        for w in workers:
            _line(w, "READY")
        client = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), f"--client={schedule},{remat},{spec}"]
            + common.flag_args(*common.MODEL_FLAGS, "micro_batches", "jit_compile"),
            **pipes,
        )
        devices = json.loads(_line(client, "DEVICES "))
        if any(f"task:{s}/" not in devices[s][0] for s in range(STAGES)):
            raise RuntimeError(f"stage s should be on task s: {devices}")
        _line(client, "BUILT")
        built = _snapshot(workers)
        _go(client)
        _line(client, "STEPPED")
        after = _snapshot(workers)
        _go(client)
        if client.wait(60):
            raise RuntimeError(f"the client failed (exit {client.returncode})")
    finally:
        for p in workers + ([client] if client else []):
            if p.poll() is None:
                p.kill()
                p.wait()
    return [
        {
            "built": (b["current"] - b["baseline"]) / MB,
            "peak": (a["peak"] - a["baseline"]) / MB,
            "resident": (a["current"] - a["baseline"]) / MB,
            "transient": (a["peak"] - a["current"]) / MB,
        }
        for b, a in zip(built, after, strict=True)
    ]


def predict(schedules: list[str], remats: list[str]) -> dict[tuple[str, str], list[dict]]:
    """Per (schedule, remat): the cost model's per-stage terms, in MiB."""
    import keras

    from hybrid.core.config import RunConfig
    from hybrid.planning import cost_model, costs

    b = FLAGS.batch // FLAGS.micro_batches
    profile = costs.profile_model(
        common.dense_stack(FLAGS.width, FLAGS.depth),
        (FLAGS.width,),
        "float32",
        [b],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        target_shape=(),
        repeats=1,
    )
    out = {}
    for s in schedules:
        for r in remats:
            config = RunConfig(STAGES, 1, FLAGS.micro_batches, s, r)
            p = cost_model.evaluate(profile, config, FLAGS.batch, optimizer_slots=2)
            out[(s, r)] = [{k: v / MB for k, v in terms.items()} for terms in p.memory_terms]
    return out


def write_results(env: dict[str, Any], rows: list[dict[str, Any]], worst: float) -> None:
    config = common.flag_values(
        *common.MODEL_FLAGS, "micro_batches", "schedules", "remats", "jit_compile"
    )
    path = common.write_json(
        "memory", {"environment": env, "config": config, "rows": rows, "worst_error": worst}
    )
    csv_path = common.write_csv("memory", rows)
    _chart(rows)
    print(f"  wrote {path}, {csv_path} and memory.png")


def _chart(rows: list[dict[str, Any]]) -> None:
    """One bar group per (schedule, remat, stage): predicted beside measured peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['schedule']}\n{r['remat']}\nstage {r['stage']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    ax.bar([x - 0.2 for x in xs], [r["measured_peak_mib"] for r in rows], 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [r["predicted_peak_mib"] for r in rows], 0.4, label="predicted")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("peak MiB per stage")
    ax.set_title(f"{STAGES} stages, M={FLAGS.micro_batches}, batch {FLAGS.batch}, Adam")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(common.RESULTS, "memory.png"))


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.client:
        schedule, remat, spec = FLAGS.client.split(",", 2)
        run_client(schedule, remat, spec)
        return
    env = common.start("memory", devices=1)
    predicted = predict(FLAGS.schedules, FLAGS.remats)
    rows = []
    for s in FLAGS.schedules:
        for r in FLAGS.remats:
            for stage, (m, p) in enumerate(zip(measure(s, r), predicted[(s, r)], strict=True)):
                row = {
                    "schedule": s,
                    "remat": r,
                    "stage": stage,
                    "measured_peak_mib": m["peak"],
                    "predicted_peak_mib": p["total"],
                    "error": p["total"] / m["peak"] - 1,
                    "measured_built_mib": m["built"],
                    "measured_resident_mib": m["resident"],
                    "measured_transient_mib": m["transient"],
                    **{f"predicted_{k}_mib": v for k, v in p.items() if k != "total"},
                }
                rows.append(row)
                print(
                    f"  {s:6s} {r:12s} stage {stage}: measured {m['peak']:7.2f} MiB "
                    f"(built {m['built']:5.2f}, resident {m['resident']:5.2f}, "
                    f"transient {m['transient']:5.2f})  predicted {p['total']:7.2f} "
                    f"{ {k: round(v, 2) for k, v in p.items() if k != 'total'} } "
                    f"error {row['error']:+.1%}",
                    flush=True,
                )
    worst = max(abs(row["error"]) for row in rows)
    write_results(env, rows, worst)
    print(f"SUMMARY memory configs={len(rows) // STAGES} stages={STAGES} worst_error={worst:.3f}")


if __name__ == "__main__":
    app.run(main)
