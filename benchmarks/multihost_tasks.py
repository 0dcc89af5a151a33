"""Jobs of 2, 4 and 8 tasks: step time and client bytes against one process, and an 8-task
job killed and resumed exactly.

**Scaling** (for each task count T): T loopback workers of 4 simulated CPU devices each
and a client that simulates 4·T devices of its own lay the same T × 4 mesh (stage s's
replica group inside task s) over this process's devices (``local``) and over the tasks
(``cluster``), and time ``fit`` on the same model (T + 1 Dense layers, batch 256, M = 4,
SGD) in alternating rounds: on the cluster with the client feeding every replica
(``cluster``) and with the input made on the task of the first stage
(``cluster_per_host``, ``Pipeline.distribute_datasets_from_function``). The client's bytes
sent per step come from the kernel's per-socket counters (``ss -tin``: control messages
included).

**Kill and resume** (``--resume_tasks``, default 8): ``hybrid-train --cluster=...
--max_restarts=2`` trains the reference MLP on a T × 4 mesh over T tasks; after step 3
(ckpt-2 is the newest) worker T-1 is SIGKILLed and every worker restarted (their
collectives span tasks); the supervised client is restarted, resumes and trains to step 6.
The last checkpoint must equal an uninterrupted one-process run's (every model variable,
rtol 1e-5); the wall time of each leg is reported.

    python benchmarks/multihost_tasks.py [--tasks=2,4,8] [--rounds=3] [--resume_tasks=8]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from absl import app, flags

import common

flags.DEFINE_list("tasks", ["2", "4", "8"], "Task counts to time.")
flags.DEFINE_integer("rounds", 3, "Alternating rounds of each kind.")
flags.DEFINE_integer("steps", 8, "Steps per round.")
flags.DEFINE_integer("width", 256, "Input features and hidden width.")
flags.DEFINE_integer("batch", 256, "Global batch.")
flags.DEFINE_integer("micro_batches", 4, "Micro-batches per replica.")
flags.DEFINE_integer("resume_tasks", 8, "Tasks of the kill-and-resume run (0: none).")
flags.DEFINE_string("client_of", None, "Internal: run as the client of this cluster spec.")
FLAGS = flags.FLAGS

DEVICES_PER_TASK = 4


class Workers:
    """T worker processes of 4 simulated devices on loopback ports (restartable in place)."""

    def __init__(self, tasks: int, logs: str) -> None:
        from hybrid.platforms.local_workers import free_ports

        self.logs = logs
        self.spec = json.dumps({"worker": [f"127.0.0.1:{p}" for p in free_ports(tasks)]})
        self.processes = [self._start(i) for i in range(tasks)]

    def _start(self, index: int) -> subprocess.Popen[bytes]:
        with open(os.path.join(self.logs, f"worker{index}.log"), "a") as log:
            return subprocess.Popen(
                [
                    sys.executable, "-m", "hybrid.launch.worker", f"--cluster={self.spec}",
                    f"--task_index={index}", f"--simulated_devices={DEVICES_PER_TASK}",
                    "--lifetime_s=3600",
                ],
                cwd=common.ROOT, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def restart(self) -> None:
        """Every worker killed and started again at its address."""
        for process in self.processes:
            process.kill()
            process.wait()
        self.processes = [self._start(i) for i in range(len(self.processes))]

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run(spec: str) -> None:
    """The client: the T × 4 mesh on this process and on the tasks; prints a RESULT line."""
    import keras
    import tensorflow as tf

    import hybrid

    tasks = len(json.loads(spec)["worker"])
    hybrid.simulate_cpu_devices(DEVICES_PER_TASK * tasks)
    from hybrid.platforms import cluster

    job = cluster.connect(spec, timeout_s=300)
    local = [d for d in hybrid.local_devices("CPU") if "/job:worker/" not in d]
    meshes = {
        "local": hybrid.DeviceMesh.from_devices(local, tasks, DEVICES_PER_TASK),
        "cluster": cluster.mesh(job, tasks, DEVICES_PER_TASK),
    }
    rows = FLAGS.batch // DEVICES_PER_TASK

    def examples(step: tf.Tensor, n: int, seed: int) -> tuple[tf.Tensor, tf.Tensor]:
        x = tf.random.stateless_normal([n, FLAGS.width], tf.stack([step, seed]))
        return x, tf.random.stateless_uniform([n], tf.stack([step, seed]), 0, 10, tf.int32)

    client_fed = tf.data.Dataset.range(1 << 40).map(lambda s: examples(s, FLAGS.batch, 0))
    runs: dict[str, tuple[Any, Any]] = {}
    built = time.perf_counter()
    for name, mesh in meshes.items():
        pipe = common.dense_pipeline(
            FLAGS.width, tasks, mesh, keras.optimizers.SGD(1e-3), micro_batches=FLAGS.micro_batches
        )
        runs[name] = (pipe, client_fed)
    build_s = time.perf_counter() - built  # both pipelines
    cluster_pipe = runs["cluster"][0]
    per_host = cluster_pipe.distribute_datasets_from_function(
        lambda c: tf.data.Dataset.range(1 << 40).map(lambda s: examples(s, rows, 1))
    )
    runs["cluster_per_host"] = (cluster_pipe, per_host)
    with job.guard():
        seconds, sent = common.time_fits(runs, FLAGS.rounds, FLAGS.steps)
    ms = {k: 1e3 * v for k, v in seconds.items()}
    result = {
        "tasks": tasks,
        "mesh": f"{tasks}x{DEVICES_PER_TASK}",
        "build_s": build_s,
        **{f"{k}_ms": v for k, v in ms.items()},
        "cluster_over_local": ms["cluster"] / ms["local"],
        "per_host_over_local": ms["cluster_per_host"] / ms["local"],
        **{f"{k}_client_bytes_per_step": v for k, v in sent.items() if k != "local"},
    }
    print("RESULT " + json.dumps(result), flush=True)


def launcher(model_dir: str, tasks: int, *extra: str) -> list[str]:
    """The reference MLP on a T × 4 mesh, checkpointed every 2 steps."""
    return [
        sys.executable, "-m", "hybrid.launch.train", "--model=mlp", "--data=synthetic",
        f"--mesh=stage:{tasks},replica:{DEVICES_PER_TASK}", "--micro_batches=2",
        "--global_batch_size=32", "--width=16", f"--depth={tasks}", "--checkpoint_every=2",
        "--log_every=1", "--nojit_compile", "--train_steps=6", f"--model_dir={model_dir}",
        *extra,
    ]  # fmt: skip


def kill_and_resume(tasks: int, directory: str) -> dict[str, Any]:
    """The supervised job killed after step 3 and resumed; its end against one process's."""
    import numpy as np
    import tensorflow as tf

    events, run_dir, whole = (os.path.join(directory, d) for d in ("events", "run", "whole"))
    os.makedirs(events)
    workers = Workers(tasks, directory)
    legs: dict[str, float] = {}
    log_path = os.path.join(directory, "client.log")
    try:
        start = time.perf_counter()
        with open(log_path, "w") as log:
            client = subprocess.Popen(
                launcher(run_dir, tasks, f"--cluster={workers.spec}", "--max_restarts=2",
                         "--cluster_timeout=600"),
                cwd=common.ROOT, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "HYBRID_PAUSE_AFTER_STEP": f"3:{events}",
                     "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
        while not os.path.exists(os.path.join(events, "paused-3")):
            if client.poll() is not None:
                raise RuntimeError(f"the client ended before step 3: {log_path}")
            time.sleep(0.1)
        legs["to_step_3_s"] = time.perf_counter() - start
        workers.processes[-1].kill()
        open(os.path.join(events, "resume-3"), "w").close()
        while "restart 1 of at most 2" not in open(log_path).read():
            if client.poll() is not None:
                raise RuntimeError(f"the client ended without a restart: {log_path}")
            time.sleep(0.1)
        resumed = time.perf_counter()
        workers.restart()
        code = client.wait(3600)
        legs["resumed_to_step_6_s"] = time.perf_counter() - resumed
        if code:
            raise RuntimeError(f"the supervised client ended with {code}: {log_path}")
    finally:
        workers.stop()
    start = time.perf_counter()
    subprocess.run(
        launcher(whole, tasks, f"--simulated_devices={tasks * DEVICES_PER_TASK}"),
        cwd=common.ROOT, check=True, capture_output=True, timeout=3600,
    )  # fmt: skip
    legs["one_process_s"] = time.perf_counter() - start
    final = tf.train.load_checkpoint(os.path.join(run_dir, "ckpt-6"))
    expected = tf.train.load_checkpoint(os.path.join(whole, "ckpt-6"))
    keys = [k for k in expected.get_variable_to_shape_map() if k.startswith("model/")]
    worst = max(float(np.max(np.abs(final.get_tensor(k) - expected.get_tensor(k)))) for k in keys)
    text = open(log_path).read()
    equal = all(
        np.allclose(final.get_tensor(k), expected.get_tensor(k), rtol=1e-5, atol=1e-6) for k in keys
    )
    return {
        "tasks": tasks,
        "mesh": f"{tasks}x{DEVICES_PER_TASK}",
        "lost_worker_named": f"lost worker task {tasks - 1}" in text,
        "resumed_from": "ckpt-2: resuming at step 3" in text,
        "variables": len(keys),
        "max_abs_difference": worst,
        "equal_to_one_process": equal,
        **legs,
    }


def main(argv: list[str]) -> int:
    del argv
    if FLAGS.client_of:
        run(FLAGS.client_of)
        return 0
    env = common.environment()
    common.print_header("multihost_tasks", env)
    rows = []
    for tasks in map(int, FLAGS.tasks):
        workers = Workers(tasks, tempfile.mkdtemp(prefix="hybrid-tasks-"))
        try:
            forwarded = common.flag_args("rounds", "steps", "width", "batch", "micro_batches")
            (result,) = common.run_child(
                [os.path.abspath(__file__), f"--client_of={workers.spec}", *forwarded],
                timeout=3600,
            )
        finally:
            workers.stop()
        rows.append(result)
        print(
            f"  {tasks} tasks ({result['mesh']}): local {result['local_ms']:.1f} ms, cluster "
            f"{result['cluster_ms']:.1f} ms ({result['cluster_over_local']:.2f}x, "
            f"{result['cluster_client_bytes_per_step'] / 1e3:.1f} kB/step from the client), "
            f"per-host {result['cluster_per_host_ms']:.1f} ms "
            f"({result['per_host_over_local']:.2f}x, "
            f"{result['cluster_per_host_client_bytes_per_step'] / 1e3:.1f} kB/step); "
            f"both pipelines built in {result['build_s']:.0f} s",
            flush=True,
        )
    resume = None
    if FLAGS.resume_tasks:
        resume = kill_and_resume(FLAGS.resume_tasks, tempfile.mkdtemp(prefix="hybrid-resume-"))
        print(f"  kill and resume: {json.dumps(resume)}", flush=True)
    common.write_json(
        "multihost_tasks",
        {"environment": env, "rows": rows, "kill_and_resume": resume,
         "flags": common.flag_values("rounds", "steps", "width", "batch", "micro_batches")},
    )  # fmt: skip
    common.write_csv("multihost_tasks", rows)
    return 0 if resume is None or resume["equal_to_one_process"] else 1


if __name__ == "__main__":
    sys.exit(app.run(main))
