"""Multi-host step time: a 2×2 mesh over 2 worker processes (loopback gRPC) vs one process.

Starts 2 workers (``hybrid/launch/worker.py``, 2 simulated CPUs each) on free 127.0.0.1
ports and a client process that simulates 4 CPUs of its own, connects to the workers, and
times side by side, in alternation, the same model (4 × Dense(512) + a head, batch 256,
M = 4, SGD) on three 2×2 meshes:

    local                    the 4 devices of this process (no RPC at all)
    cluster                  replica groups inside a task, the pipeline crosses tasks (default)
    cluster_pipelines        each pipeline inside a task, the gradient all-reduce crosses tasks
    cluster_bfloat16         cluster, the stage boundary's activations and gradients sent as
                             bfloat16 (``boundary_dtype``; inexact)
    cluster_int8             the same as int8 with one scale per tensor

``ratio`` = cluster / local (the cost of the gRPC runtime with the default order),
``ratio_pipelines`` = cluster_pipelines / local, ``compressed`` = each compressed run's step
time over cluster's, with the bytes that cross the stage boundary per step. On one host the
gRPC hops are loopback copies; across hosts the network adds to them.

    python benchmarks/multihost.py [--rounds=12]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from absl import app, flags

from hybrid.platforms.local_workers import free_ports

import common

common.define_timing_flags(rounds=12, steps_per_round=4)
common.define_model_flags(depth=4, batch=256, width=512)
flags.DEFINE_integer("micro_batches", 4, "Micro-batches M per replica.")
flags.DEFINE_integer("connect_timeout_s", 120, "Deadline for the workers to answer.")
flags.DEFINE_string("client_of", None, "Internal: run as the client of this cluster spec.")
FLAGS = flags.FLAGS


def _start_workers(spec: str, logs: str) -> list[subprocess.Popen]:
    workers = []
    for i in range(2):
        with open(os.path.join(logs, f"worker{i}.log"), "w") as log:
            workers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "hybrid.launch.worker",
                        f"--cluster={spec}",
                        f"--task_index={i}",
                        "--simulated_devices=2",
                        "--lifetime_s=1800",
                    ],
                    cwd=common.ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return workers


def _stop(workers: list[subprocess.Popen]) -> None:
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    for w in workers:
        try:
            w.wait(15)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


def main(argv: list[str]) -> int:
    """Starts the workers, runs the client in its own process, stops the workers.

    The client is a child process so that it ends (and lets go of the workers) before the
    workers are stopped.
    """
    del argv
    if FLAGS.client_of:
        run(FLAGS.client_of)
        return 0
    spec = json.dumps({"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]})
    logs = tempfile.mkdtemp(prefix="hybrid-multihost-")
    workers = _start_workers(spec, logs)
    forwarded = common.flag_args(
        *common.TIMING_FLAGS, *common.MODEL_FLAGS, "micro_batches", "connect_timeout_s"
    )
    try:
        client = subprocess.run(
            [sys.executable, os.path.abspath(__file__), f"--client_of={spec}", *forwarded],
            cwd=common.ROOT,
            timeout=1500,
        )
    finally:
        _stop(workers)
    if client.returncode:
        print(f"multihost: the client failed; worker logs in {logs}", file=sys.stderr)
    return client.returncode


def connect(spec: str) -> tuple[Any, dict[str, Any]]:
    """Simulates this process's 4 CPUs, connects to the workers, prints the environment."""
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # not the session config the connect logs
    import hybrid

    hybrid.simulate_cpu_devices(4)
    from hybrid.platforms import cluster

    job = cluster.connect(spec, timeout_s=FLAGS.connect_timeout_s)
    env = common.environment()
    env["workers"] = [str(t) for t in job.workers]
    common.print_header("multihost", env)
    return job, env


