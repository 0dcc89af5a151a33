"""Meshes over several tasks of TensorFlow's gRPC runtime, on loopback, with real processes.

Two worker processes (``hybrid/launch/worker.py``, 2 simulated CPUs each) and one client process
(``tests/multihost_client.py``: a connection to a cluster cannot be undone, and this process
already has its 8 local devices) train the reference MLP on a 2×2 mesh with each replica
group inside one task. Losses and weights must equal the same run on this process's local
2×2 mesh and the single-device reference. Every address is on 127.0.0.1, every process has
a deadline and is killed at teardown at the latest.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tensorflow as tf

from hybrid.platforms import cluster
from hybrid.platforms.local_workers import free_ports

import pause
import reference as ref
import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT = os.path.join(ROOT, "tests", "multihost_client.py")
STEPS = 3
OPTIMIZER = "sgd_momentum"
DEADLINE_S = 150  # any one process of these tests
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}


def stop(process: subprocess.Popen, grace_s: float = 15.0) -> int:
    """SIGTERM, then SIGKILL after ``grace_s``; the exit code (negative: killed)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(grace_s)
    return process.returncode


class Job:
    """Two worker processes on loopback ports, and helpers to run the client against them."""

    def __init__(self, directory: str, make_dir: bool = False) -> None:
        if make_dir:
            os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.ports = free_ports(2)
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.spec = json.dumps({"worker": self.addresses})
        self.workers = [self._start_worker(i) for i in range(2)]

    def _start_worker(self, index: int) -> subprocess.Popen:
        log = open(os.path.join(self.directory, f"worker{index}.log"), "w")
        with log:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hybrid.launch.worker",
                    f"--cluster={self.spec}",
                    f"--task_index={index}",
                    "--simulated_devices=2",
                    f"--lifetime_s={DEADLINE_S + 60}",
                ],
                cwd=ROOT,
                env=ENV,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self, name: str) -> str:
        with open(os.path.join(self.directory, f"{name}.log")) as f:
            return f.read()

    def output(self) -> str:
        """The end of the client's stdout and stderr, for failure messages."""
        with open(os.path.join(self.directory, "client.err")) as f:
            return self.log("client")[-1000:] + "\n--- stderr:\n" + f.read()[-3000:]

    def client(self, *flags: str) -> subprocess.Popen:
        out = open(os.path.join(self.directory, "client.log"), "w")
        err = open(os.path.join(self.directory, "client.err"), "w")
        with out, err:
            return subprocess.Popen(
                [sys.executable, CLIENT, f"--cluster={self.spec}", f"--out={self.directory}"]
                + list(flags),
                cwd=ROOT,
                env=ENV,
                stdout=out,
                stderr=err,
            )

    def close(self) -> list[int]:
        return [stop(w) for w in self.workers]

    def restart(self) -> None:
        """Every worker killed and started again at its address, as a job's supervisor
        does: with replica groups that span tasks, the survivors of a lost worker keep the
        old client's collective state, so all of them restart."""
        for worker in self.workers:
            worker.kill()
            worker.wait(DEADLINE_S)
        self.workers = [self._start_worker(i) for i in range(len(self.workers))]


@pytest.fixture
def job(tmp_path) -> Iterator[Job]:
    running = Job(str(tmp_path))
    try:
        yield running
    finally:
        running.close()


def initial_weights(directory: str) -> str:
    path = os.path.join(directory, "init.npz")
    model = ref.Reference(ref.mlp_layers(), ref.OPTIMIZERS[OPTIMIZER]()).model
    np.savez(path, **{f"w{i}": w for i, w in enumerate(model.get_weights())})
    return path


def finish(process: subprocess.Popen, job: Job, timeout_s: float = DEADLINE_S) -> int:
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"the client ran past {timeout_s} s:\n{job.output()}")


