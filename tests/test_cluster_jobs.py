"""A cluster job's operations: the step deadline, the restart supervisor and their flags,
and clusters read from SLURM's environment.

The faults themselves (a worker SIGKILLed, a worker SIGSTOPped, the supervisor restarting
the client) run on real processes in ``tests/test_multihost.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import tensorflow as tf
from absl import flags

from hybrid.launch import restarts
from hybrid.launch.train_flags import _check_restarts, parse_deadline
from hybrid.platforms import slurm
from hybrid.platforms.cluster_tasks import Task
from hybrid.platforms.local_workers import free_ports
from hybrid.platforms.step_deadline import Hang, StepDeadline, probe_tasks

import pause
import runner

LOCAL = Task("localhost", 0, "unused")  # this process: its CPU answers a probe
GONE = Task("worker", 7, "127.0.0.1:1")  # no such task: its probe fails


def watch(deadline_s: float | None = None, **kwargs):
    """A StepDeadline over this process and a task that is not there; the hang it reports
    lands in the returned list (and sets the returned event)."""
    found: list[Hang] = []
    event = threading.Event()

    def on_hang(hang: Hang) -> None:
        found.append(hang)
        event.set()

    kwargs.setdefault("tasks", [LOCAL, GONE])
    kwargs.setdefault("probe_timeout_s", 1.0)
    return StepDeadline(on_hang=on_hang, deadline_s=deadline_s, **kwargs), found, event


def test_probes_tell_a_task_that_runs_ops_from_one_that_is_not_there():
    assert probe_tasks([LOCAL, GONE], timeout_s=30) == (GONE,)


def test_a_step_past_the_deadline_names_the_silent_task_and_its_devices():
    here = "/job:localhost/replica:0/task:0/device:CPU:"
    gone = "/job:worker/replica:0/task:7/device:CPU:"
    mesh = [[here + "0", gone + "0"], [gone + "1", here + "1"]]
    deadline, found, event = watch(0.2, mesh_devices=mesh, probe_timeout_s=2.0)
    assert deadline.deadline_s is None  # not armed before the first step (it compiles)
    deadline.progressed(3)
    assert deadline.deadline_s == 0.2
    assert event.wait(60)
    (hang,) = found
    assert (hang.step, hang.silent, hang.unserved) == (3, (GONE,), (GONE,))
    assert hang.answering == (LOCAL,)
    assert hang.devices == {GONE: ((0, 1, gone + "0"), (1, 0, gone + "1"))}
    line = hang.line(deadline="--step_deadline=0.2")
    assert line.startswith("step 4 has not finished ")
    assert line.endswith(
        " s after step 3 (--step_deadline=0.2): worker task 7 (127.0.0.1:1): its server does "
        "not answer; it holds stage 0 replica 1 (/job:worker/replica:0/task:7/device:CPU:0), "
        "stage 1 replica 0 (/job:worker/replica:0/task:7/device:CPU:1); localhost task 0 "
        "(unused) answers"
    )


def test_when_every_task_answers_the_step_gets_one_more_deadline():
    deadline, found, event = watch(0.3, tasks=[LOCAL], probe_timeout_s=1.0)
    deadline.progressed(1)
    assert event.wait(60)
    (hang,) = found
    assert hang.silent == () and hang.waited_s >= 0.6  # twice the deadline
    assert hang.line().endswith(
        "s after step 1 (deadline 0.3 s), although every task answers a probe (localhost task 0 "
        "(unused))"
    )


def test_progress_and_held_callbacks_keep_the_deadline_away():
    now = [0.0]  # the deadline's clock, moved by hand: a stalled test cannot fire it
    deadline, found, event = watch(0.3, clock=lambda: now[0])
    deadline.progressed(1)
    with deadline.held():  # a callback that waits far longer than the deadline
        now[0] += 100.0
        assert not event.wait(1.0)
    for step in range(2, 8):  # steps that keep coming within it
        now[0] += 0.1
        deadline.progressed(step)
    assert not event.wait(1.0)
    now[0] += 1.0  # then none: it fires, by the clock it was given
    assert event.wait(60) and found[0].step == 7
    deadline.close()


def test_the_automatic_deadline_follows_the_longest_step():
    now = [0.0]
    deadline, _, _ = watch(None, floor_s=60.0, factor=10.0, clock=lambda: now[0])
    deadline.progressed(1)
    assert deadline.deadline_s == 60.0  # the floor
    for step, seconds in [(2, 1.0), (3, 9.0), (4, 2.0)]:
        now[0] += seconds
        deadline.progressed(step)
    assert deadline.deadline_s == 90.0  # 10 × the longest step (9 s)
    deadline.close()


@pytest.mark.parametrize(
    "values,message",
    [
        (
            {"step_deadline": "600"},
            "--step_deadline=600 watches a cluster job's workers; it applies with --cluster",
        ),
        ({"step_deadline": "0", "cluster": "{}"}, "--step_deadline=0 must be positive seconds"),
        ({"step_deadline": "soon", "cluster": "{}"}, "--step_deadline=soon must be positive"),
        ({"max_restarts": 2}, "--max_restarts=2 restarts a --cluster job's client"),
        (
            {"max_restarts": 2, "cluster": "{}"},
            "--max_restarts=2 needs --model_dir: a restarted client resumes",
        ),
    ],
)
def test_bad_deadline_and_restart_flags_are_refused(values, message):
    given = {
        "step_deadline": "auto",
        "max_restarts": 0,
        "cluster": None,
        "model_dir": None,
        "memory_per_device": None,
    }
    with pytest.raises(flags.ValidationError) as err:
        _check_restarts({**given, **values})
    assert message in str(err.value)


def test_good_deadline_and_restart_flags_pass():
    assert parse_deadline("auto") is None and parse_deadline("90") == 90.0
    assert _check_restarts(
        {
            "step_deadline": "30",
            "max_restarts": 3,
            "cluster": "{}",
            "model_dir": "/tmp/run",
            "memory_per_device": None,
        }
    )


def child(code: int) -> list[str]:
    """A child that exits with ``code`` and says what it was given."""
    return [sys.executable, "-c", f"import sys; print(sys.argv[1:]); sys.exit({code})"]


def test_the_supervisor_restarts_lost_and_hung_clients_only(capfd):
    said: list[str] = []
    code = restarts.supervise(["--a=1"], 2, said.append, command=child(restarts.HUNG))
    assert code == restarts.HUNG
    assert said == [
        f"restart {n} of at most 2: the client ended after a hung step (exit 4); a new client "
        "waits --cluster_timeout for the workers and resumes from the newest checkpoint"
        for n in (1, 2)
    ]
    out, err = capfd.readouterr()
    assert out.splitlines() == ["['--a=1', '--max_restarts=0']"] * 3  # 1 run + 2 restarts
    assert "--max_restarts=2 restart(s) are used up" in err

    said.clear()
    assert restarts.supervise([], 5, said.append, command=child(1)) == 1  # a user's error
    assert restarts.supervise([], 5, said.append, command=child(0)) == 0
    assert said == []


def test_a_collective_refused_after_a_restart_says_every_worker_must_restart():
    from hybrid.platforms.cluster_tasks import restarted_error

    tasks = [Task("worker", 0, "h0:1"), Task("worker", 1, "h1:1")]
    message = (
        "Collective ops is aborted by: /job:worker/replica:0/task:1/device:CPU:1exists in "
        "cache with a different incarnation. This usually means the remote worker has restarted"
    )
    error = restarted_error(tasks, tf.errors.FailedPreconditionError(None, None, message))
    assert error.tasks == (tasks[1],)
    assert str(error).startswith(
        "worker task 1 (h1:1) restarted, but the other workers kept the previous client's "
        "collective state (TensorFlow: its devices' incarnation changed)"
    )
    assert str(error).endswith(
        "Restart all the workers, then the client (from its last checkpoint)"
    )


SLURM_JOB = {"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2,1"}
SLURM_STEP = {"SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_TASKS_PER_NODE": "2,1"}
SLURM_VARIABLES = (
    *SLURM_JOB, *SLURM_STEP, "SLURM_PROCID", "SLURMD_NODENAME", "SLURM_LOCALID", "TF_CONFIG"
)  # fmt: skip


@pytest.fixture
def no_slurm(monkeypatch):
    for name in SLURM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_slurm_job_is_a_worker_per_task_for_the_client_and_the_workers(no_slurm):
    expected = {"worker": ["node01:2222", "node01:2223", "node02:2222"]}
    for name, value in SLURM_JOB.items():  # the batch script, where the client runs
        no_slurm.setenv(name, value)
    assert slurm.spec("SLURM:2222").as_dict() == expected
    for name, value in SLURM_STEP.items():  # a worker under srun
        no_slurm.setenv(name, value)
    spec = slurm.spec("SLURM:2222")
    assert spec.as_dict() == expected
    for host, local, index in [("node01", "1", 1), ("node02", "0", 2)]:
        no_slurm.setenv("SLURMD_NODENAME", host)
        no_slurm.setenv("SLURM_LOCALID", local)
        no_slurm.setenv("SLURM_PROCID", "0")  # its address decides, not the rank
        assert slurm.task_index(spec, "SLURM:2222") == index
    assert slurm.spec("SLURM").job_tasks("worker")[0] == f"node01:{slurm.DEFAULT_PORT}"


def test_slurm_outside_a_job_or_with_a_bad_port_is_refused(no_slurm):
    with pytest.raises(ValueError, match="SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are not"):
        slurm.spec("SLURM")
    with pytest.raises(ValueError, match="SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are not"):
        slurm.check_environment()  # what the launchers' flag check asks
    with pytest.raises(ValueError, match="--cluster=SLURM:http: 'http' is not a port"):
        slurm.port_of("SLURM:http")


def test_a_worker_under_srun_serves_its_own_task(no_slurm, tmp_path):
    base = free_ports(1)[0]
    env = {
        **os.environ, "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "1",
        "SLURMD_NODENAME": "localhost", "SLURM_LOCALID": "0", "SLURM_PROCID": "0",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }  # fmt: skip
    command = [sys.executable, "-m", "hybrid.launch.worker", f"--cluster=SLURM:{base}"]
    worker = subprocess.Popen(
        [*command, "--lifetime_s=120"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        line = next(line for line in worker.stdout if "serving at" in line or "worker:" in line)
        assert line.startswith(f"worker worker:0 serving at localhost:{base} "), line
    finally:
        worker.terminate()
        worker.communicate(timeout=pause.HANG_BOUND_S)  # reads the pipe to its end meanwhile


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