def meshes(job: Any) -> dict[str, Any]:
    """The three 2×2 meshes: this process's devices, and the cluster's in either order."""
    import hybrid
    from hybrid.platforms import cluster

    # After connecting, the device list holds every task's devices: take this process's.
    local = [d for d in hybrid.local_devices("CPU") if "/job:worker/" not in d]
    out = {
        "local": hybrid.DeviceMesh.from_devices(local, 2, 2),
        "cluster": cluster.mesh(job, 2, 2),
        "cluster_pipelines": cluster.mesh(job, 2, 2, order="pipelines_in_host"),
    }
    for name, mesh in out.items():
        print(f"  {name:18s} {[list(row) for row in mesh.devices]}")
    return out


COMPRESSED = {"cluster_bfloat16": "bfloat16", "cluster_int8": "int8"}
BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


def candidates(meshes: dict[str, Any], x: Any, y: Any) -> dict[str, Callable[[], Any]]:
    """One training step of the same model on each mesh (and compressed, on cluster's)."""
    import keras

    runs = {name: (mesh, None) for name, mesh in meshes.items()}
    runs.update({name: (meshes["cluster"], dtype) for name, dtype in COMPRESSED.items()})
    steps = {}
    for name, (mesh, dtype) in runs.items():
        pipe = common.dense_pipeline(
            FLAGS.width,
            FLAGS.depth,
            mesh,
            keras.optimizers.SGD(1e-3),
            micro_batches=FLAGS.micro_batches,
            boundary_dtype=dtype,
        )
        steps[name] = common.train_step(pipe, x, y)
    return steps


def boundary_bytes(dtype: str) -> int:
    """Bytes crossing the one stage boundary per step: every micro-batch's [rows, width]
    activation forward and its gradient back, on each of the 2 replicas."""
    return 2 * FLAGS.batch * FLAGS.width * BYTES[dtype]


def ratios(ms: dict[str, float]) -> tuple[float, float]:
    """The step time on each cluster mesh over the local one (printed): the default device
    order's, then pipelines_in_host's."""
    ratio = {}
    for name in ("cluster", "cluster_pipelines"):
        ratio[name] = ms[name] / ms["local"]
        print(f"  {f'ratio {name} / local:':34s}{ratio[name]:.3f}")
    return ratio["cluster"], ratio["cluster_pipelines"]


def run(spec: str) -> None:
    job, env = connect(spec)
    x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)
    by_name = meshes(job)
    with job.guard():
        samples, ms = common.time_steps(candidates(by_name, x, y), warmup=2)
    common.print_ms(ms, width=18)
    ratio, ratio_pipelines = ratios(ms)
    compressed = {
        dtype: {
            "ratio_vs_float32": ms[name] / ms["cluster"],
            "boundary_bytes_per_step": boundary_bytes(dtype),
        }
        for name, dtype in COMPRESSED.items()
    }
    for dtype, values in compressed.items():
        print(
            f"  {dtype}: {values['ratio_vs_float32']:.3f}x the float32 step, "
            f"{values['boundary_bytes_per_step']} boundary bytes/step "
            f"(float32: {boundary_bytes('float32')})"
        )
    common.write_timed(
        "multihost",
        env,
        common.flag_values(*common.TIMING_FLAGS, *common.MODEL_FLAGS, "micro_batches"),
        samples,
        ms,
        "2×2 mesh: one process vs 2 gRPC tasks",
        meshes={name: [list(row) for row in m.devices] for name, m in by_name.items()},
        ratio=ratio,
        ratio_pipelines=ratio_pipelines,
        compressed=compressed,
    )
    print(
        f"SUMMARY multihost local_ms={ms['local']:.2f} cluster_ms={ms['cluster']:.2f} "
        f"cluster_pipelines_ms={ms['cluster_pipelines']:.2f} ratio={ratio:.3f} "
        f"ratio_pipelines={ratio_pipelines:.3f} "
        f"bfloat16_ratio={compressed['bfloat16']['ratio_vs_float32']:.3f} "
        f"int8_ratio={compressed['int8']['ratio_vs_float32']:.3f}"
    )


if __name__ == "__main__":
    app.run(main)