def local_run(init: str) -> tuple[list[float], list[np.ndarray], list[float], list[np.ndarray]]:
    """The same training on this process's 2×2 mesh, and on the single-device reference."""
    weights = np.load(init)
    start = [weights[f"w{i}"] for i in range(len(weights.files))]
    reference = ref.Reference(ref.mlp_layers(), ref.OPTIMIZERS[OPTIMIZER]())
    reference.model.set_weights(start)
    pipe = ref.pipeline(2, 2, layers=ref.mlp_layers(seed=99), optimizer=OPTIMIZER, weights=start)
    pipe_losses, ref_losses = [], []
    for step in range(STEPS):
        x, y = ref.batch(64, seed=step + 1)
        pipe_losses.append(pipe.train_step(x, y)["loss"])
        ref_losses.append(reference.train_step(x, y))
    return pipe_losses, pipe.get_weights(), ref_losses, reference.model.get_weights()


@pytest.mark.long
def test_two_tasks_train_like_one_process(job, tmp_path):
    init = initial_weights(str(tmp_path))
    checkpoints = str(tmp_path / "ckpt")
    client = job.client(f"--init={init}", f"--steps={STEPS}", f"--checkpoint_dir={checkpoints}")
    assert finish(client, job) == 0, job.output()

    with open(tmp_path / "mesh.json") as f:
        rows = json.load(f)["devices"]
    for s, row in enumerate(rows):  # replica group s inside task s, the pipeline crosses
        assert row == [f"/job:worker/replica:0/task:{s}/device:CPU:{r}" for r in range(2)]

    result = np.load(tmp_path / "result.npz")
    losses = list(result["losses"])
    weights = [result[f"w{i}"] for i in range(len(result.files) - 1)]
    local_losses, local_weights, ref_losses, ref_weights = local_run(init)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    ref.assert_weights_close(weights, ref_weights)
    np.testing.assert_allclose(losses, local_losses, rtol=1e-6)
    ref.assert_weights_close(weights, local_weights, rtol=1e-6, atol=1e-7)

    # Clean shutdown: SIGTERM ends each worker with exit code 0.
    assert job.close() == [0, 0]
    assert "SIGTERM, shutting down" in job.log("worker1")

    # The checkpoint the client wrote restores on one process, onto another mesh.
    from hybrid.run import checkpoint

    pipe = ref.pipeline(1, 2, layers=ref.mlp_layers(seed=7), optimizer=OPTIMIZER, build=True)
    restored = checkpoint.Checkpointer(pipe, checkpoints).restore_latest()
    assert restored is not None and restored.step == STEPS
    ref.assert_weights_close(pipe.get_weights(), weights, rtol=0, atol=0)


