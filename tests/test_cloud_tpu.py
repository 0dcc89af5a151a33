"""The Cloud TPU supervisor against a fake Cloud TPU REST API on 127.0.0.1.

Every test drives the real ``cloud_tpu_client.Client`` (and googleapiclient under it) through
a hand-written discovery document and node resource (``fake_cloud_tpu.py``). Waiting runs on
a fake clock that moves only when the supervisor sleeps, so minutes of node downtime take
milliseconds. ``loopback_only()`` fails any attempt to reach beyond 127.0.0.1.
"""

import dataclasses
import datetime
import importlib
import inspect
import socket
import sys
import urllib.request

import numpy as np
import pytest
import tensorflow as tf
from absl import flags
from fake_cloud_tpu import FakeClock, FakeCloudTpu, NetworkGuardError, loopback_only
from google.auth.credentials import AnonymousCredentials

from hybrid.platforms import cloud_tpu
from hybrid.platforms.cloud_tpu import NodeStatus, SupervisorConfig, TPURecoveryError

import runner

CONFIG = SupervisorConfig(max_restarts=3, wait_timeout_s=600.0, poll_interval_s=30.0)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No proxy, no discovery-URL override from the environment, no non-loopback sockets."""
    for name in (
        "TPU_API_DISCOVERY_URL",
        "http_proxy",
        "HTTP_PROXY",
        "https_proxy",
        "HTTPS_PROXY",
        "GOOGLE_APPLICATION_CREDENTIALS",
    ):
        monkeypatch.delenv(name, raising=False)
    with loopback_only():
        yield


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def fake(clock):
    with FakeCloudTpu(project="proj", zone="us-central1-b", node="tpu-1", clock=clock) as api:
        yield api


def node_client(api, name=None):
    return cloud_tpu.client(
        name or api.node,
        api.zone,
        api.project,
        discovery_url=api.discovery_url,
        credentials=AnonymousCredentials(),
    )


@pytest.fixture
def node(fake):
    return node_client(fake)


class Run:
    """Calls supervise() with a fake clock and records attempts and log lines."""

    def __init__(self, fake, node, clock, config=CONFIG):
        self.fake, self.node, self.clock, self.config = fake, node, clock, config
        self.lines: list[str] = []
        self.attempts: list[int] = []
        self.seen_at_start: list[tuple] = []

    def __call__(self, attempt):
        def recorded(restart):
            self.attempts.append(restart)
            self.seen_at_start.append(self.fake.current())
            return attempt(restart)

        return cloud_tpu.supervise(
            recorded,
            self.node,
            self.config,
            log=self.lines.append,
            sleep=self.clock.sleep,
            clock=self.clock,
        )


def preempt_first(fake, timeline, error=None):
    """An attempt that, on its first call, applies ``timeline`` to the node and fails."""

    def attempt(restart):
        if restart == 0:
            fake.timeline(timeline)
            raise error or tf.errors.UnavailableError(None, None, "TPU preempted")
        return f"finished on attempt {restart}"

    return attempt


# -- the fake API and the network guard --------------------------------------------------------


def test_client_reads_the_fake_node(fake, node):
    assert (node.state(), node.health(), node.symptoms()) == ("READY", "HEALTHY", None)
    fake.set_node("PREEMPTED")
    assert (node.state(), node.health()) == ("PREEMPTED", None)
    assert fake.node_gets == 5 and fake.count("/discovery/tpu/v1") == 5
    assert {r.path.split("?")[0] for r in fake.requests} == {
        "/discovery/tpu/v1",
        "/v1/projects/proj/locations/us-central1-b/nodes/tpu-1",
    }


def test_client_recoverable_needs_parsed_absl_flags(node):
    # Why the supervisor does not call Client.recoverable(): outside an absl app it fails.
    if flags.FLAGS.is_parsed():
        pytest.skip("another test in this process parsed absl's flags")
    with pytest.raises(flags.UnparsedFlagAccessError, match="runtime_oom_exit"):
        node.recoverable()


def test_nothing_outside_loopback_is_reachable():
    with pytest.raises(OSError, match="metadata.google.internal"):
        urllib.request.urlopen("http://metadata.google.internal/computeMetadata/v1/", timeout=1)
    with pytest.raises(NetworkGuardError, match="outside 127.0.0.1"), socket.socket() as s:
        s.connect(("10.1.2.3", 443))


def test_a_discovery_url_that_404s_would_fall_back_to_googleapis(fake):
    # googleapiclient retries a 404 discovery document at https://tpu.googleapis.com/...;
    # the guard is what keeps that from leaving the machine.
    node = cloud_tpu.client(
        fake.node,
        fake.zone,
        fake.project,
        discovery_url=fake.root_url + "no-such-discovery/{api}/{apiVersion}",
        credentials=AnonymousCredentials(),
    )
    with pytest.raises(NetworkGuardError, match="tpu.googleapis.com"):
        node.state()
    assert fake.count("/no-such-discovery/tpu/v1") == 1


# -- the policy --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "state,health,verdict",
    [
        ("READY", "HEALTHY", "ready"),
        ("READY", "UNHEALTHY_MAINTENANCE", "wait"),
        ("READY", None, "wait"),
        ("PREEMPTED", None, "wait"),
        ("RESTARTING", None, "wait"),
        ("REIMAGING", None, "wait"),
        ("CREATING", None, "wait"),
        ("STARTING", None, "wait"),
        ("REPAIRING", "HEALTHY", "wait"),
        (None, None, "wait"),
        ("TERMINATED", None, "give_up"),
        ("DELETING", None, "give_up"),
        ("STOPPING", None, "give_up"),
        ("STOPPED", "HEALTHY", "give_up"),
    ],
)
def test_classify(state, health, verdict):
    assert cloud_tpu.classify(NodeStatus(state, health)) == verdict


def test_ready_preempted_ready_recovers_and_resumes(fake, node, clock):
    run = Run(fake, node, clock)
    start = clock()
    result = run(
        preempt_first(
            fake,
            [
                (0, "PREEMPTED", None),
                (60, "CREATING", None),
                (120, "READY", "UNHEALTHY_MAINTENANCE"),
                (150, "READY", "HEALTHY"),
            ],
        )
    )
    assert result == "finished on attempt 1"
    assert run.attempts == [0, 1]
    assert run.seen_at_start == [("READY", "HEALTHY"), ("READY", "HEALTHY")]
    assert clock() - start == 150
    assert run.lines == [
        "attempt 0 failed: UnavailableError: TPU preempted",
        "TPU tpu-1: state PREEMPTED, health -; waited 0 of 600 s, next look in 30 s",
        "TPU tpu-1: state PREEMPTED, health -; waited 30 of 600 s, next look in 30 s",
        "TPU tpu-1: state CREATING, health -; waited 60 of 600 s, next look in 30 s",
        "TPU tpu-1: state CREATING, health -; waited 90 of 600 s, next look in 30 s",
        "TPU tpu-1: state READY, health UNHEALTHY_MAINTENANCE; waited 120 of 600 s, "
        "next look in 30 s",
        "TPU tpu-1 is READY and HEALTHY again after 150 s",
        "restart 1 of at most 3: resuming from the last checkpoint",
    ]
    # Each look reads state and health; the first also the symptoms. All of it via the API.
    assert fake.node_gets == 6 * 2 + 1
    distinct = [s for i, s in enumerate(fake.served) if i == 0 or s != fake.served[i - 1]]
    assert distinct == [
        ("PREEMPTED", None),
        ("CREATING", None),
        ("READY", "UNHEALTHY_MAINTENANCE"),
        ("READY", "HEALTHY"),
    ]


def test_ready_and_healthy_after_a_failure_restarts_at_once(fake, node, clock):
    run = Run(fake, node, clock)
    attempt = preempt_first(
        fake, [(0, "READY", "HEALTHY")], tf.errors.AbortedError(None, None, "worker restarted")
    )
    assert run(attempt) == "finished on attempt 1"
    assert clock() == FakeClock()()
    assert run.lines == [
        "attempt 0 failed: AbortedError: worker restarted",
        "TPU tpu-1 is READY and HEALTHY: the failure was transient",
        "restart 1 of at most 3: resuming from the last checkpoint",
    ]


@pytest.mark.parametrize("state,health", [("PREEMPTED", None), ("READY", "UNHEALTHY_MAINTENANCE")])
def test_a_node_that_stays_unhealthy_ends_with_a_clear_error(fake, node, clock, state, health):
    config = SupervisorConfig(max_restarts=3, wait_timeout_s=100.0, poll_interval_s=30.0)
    run = Run(fake, node, clock, config)
    start = clock()
    with pytest.raises(TPURecoveryError) as err:
        run(preempt_first(fake, [(0, state, health)]))
    message = str(err.value)
    assert "giving up on TPU node 'tpu-1': it did not become READY and HEALTHY within 100 s" in (
        message
    )
    assert f"last state {state}, health {health or '-'}; waited 90 s" in message
    assert "gcloud compute tpus describe tpu-1" in message
    assert "raise SupervisorConfig.wait_timeout_s above 100 s" in message
    assert err.value.status == NodeStatus(state, health)
    assert err.value.waited_s == 90 and err.value.restarts == 0 and err.value.node == "tpu-1"
    assert isinstance(err.value.__cause__, tf.errors.UnavailableError)
    assert run.attempts == [0]
    assert clock() - start == 90  # looks at 0, 30, 60, 90; one more would pass 100 s
    # The last look is reported by the error, not logged.
    assert len([line for line in run.lines if "next look" in line]) == 3


@pytest.mark.parametrize("state", sorted(cloud_tpu.GIVE_UP_STATES))
def test_a_terminated_node_gives_up_at_once(fake, node, clock, state):
    run = Run(fake, node, clock)
    with pytest.raises(TPURecoveryError) as err:
        run(preempt_first(fake, [(0, state, None)]))
    assert (
        f"giving up on TPU node 'tpu-1': it is {state}, which does not end by itself "
        f"(last state {state}, health -; waited 0 s, 0 restart(s) so far). Start or recreate"
    ) in str(err.value)
    assert "training resumes from the last checkpoint" in str(err.value)
    assert clock() == FakeClock()() and run.attempts == [0]
    assert fake.node_gets == 2  # one look: state and health, no waiting


def test_a_node_terminated_while_waiting_gives_up_then(fake, node, clock):
    run = Run(fake, node, clock)
    with pytest.raises(TPURecoveryError, match="it is TERMINATED") as err:
        run(preempt_first(fake, [(0, "PREEMPTED", None), (45, "TERMINATED", None)]))
    assert err.value.waited_s == 60


@pytest.mark.parametrize(
    "error",
    [
        ValueError("global batch 30 is not divisible by 8"),
        FloatingPointError("loss is NaN at step 7"),
        tf.errors.InvalidArgumentError(None, None, "bad shape"),
        tf.errors.ResourceExhaustedError(None, None, "out of HBM"),
        KeyboardInterrupt(),
    ],
    ids=lambda e: type(e).__name__,
)
def test_other_errors_propagate_without_asking_the_node(fake, node, clock, error):
    run = Run(fake, node, clock)

    def attempt(restart):
        raise error

    with pytest.raises(type(error)):
        run(attempt)
    assert run.attempts == [0] and run.lines == [] and fake.requests == []


@pytest.mark.parametrize("max_restarts", [0, 2])
def test_max_restarts_is_honoured(fake, node, clock, max_restarts):
    config = SupervisorConfig(max_restarts=max_restarts, wait_timeout_s=60, poll_interval_s=10)
    run = Run(fake, node, clock, config)

    def attempt(restart):
        raise tf.errors.UnavailableError(None, None, f"socket closed #{restart}")

    with pytest.raises(TPURecoveryError) as err:
        run(attempt)
    assert run.attempts == list(range(max_restarts + 1))
    assert err.value.restarts == max_restarts
    assert (
        f"attempt {max_restarts} failed with UnavailableError: socket closed #{max_restarts} "
        f"and all {max_restarts} restart(s) are used up"
    ) in str(err.value)
    assert f"raise SupervisorConfig.max_restarts above {max_restarts}" in str(err.value)
    assert sum("failure was transient" in line for line in run.lines) == max_restarts


@pytest.mark.parametrize(
    "error",
    [
        ConnectionResetError("peer reset"),
        cloud_tpu.TPUConnectionError("could not connect to the Cloud TPU tpu='tpu-1', ..."),
        tf.errors.DeadlineExceededError(None, None, "barrier timed out"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_connection_failures_are_runtime_failures(fake, node, clock, error):
    run = Run(fake, node, clock)
    attempt = preempt_first(fake, [(0, "PREEMPTED", None), (30, "READY", "HEALTHY")], error)
    assert run(attempt) == "finished on attempt 1"
    assert run.lines[0].startswith(f"attempt 0 failed: {type(error).__name__}: ")


def _utc(seconds_ago):
    when = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=seconds_ago)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_a_fresh_runtime_oom_gives_up(fake, node, clock):
    fake.add_symptom("OUT_OF_MEMORY", _utc(5), "HBM exhausted on core 3")
    with pytest.raises(TPURecoveryError, match=r"ran out of memory \(HBM exhausted on core 3\)"):
        Run(fake, node, clock)(preempt_first(fake, [(0, "READY", "HEALTHY")]))


@pytest.mark.parametrize("seconds_ago,oom_is_fatal", [(3600, True), (5, False)])
def test_an_old_or_ignored_oom_does_not_stop_recovery(fake, node, clock, seconds_ago, oom_is_fatal):
    fake.add_symptom("OUT_OF_MEMORY", _utc(seconds_ago), "HBM exhausted")
    config = dataclasses.replace(CONFIG, oom_is_fatal=oom_is_fatal)
    run = Run(fake, node, clock, config)
    assert run(preempt_first(fake, [(0, "READY", "HEALTHY")])) == "finished on attempt 1"


def test_an_unknown_node_gives_up_at_once(fake, clock):
    run = Run(fake, node_client(fake, "no-such-tpu"), clock)
    with pytest.raises(TPURecoveryError) as err:
        run(preempt_first(fake, [(0, "READY", "HEALTHY")]))
    assert "giving up on TPU node 'no-such-tpu': the Cloud TPU API cannot describe it" in str(
        err.value
    )
    assert "HttpError 404" in str(err.value)
    assert "Check that tpu, zone and project name the node" in str(err.value)
    assert clock() == FakeClock()()


def test_an_api_outage_counts_as_not_ready_yet(fake, node, clock):
    run = Run(fake, node, clock)

    def attempt(restart):
        if restart == 0:
            fake.fail_next(2, status=503)
            raise tf.errors.UnavailableError(None, None, "TPU preempted")
        return "done"

    assert run(attempt) == "done"
    assert "API error: ValueError: Could not lookup TPU metadata" in run.lines[1]
    assert run.lines[-2] == "TPU tpu-1 is READY and HEALTHY again after 60 s"


# -- argument checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tpu,zone,project,match",
    [
        ("", "z", "p", "^tpu is empty"),
        ("n", "", "p", "^zone is empty"),
        ("n", "z", None, "^project is empty"),
        ("grpc://10.0.0.2:8470", "z", "p", "^tpu='grpc://10.0.0.2:8470' names no Cloud TPU node"),
        ("local", "z", "p", "^tpu='local' names no Cloud TPU node"),
    ],
)
def test_client_needs_a_named_node(tpu, zone, project, match):
    with pytest.raises(ValueError, match=match):
        cloud_tpu.client(tpu, zone, project)


def test_resolve_needs_a_tpu():
    with pytest.raises(ValueError, match="^tpu is empty"):
        cloud_tpu.resolve("")


@pytest.mark.parametrize(
    "name,why",
    [
        ("tpu-1", 'TPU "tpu-1" is not yet ready; state: "PREEMPTED"'),
        ("no-such-tpu", "Could not lookup TPU metadata from name 'no-such-tpu'"),
    ],
)
def test_resolve_names_the_node_when_the_tpu_cannot_be_reached(fake, name, why):
    # TPUClusterResolver asks the (fake) API for the node's endpoints and fails before
    # connecting, so this process's simulated CPU devices stay as they are.
    fake.set_node("PREEMPTED")
    with pytest.raises(cloud_tpu.TPUConnectionError) as err:
        cloud_tpu.resolve(
            name,
            fake.zone,
            fake.project,
            discovery_url=fake.discovery_url,
            credentials=AnonymousCredentials(),
        )
    assert (
        f"could not connect to the Cloud TPU tpu={name!r}, zone='us-central1-b', project='proj': "
    ) in str(err.value)
    assert why in str(err.value) and "gcloud compute tpus list" in str(err.value)
    assert "that tpu, zone and project name it" in str(err.value)
    assert len(tf.config.list_logical_devices("CPU")) == 8


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_restarts": -1}, "max_restarts must be an integer >= 0"),
        ({"wait_timeout_s": 0}, "wait_timeout_s must be > 0"),
        ({"poll_interval_s": 0}, "poll_interval_s must be > 0"),
        ({"poll_interval_s": 700}, r"at most wait_timeout_s \(600.0\)"),
    ],
)
def test_supervisor_config_is_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CONFIG, **kwargs)


# -- the launcher's flags ----------------------------------------------------------------------


def launch_cloud_tpu():
    """``hybrid.launch.cloud_tpu`` (imported when asked: it defines absl flags)."""
    return importlib.import_module("hybrid.launch.cloud_tpu")


def parsed_flags(*argv):
    values = flags.FlagValues()
    launch_cloud_tpu().define_flags(values)
    values(["prog", *argv])
    return values


def test_run_supervised_reads_the_flags():
    # Real time: a node down for 50 ms, looked at every 10 ms.
    with FakeCloudTpu(project="proj", zone="zone", node="tpu") as api:
        values = parsed_flags(
            f"--tpu_discovery_url={api.discovery_url}",
            "--tpu_anonymous_credentials",
            "--tpu_poll_interval=0.01",
            "--tpu_wait_timeout=10",
            "--tpu_max_restarts=1",
        )
        lines = []
        result = launch_cloud_tpu().run_supervised(
            preempt_first(api, [(0, "PREEMPTED", None), (0.05, "READY", "HEALTHY")]),
            "tpu",
            "zone",
            "proj",
            lines.append,
            flag_values=values,
        )
    assert result == "finished on attempt 1"
    assert lines[0] == (
        "supervising TPU node projects/proj/locations/zone/nodes/tpu: up to 1 restart(s), "
        "waiting up to 10 s for the node after a failure, looking every 0.01 s"
    )
    assert lines[-1] == "restart 1 of at most 1: resuming from the last checkpoint"
    assert any("state PREEMPTED" in line for line in lines)


def test_run_supervised_names_the_flags_when_it_gives_up():
    # Real time: a node that stays preempted for a 0.05 s wait.
    with FakeCloudTpu(project="proj", zone="zone", node="tpu") as api:
        values = parsed_flags(
            f"--tpu_discovery_url={api.discovery_url}",
            "--tpu_anonymous_credentials",
            "--tpu_poll_interval=0.01",
            "--tpu_wait_timeout=0.05",
        )
        with pytest.raises(TPURecoveryError) as err:
            launch_cloud_tpu().run_supervised(
                preempt_first(api, [(0, "PREEMPTED", None)]),
                "tpu",
                "zone",
                "proj",
                lambda line: None,
                flag_values=values,
            )
    message = str(err.value)
    assert "did not become READY and HEALTHY within 0 s" in message
    assert "raise --tpu_wait_timeout above 0.05 s" in message and "SupervisorConfig" not in message
    assert "`gcloud compute tpus describe tpu --zone=ZONE --project=PROJECT`" in message
    assert err.value.node == "tpu" and err.value.status == NodeStatus("PREEMPTED", None)
    assert isinstance(err.value.__cause__, tf.errors.UnavailableError)


def test_run_supervised_names_the_flags_when_resolve_keeps_failing():
    # The launcher's attempt calls resolve(); the node is preempted, so it fails every time.
    with FakeCloudTpu(project="proj", zone="zone", node="tpu") as api:
        api.set_node("PREEMPTED")
        values = parsed_flags(
            f"--tpu_discovery_url={api.discovery_url}",
            "--tpu_anonymous_credentials",
            "--tpu_max_restarts=0",
        )

        def attempt(restart):
            return cloud_tpu.resolve(
                "tpu",
                "zone",
                "proj",
                discovery_url=api.discovery_url,
                credentials=AnonymousCredentials(),
            )

        lines = []
        with pytest.raises(TPURecoveryError) as err:
            launch_cloud_tpu().run_supervised(
                attempt, "tpu", "zone", "proj", lines.append, flag_values=values
            )
    where = "the Cloud TPU --tpu='tpu', --tpu_zone='zone', --gcp_project='proj': "
    assert where in lines[-1] and lines[-1].startswith("attempt 0 failed: TPUConnectionError")
    message = str(err.value)
    assert where in message and "raise --tpu_max_restarts above 0" in message
    assert isinstance(err.value.__cause__, cloud_tpu.TPUConnectionError)
    assert "tpu='tpu', zone='zone'" in str(err.value.__cause__)  # the library's own terms


@pytest.mark.parametrize(
    "tpu,zone,project,match",
    [
        ("", "z", "p", r"^--tpu is empty; .* projects/<--gcp_project>/locations/<--tpu_zone>/"),
        ("n", "", "p", "^--tpu_zone is empty"),
        ("local", "z", "p", "^--tpu='local' names no Cloud TPU node"),
    ],
)
def test_run_supervised_names_the_flags_of_a_missing_node(tpu, zone, project, match):
    with pytest.raises(ValueError, match=match):
        launch_cloud_tpu().run_supervised(
            lambda restart: None, tpu, zone, project, print, flag_values=parsed_flags()
        )


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--tpu_poll_interval=0"], "--tpu_poll_interval=0.0 must be > 0"),
        (["--tpu_wait_timeout=5", "--tpu_poll_interval=10"], "at most --tpu_wait_timeout=5.0"),
        (["--tpu_wait_timeout=0"], "--tpu_wait_timeout=0.0 must be > 0"),
        (["--tpu_max_restarts=-1"], "tpu_max_restarts"),
        (["--tpu_anonymous_credentials"], "needs --tpu_discovery_url"),
    ],
)
def test_bad_flags_are_refused(argv, match):
    with pytest.raises(flags.IllegalFlagValueError, match=match):
        parsed_flags(*argv)


# -- end to end: real training, preempted mid-run ----------------------------------------------


def _trainer():
    from hybrid.run import train_config, trainer

    names = set(train_config.FIELDS)
    takes_callback = "step_callback" in inspect.signature(trainer.train).parameters
    if not {"model_dir", "checkpoint_every"} <= names or not takes_callback:
        pytest.skip("hybrid.run.trainer.train has no model_dir/checkpoint_every/step_callback yet")
    return trainer


def tiny_config(trainer, model_dir):
    from hybrid.run import train_config

    return train_config.TrainConfig.of(
        model="mlp",
        data="synthetic",
        mesh="stage:2;replica:1",
        micro_batches=2,
        global_batch_size=16,
        train_steps=6,
        width=16,
        depth=2,
        jit_compile=False,
        seed=3,
        log_every=1,
        model_dir=str(model_dir),
        checkpoint_every=2,
    )


def test_training_preempted_at_step_3_resumes_and_matches_an_uninterrupted_run(
    fake, node, clock, tmp_path
):
    trainer = _trainer()
    reference = trainer.train(tiny_config(trainer, tmp_path / "reference"), log=lambda _: None)

    config = tiny_config(trainer, tmp_path / "supervised")
    steps: dict[int, list[int]] = {}
    lines: list[str] = []

    def attempt(restart):
        def inject(step, loss):
            steps.setdefault(restart, []).append(step)
            if restart == 0 and step == 3:
                fake.timeline([(0, "PREEMPTED", None), (90, "READY", "HEALTHY")])
                raise tf.errors.UnavailableError(None, None, "TPU preempted")

        return trainer.train(config, log=lines.append, step_callback=inject)

    result = cloud_tpu.supervise(
        attempt, node, CONFIG, log=lines.append, sleep=clock.sleep, clock=clock
    )
    assert steps[0] == [1, 2, 3]
    assert steps[1][0] == 3, f"attempt 1 did not resume from the step-2 checkpoint: {lines}"
    assert steps[1][-1] == 6 and result.start_step == 2 and reference.start_step == 0
    assert "attempt 0 failed: UnavailableError: TPU preempted" in lines
    assert "TPU tpu-1 is READY and HEALTHY again after 90 s" in lines
    got, want = result.pipeline.get_weights(), reference.pipeline.get_weights()
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
