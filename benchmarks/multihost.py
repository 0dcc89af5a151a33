"""Multi-host step time: a 2×2 mesh over 2 worker processes (loopback gRPC) vs one process.

Starts 2 workers (``launch/worker.py``, 2 simulated CPUs each) on free 127.0.0.1 ports and
a client process that simulates 4 CPUs of its own, connects to the workers, and times side
by side, in alternation, the same model (4 × Dense(512) + a head, batch 256, M = 4, SGD) on
three 2×2 meshes:

    local                    the 4 devices of this process (no RPC at all)
    cluster                  replica groups inside a task, the pipeline crosses tasks (default)
    cluster_pipelines        each pipeline inside a task, the gradient all-reduce crosses tasks

``ratio`` = cluster / local (the cost of the gRPC runtime with the default order),
``ratio_pipelines`` = cluster_pipelines / local. On one host the gRPC hops are loopback
copies; across hosts the network adds to them.

    python benchmarks/multihost.py [--rounds=12]
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

import common  # noqa: E402

common.define_timing_flags(rounds=12, steps_per_round=4)
common.define_model_flags(depth=4, batch=256, width=512)
flags.DEFINE_integer("micro_batches", 4, "Micro-batches M per replica.")
flags.DEFINE_integer("connect_timeout_s", 120, "Deadline for the workers to answer.")
flags.DEFINE_string("client_of", None, "Internal: run as the client of this cluster spec.")
FLAGS = flags.FLAGS
_FORWARDED = (
    "rounds",
    "steps_per_round",
    "width",
    "depth",
    "batch",
    "micro_batches",
    "connect_timeout_s",
)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _start_workers(spec: str, logs: str) -> list[subprocess.Popen]:
    workers = []
    for i in range(2):
        with open(os.path.join(logs, f"worker{i}.log"), "w") as log:
            workers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "launch.worker",
                        f"--cluster={spec}",
                        f"--task_index={i}",
                        "--simulated_devices=2",
                        "--lifetime_s=1800",
                    ],
                    cwd=ROOT,
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
    spec = json.dumps({"worker": [f"127.0.0.1:{p}" for p in _free_ports(2)]})
    logs = tempfile.mkdtemp(prefix="hybrid-multihost-")
    workers = _start_workers(spec, logs)
    forwarded = [f"--{name}={getattr(FLAGS, name)}" for name in _FORWARDED]
    try:
        client = subprocess.run(
            [sys.executable, os.path.abspath(__file__), f"--client_of={spec}", *forwarded],
            cwd=ROOT,
            timeout=1500,
        )
    finally:
        _stop(workers)
    if client.returncode:
        print(f"multihost: the client failed; worker logs in {logs}", file=sys.stderr)
    return client.returncode


def run(spec: str) -> None:
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # not the session config the connect logs
    import hybrid

    hybrid.simulate_cpu_devices(4)
    import keras

    from hybrid.platforms import cluster

    job = cluster.connect(spec, timeout_s=FLAGS.connect_timeout_s)
    env = common.environment()
    env["workers"] = [str(t) for t in job.workers]
    common.print_header("multihost", env)
    x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)
    # After connecting, the device list holds every task's devices: take this process's.
    local = [d for d in hybrid.local_devices("CPU") if "/job:worker/" not in d]
    meshes = {
        "local": hybrid.DeviceMesh.from_devices(local, 2, 2),
        "cluster": cluster.mesh(job, 2, 2),
        "cluster_pipelines": cluster.mesh(job, 2, 2, order="pipelines_in_host"),
    }

    def make(mesh: hybrid.DeviceMesh) -> Any:
        pipe = hybrid.Pipeline(
            common.dense_stack(FLAGS.width, FLAGS.depth),
            mesh=mesh,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=keras.optimizers.SGD(1e-3),
            micro_batches=FLAGS.micro_batches,
        )
        pipe.build((None, FLAGS.width))
        return lambda: pipe.train_step(x, y)

    for name, mesh in meshes.items():
        print(f"  {name:18s} {[list(row) for row in mesh.devices]}")
    with job.guard():
        samples = common.time_alternating(
            {name: make(mesh) for name, mesh in meshes.items()},
            rounds=FLAGS.rounds,
            steps_per_round=FLAGS.steps_per_round,
            warmup=2,
        )
    ms = {name: 1e3 * common.median(v) for name, v in samples.items()}
    ratio = ms["cluster"] / ms["local"]
    ratio_pipelines = ms["cluster_pipelines"] / ms["local"]
    for name, value in ms.items():
        print(f"  {name:18s} {value:8.2f} ms/step (median of {FLAGS.rounds} rounds)")
    print(f"  ratio cluster / local:            {ratio:.3f}")
    print(f"  ratio cluster_pipelines / local:  {ratio_pipelines:.3f}")
    config = {
        k: getattr(FLAGS, k)
        for k in ("rounds", "steps_per_round", "width", "depth", "batch", "micro_batches")
    }
    path = common.write_json(
        "multihost",
        {
            "environment": env,
            "config": config,
            "meshes": {name: [list(row) for row in m.devices] for name, m in meshes.items()},
            "ms_per_step": ms,
            "samples_s": samples,
            "ratio": ratio,
            "ratio_pipelines": ratio_pipelines,
        },
    )
    common.bar_chart("multihost", ms, "ms / step", "2×2 mesh: one process vs 2 gRPC tasks")
    print(f"  wrote {path}")
    print(
        f"SUMMARY multihost local_ms={ms['local']:.2f} cluster_ms={ms['cluster']:.2f} "
        f"cluster_pipelines_ms={ms['cluster_pipelines']:.2f} ratio={ratio:.3f} "
        f"ratio_pipelines={ratio_pipelines:.3f}"
    )


if __name__ == "__main__":
    app.run(main)