# Your model and per-host data (tests/user_model.py): on the cluster each replica's pipeline
# is one task (--mesh_order=pipelines_in_host), which reads that replica's batches itself.
LAUNCH_FLAGS = [
    "--model=user_model:model",
    "--data=user_model:per_host_data",
    "--mesh=stage:2;replica:2",
    "--micro_batches=2",
    "--global_batch_size=16",
    "--checkpoint_every=2",
    "--log_every=1",
    "--nojit_compile",
]
USER_ENV = {**ENV, "PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}


def launcher(model_dir: str, steps: int, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "hybrid.launch.train", *LAUNCH_FLAGS, f"--model_dir={model_dir}",
        f"--train_steps={steps}", *flags,
    ]  # fmt: skip


def run_launcher(model_dir: str, steps: int, *flags: str) -> str:
    run = subprocess.run(
        launcher(model_dir, steps, *flags),
        cwd=ROOT, env=USER_ENV, capture_output=True, text=True, timeout=DEADLINE_S,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def wait_for_line(log, text: str, process: subprocess.Popen, after: int = 0) -> int:
    """Blocks until ``text`` appears in the file ``log`` past offset ``after`` (an event the
    process writes), failing if the process ends first or a hang bound passes; returns the
    offset just past it."""
    deadline = time.monotonic() + pause.HANG_BOUND_S
    while True:
        found = log.read_text().find(text, after)
        if found >= 0:
            return found + len(text)
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no {text!r} in the run's output:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


@pytest.mark.long
def test_launcher_job_restarts_itself_after_a_killed_and_a_frozen_worker(tmp_path):
    """One host → 2 tasks under ``--max_restarts`` → a worker SIGKILLed (the client exits 3,
    the supervisor starts a new client, which waits for the restarted workers) → a worker
    SIGSTOPped (the step outlives ``--step_deadline``: the client names the frozen task and
    its devices, exits 4, and is restarted too) → back on one host. Each replica's pipeline
    is one task, so the gradient all-reduce spans tasks: after a fault every worker
    restarts (``Job.restart``), as TensorFlow's collectives require.

    Each fault lands while the run is paused after a step; every leg resumes from the newest
    checkpoint in the same --model_dir, and the end equals an uninterrupted one-host run.
    The data is read per host (each task makes its replica's batches, one host makes both),
    so every resumed leg also takes its data up where the checkpoint left it.
    """
    run_dir, whole = str(tmp_path / "run"), str(tmp_path / "whole")
    assert "done:" in run_launcher(run_dir, 2)  # one host writes ckpt-2

    job = Job(str(tmp_path / "job"), make_dir=True)
    events, log = tmp_path / "events", tmp_path / "client.log"
    try:
        with open(log, "w") as out:
            client = subprocess.Popen(
                launcher(
                    run_dir, 8, f"--cluster={job.spec}", "--max_restarts=3",
                    "--step_deadline=15", "--cluster_timeout=300", "--mesh_order=pipelines_in_host",
                ),
                cwd=ROOT,
                env={**USER_ENV, "PYTHONUNBUFFERED": "1", **pause.env((5, 7), events)},
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        describe = lambda: log.read_text()[-3000:]  # noqa: E731
        # Killed: the client waits after step 5 (ckpt-4 is the newest) while worker 1 dies.
        pause.wait_until_paused(events, 5, client, describe)
        assert tf.train.latest_checkpoint(run_dir).endswith("ckpt-4")
        job.workers[1].kill()
        job.workers[1].wait(pause.HANG_BOUND_S)
        pause.release(events, 5)
        seen = wait_for_line(log, "restart 1 of at most 3", client)
        job.restart()  # the new client waits for the workers at their addresses
        # Frozen: the new client waits after step 7 (ckpt-6) while worker 1 stops.
        pause.wait_until_paused(events, 7, client, describe)
        job.workers[1].send_signal(signal.SIGSTOP)
        pause.release(events, 7)
        seen = wait_for_line(log, "restart 2 of at most 3", client, seen)
        job.restart()  # a frozen process dies of SIGKILL too
        code = client.wait(pause.HANG_BOUND_S)
        text = log.read_text()
        assert code == 0, text[-4000:]
        assert "ckpt-2: resuming at step 3" in text  # one host's checkpoint on two tasks
        assert "data read per host, 2 input host(s): /job:worker/replica:0/task:0" in text
        killed = f"lost worker task 1 ({job.addresses[1]})" in text
        assert killed or f"worker task 1 ({job.addresses[1]}) stopped answering" in text, text
        assert "after a lost worker (exit 3)" in text
        assert "ckpt-4: resuming at step 5" in text
        frozen = re.search(
            r"error: hung: step 8 has not finished \d+ s after step 7 \(--step_deadline=15\): "
            rf"worker task 1 \({job.addresses[1]}\): its server does not answer; it holds .*",
            text,
        )
        assert frozen, text[-4000:]
        hung = frozen.group(0)
        for stage in range(2):  # the frozen task holds replica 1's pipeline
            assert f"stage {stage} replica 1 (/job:worker/replica:0/task:1/device:CPU:" in hung
        assert f"; worker task 0 ({job.addresses[0]}) answers;" in hung
        assert "taking over the lock" not in text  # the hung client released it
        assert f"the newest checkpoint is ckpt-6 in {run_dir}" in hung
        assert "after a hung step (exit 4)" in text
        assert "ckpt-6: resuming at step 7" in text
        assert "This should never happen" not in text  # TensorFlow's report, filtered
        assert "Exception ignored in" not in text  # a lost worker's executors, collected
    finally:
        if client.poll() is None:
            client.kill()
        job.close()

    back = run_launcher(run_dir, 10)  # the two tasks' checkpoint on one host
    assert "ckpt-8: resuming at step 9" in back
    assert "data read per host, 1 input host(s)" in back
    run_launcher(whole, 10)
    final = tf.train.load_checkpoint(os.path.join(run_dir, "ckpt-10"))
    expected = tf.train.load_checkpoint(os.path.join(whole, "ckpt-10"))
    keys = [k for k in expected.get_variable_to_shape_map() if k.startswith("model/")]
    assert keys
    for key in keys:
        np.testing.assert_allclose(
            final.get_tensor(key), expected.get_tensor(key), rtol=1e-5, atol=1e-6, err_msg=key
        )


def test_connect_names_tasks_that_do_not_answer():
    ports = free_ports(2)
    spec = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    start = time.monotonic()
    with pytest.raises(cluster.UnreachableTaskError) as err:
        cluster.connect(spec, timeout_s=1.0)
    assert time.monotonic() - start < 120  # a bound against hanging (plain TF waits forever)
    message = str(err.value)
    worded = launch_worker().flag_terms(message)  # what the launchers print
    for i, port in enumerate(ports):
        assert f"worker task {i} (127.0.0.1:{port})" in message
        assert f"`start_server(cluster, job='worker', task_index={i})`" in message
        assert (
            f"`python -m hybrid.launch.worker --cluster=... --job_name=worker --task_index={i}`"
            in (worded)
        )
    assert "did not answer within 1 s" in message and "--" not in message
    assert [t.index for t in err.value.tasks] == [0, 1]


def test_probe_and_watch_tell_live_servers_from_dead_ports():
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    live = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        (dead,) = free_ports(1)
        tasks = (
            cluster.Task("worker", 0, f"127.0.0.1:{live}"),
            cluster.Task("worker", 1, f"127.0.0.1:{dead}"),
        )
        assert cluster.unreachable(tasks, timeout_s=1.0) == tasks[1:]
        lost: list[tuple[cluster.Task, ...]] = []
        stop = cluster.Cluster(tasks).watch(lost.append, interval_s=0.1, probe_timeout_s=0.5)
        deadline = time.monotonic() + 120  # a bound against a hang
        while not lost and time.monotonic() < deadline:
            time.sleep(0.1)
        stop.set()
        assert lost == [tasks[1:]]
    finally:
        server.stop(None)


def test_server_on_a_taken_port_says_so():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(cluster.ClusterError, match=f"is port {port} already in use"):
            cluster.start_server({"worker": [f"127.0.0.1:{port}"]}, "worker", 0)


def test_connect_and_start_server_name_the_arguments_to_change():
    spec = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    with pytest.raises(ValueError) as err:
        cluster.start_server(spec, "worker", 3)  # refused before any server starts
    message = str(err.value)
    assert "job 'worker' has tasks [0, 1], not task_index=3; pass one of those as task_index" in (
        message
    )
    worded = launch_worker().flag_terms(message)
    assert worded.endswith("not --task_index=3; pass one of those as --task_index")
    with pytest.raises(ValueError) as err:
        cluster.connect(spec, job="ps")  # refused before any probe
    assert str(err.value).endswith("(its jobs: ['worker']); pass one of those as job")
    assert launch_worker().flag_terms(str(err.value)).endswith("as --job_name")


def test_worker_asks_which_task_it_is():
    env = {k: v for k, v in ENV.items() if k != "TF_CONFIG"}
    run = subprocess.run(
        [sys.executable, "-m", "hybrid.launch.worker", '--cluster={"worker": ["127.0.0.1:1"]}'],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1
    assert "pass --task_index (or set TF_CONFIG's task.index)" in run.stderr


def launch_worker():
    """``hybrid.launch.worker`` (imported when asked: it defines absl flags)."""
    return importlib.import_module("hybrid.launch.worker")


def cpus(task: int, count: int) -> list[str]:
    return [f"/job:worker/replica:0/task:{task}/device:CPU:{i}" for i in range(count)]


def test_order_keeps_replica_groups_or_pipelines_inside_a_task():
    two = [cpus(0, 2), cpus(1, 2)]
    assert cluster.order_devices(two, 2, 2) == (tuple(cpus(0, 2)), tuple(cpus(1, 2)))
    assert cluster.order_devices(two, 2, 2, "pipelines_in_host") == (
        (cpus(0, 2)[0], cpus(1, 2)[0]),
        (cpus(0, 2)[1], cpus(1, 2)[1]),
    )
    # Groups fill a task before the pipeline crosses to the next one.
    four = [cpus(0, 4), cpus(1, 4)]
    rows = cluster.order_devices(four, 4, 2)
    assert rows == (
        tuple(cpus(0, 4)[:2]),
        tuple(cpus(0, 4)[2:]),
        tuple(cpus(1, 4)[:2]),
        tuple(cpus(1, 4)[2:]),
    )
    # A replica group larger than a task spans whole tasks.
    assert cluster.order_devices(two, 1, 4) == (tuple(cpus(0, 2) + cpus(1, 2)),)
    # A 3-device task holds one group of 2; the third device stays unused.
    three = [cpus(0, 3), cpus(1, 3)]
    assert cluster.order_devices(three, 2, 2) == (tuple(cpus(0, 3)[:2]), tuple(cpus(1, 3)[:2]))
    # A task too small for a replica group holds none.
    assert cluster.order_devices([cpus(0, 1), cpus(1, 2)], 1, 2) == (tuple(cpus(1, 2)),)


@pytest.mark.parametrize(
    "per_task,stages,replicas,order,message",
    [
        (
            [2, 2],
            3,
            2,
            "replica_groups_in_host",
            "needs 3 replica groups of 2 devices, each inside one task, but the tasks' devices "
            "[2, 2] hold only 2",
        ),
        ([2, 3], 1, 4, "replica_groups_in_host", "spanning tasks needs every task"),
        ([2, 2], 2, 2, "rows", "unknown device order 'rows'"),
        ([3, 3], 3, 3, "pipelines_in_host", "hold only 2"),
    ],
)
def test_order_errors_name_the_values_and_the_fix(per_task, stages, replicas, order, message):
    devices = [cpus(t, n) for t, n in enumerate(per_task)]
    with pytest.raises(ValueError) as err:
        cluster.order_devices(devices, stages, replicas, order)
    assert message in str(err.value) and "--" not in str(err.value)


def test_launchers_word_order_errors_as_flags():
    with pytest.raises(ValueError) as err:
        cluster.order_devices([cpus(0, 2), cpus(1, 2)], 3, 2)
    message = str(err.value)
    assert "(start_server(..., simulated_devices=N) on CPU)" in message
    assert "use the other order" in message
    worded = launch_worker().flag_terms(message)
    assert "(hybrid-worker --simulated_devices=N on CPU)" in worded
    assert worded.endswith("use the other --mesh_order")


def test_cluster_spec_forms(monkeypatch):
    jobs = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    want = tf.train.ClusterSpec(jobs).as_dict()
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(jobs))
    tf_config = {"cluster": jobs, "task": {"type": "worker", "index": 1}}
    for form in [jobs, json.dumps(jobs), tf_config, tf.train.ClusterSpec(jobs), resolver]:
        assert cluster.cluster_spec(form).as_dict() == want
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    assert cluster.cluster_spec(None).as_dict() == want
    monkeypatch.delenv("TF_CONFIG")
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        cluster.cluster_spec(None)
    with pytest.raises(ValueError, match="has no job 'ps'"):
        cluster.connect(jobs, job="ps")
    with pytest.raises(ValueError, match="not valid JSON"):
        cluster.cluster_spec("{worker")


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
