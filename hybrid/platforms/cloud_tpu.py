"""Cloud TPU: connect to a node, and supervise a training run through preemptions.

The supervisor computes, for a training ``attempt(restart)`` that restores the latest
checkpoint itself and trains to the end::

    for restart in range(max_restarts + 1):
        try:
            return attempt(restart)
        except <a runtime failure: TPU unavailable, aborted, connection lost, resolve() failed>:
            if restart == max_restarts:            give up (too many restarts)
            ask the Cloud TPU API for the node's state and health
            TERMINATED, DELETING, STOPPING, STOPPED, or a fresh runtime OOM:   give up
            READY and HEALTHY:                     a transient failure, restart at once
            anything else (PREEMPTED, RESTARTING, REPAIRING, CREATING, ...):
                poll every poll_interval_s until READY and HEALTHY, then restart;
                give up if wait_timeout_s passes first or the node reaches a give-up state

Any other exception (a ValueError, a NaN loss, KeyboardInterrupt) propagates at once: a
restart would only repeat it. Giving up raises ``TPURecoveryError``, which names the node,
its last state and health, how long the supervisor waited and what to do next.

The supervisor decides from ``Client.state()``, ``health()`` and ``symptoms()`` itself rather
than calling ``Client.recoverable()``, for two reasons: ``recoverable()`` reads absl's
``--runtime_oom_exit``, which raises ``UnparsedFlagAccessError`` in a program that is not an
absl app (a notebook, a test, a library caller); and it calls a PREEMPTED node unrecoverable,
whereas a preemptible node or a queued resource comes back READY under the same name, so the
supervisor waits for it (bounded by ``wait_timeout_s``). Its other rules are kept: TERMINATED
gives up, and so does a runtime OOM reported in the last 90 s (``SupervisorConfig.oom_is_fatal``
stands in for the flag).
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol, TypeVar

import tensorflow as tf

__all__ = [
    "GIVE_UP_STATES",
    "RUNTIME_ERRORS",
    "NodeStatus",
    "SupervisorConfig",
    "TPUConnectionError",
    "TPUNodeClient",
    "TPURecoveryError",
    "TPUSystem",
    "classify",
    "client",
    "resolve",
    "supervise",
    "wait_until_healthy",
]

T = TypeVar("T")
Log = Callable[[str], None]
Verdict = Literal["ready", "wait", "give_up"]


class TPUConnectionError(RuntimeError):
    """The TPU named by --tpu/--tpu_zone/--gcp_project could not be found or initialised."""


# Failures of the TPU runtime or of the connection to it, as a training step reports them when
# the TPU goes away (preemption, maintenance, a worker restart), and resolve() failing at the
# start of an attempt (the node may still be coming back; if it does not exist, the API says
# so and the supervisor gives up at once). Anything else is a bug or a property of the run and
# is not retried.
RUNTIME_ERRORS: tuple[type[BaseException], ...] = (
    TPUConnectionError,
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.InternalError,
    tf.errors.DeadlineExceededError,
    tf.errors.CancelledError,
    tf.errors.UnknownError,
    ConnectionError,
)

# Node states that do not end by themselves: someone deleted, stopped or lost the node.
GIVE_UP_STATES = frozenset({"TERMINATED", "DELETING", "STOPPING", "STOPPED"})

_OOM_COOL_DOWN = datetime.timedelta(seconds=90)  # the same window as cloud_tpu_client's
_OOM_HINT = (
    "A restart would run out of memory again: use a smaller batch or model, more "
    "micro-batches or remat."
)
_INSTALL_HINT = (
    "install the tpu extra in the same pip call as everything else, e.g. "
    "`make install EXTRAS=test,plot,tpu` or `pip install -e '.[tpu]'`"
)


class TPUNodeClient(Protocol):
    """What the supervisor reads of a node (``cloud_tpu_client.Client`` has all of it)."""

    def name(self) -> str: ...

    def state(self) -> str | None: ...

    def health(self) -> str | None: ...

    def symptoms(self) -> list[dict[str, Any]] | None: ...


class NodeStatus(NamedTuple):
    """A node's ``state`` and ``health`` fields (None where the API reported none)."""

    state: str | None
    health: str | None

    def __str__(self) -> str:
        return f"state {self.state or '-'}, health {self.health or '-'}"


class TPURecoveryError(RuntimeError):
    """The supervisor gave up: the node will not come back, or the run keeps failing.

    Attributes:
      node: the node's name.
      status: its last known state and health (None fields when it could not be read).
      waited_s: seconds spent waiting for it after the last failure.
      restarts: restarts made before giving up.
    """

    def __init__(
        self, message: str, node: str, status: NodeStatus, waited_s: float, restarts: int
    ) -> None:
        super().__init__(message)
        self.node, self.status, self.waited_s, self.restarts = node, status, waited_s, restarts


@dataclasses.dataclass(frozen=True)
class SupervisorConfig:
    """How patiently the supervisor restarts a run.

    Attributes:
      max_restarts: restarts allowed over the whole run (0: fail on the first failure).
      wait_timeout_s: longest wait, after one failure, for the node to be READY and HEALTHY.
      poll_interval_s: seconds between two looks at the node while waiting.
      oom_is_fatal: give up when the node reports a runtime OUT_OF_MEMORY symptom in the last
        90 s (cloud_tpu_client's ``--runtime_oom_exit`` rule: a restart would run out of
        memory again).
    """

    max_restarts: int = 10
    wait_timeout_s: float = 1800.0
    poll_interval_s: float = 30.0
    oom_is_fatal: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if not self.wait_timeout_s > 0:
            raise ValueError(f"wait_timeout_s must be > 0 seconds, got {self.wait_timeout_s!r}")
        if not 0 < self.poll_interval_s <= self.wait_timeout_s:
            raise ValueError(
                f"poll_interval_s must be > 0 and at most wait_timeout_s ({self.wait_timeout_s}),"
                f" got {self.poll_interval_s!r}"
            )


# -- connecting --------------------------------------------------------------------------------


class TPUSystem(NamedTuple):
    """A connected, initialised TPU system."""

    resolver: Any  # tf.distribute.cluster_resolver.TPUClusterResolver
    topology: Any  # tf.tpu.experimental.Topology
    devices: tuple[str, ...]


def resolve(
    tpu: str,
    zone: str | None = None,
    project: str | None = None,
    *,
    discovery_url: str | None = None,
    credentials: Any = "default",
) -> TPUSystem:
    """Finds the TPU, connects this process to it and initialises its TPU system.

    Computes ``TPUClusterResolver(tpu, zone, project)``, then
    ``experimental_connect_to_cluster`` and ``initialize_tpu_system`` on it. Call it at the
    start of every attempt: after a preemption the TPU system must be initialised again.

    Args:
      tpu: the node's name (``--tpu``), a ``grpc://`` address, or ``"local"`` on a TPU VM.
      zone: its zone (``--tpu_zone``); None lets the resolver ask the GCE metadata server.
      project: its project (``--gcp_project``); None: as for ``zone``.
      discovery_url: a Cloud TPU API discovery URL other than Google's.
      credentials: as for ``client()``.

    Returns:
      The resolver, the TPU topology and the names of the TPU devices.

    Raises:
      ValueError: ``tpu`` is empty.
      TPUConnectionError: the TPU could not be looked up, reached or initialised.
    """
    if not tpu:
        raise ValueError("--tpu is empty; pass the Cloud TPU node's name (or 'local' on a TPU VM)")
    where = f"--tpu={tpu!r} --tpu_zone={zone!r} --gcp_project={project!r}"
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
            tpu=tpu,
            zone=zone,
            project=project,
            credentials=credentials,
            discovery_url=discovery_url,
        )
        tf.config.experimental_connect_to_cluster(resolver)
        topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as err:
        raise TPUConnectionError(
            f"could not connect to the Cloud TPU {where}: {err}. Check that the node exists "
            "and is READY (`gcloud compute tpus list --zone=ZONE --project=PROJECT`), that the "
            "three flags name it, and that this VM may use it"
        ) from err
    devices = tuple(d.name for d in tf.config.list_logical_devices("TPU"))
    if not devices:
        raise TPUConnectionError(f"the TPU system of {where} is initialised but has no TPU cores")
    return TPUSystem(resolver, topology, devices)


def client(
    tpu: str,
    zone: str,
    project: str,
    *,
    discovery_url: str | None = None,
    service: Any = None,
    credentials: Any = "default",
) -> TPUNodeClient:
    """A ``cloud_tpu_client.Client`` that reads node ``projects/project/locations/zone/nodes/tpu``.

    Zone and project must be given: the client would otherwise ask the GCE metadata server.

    Args:
      tpu: the node's name (``--tpu``); not a ``grpc://`` address or ``"local"``, which name
        no node the API could describe.
      zone: the node's zone (``--tpu_zone``).
      project: the node's project (``--gcp_project``).
      discovery_url: the API's discovery URL template (``{api}``, ``{apiVersion}``), e.g. a
        local fake; the ``TPU_API_DISCOVERY_URL`` environment variable, when set, wins (a
        rule of cloud_tpu_client).
      service: a ready ``googleapiclient`` service to use instead of building one per call.
      credentials: ``"default"`` (application default credentials) or a google-auth /
        oauth2client credentials object, e.g. ``google.auth.credentials.AnonymousCredentials()``
        for a local fake.

    Returns:
      The client.

    Raises:
      ValueError: a missing or unusable ``tpu``, ``zone`` or ``project``.
      ImportError: cloud-tpu-client is not installed.
    """
    for flag, value in (("--tpu", tpu), ("--tpu_zone", zone), ("--gcp_project", project)):
        if not value:
            raise ValueError(
                f"{flag} is empty; the TPU supervisor asks the Cloud TPU API about node "
                "projects/<--gcp_project>/locations/<--tpu_zone>/nodes/<--tpu> and needs all three"
            )
    if tpu.startswith("grpc://") or tpu == "local":
        raise ValueError(
            f"--tpu={tpu!r} names no Cloud TPU node, so the supervisor cannot ask for its state; "
            "pass the node's name as shown by `gcloud compute tpus list`"
        )
    try:
        from cloud_tpu_client import Client
    except ImportError as err:
        raise ImportError(f"the TPU supervisor needs cloud-tpu-client; {_INSTALL_HINT}") from err
    node: TPUNodeClient = Client(
        tpu=tpu,
        zone=zone,
        project=project,
        credentials=credentials,
        service=service,
        discovery_url=discovery_url,
    )
    return node


# -- the policy --------------------------------------------------------------------------------


def classify(status: NodeStatus) -> Verdict:
    """What a node's state and health mean for a restart.

    Returns:
      ``"ready"`` for READY and HEALTHY; ``"give_up"`` for a state in ``GIVE_UP_STATES``;
      ``"wait"`` for everything else (PREEMPTED, RESTARTING, REIMAGING, CREATING, STARTING,
      REPAIRING, READY but not HEALTHY, or a state the API did not report): all either end in
      READY by themselves or are cut short by the wait timeout.
    """
    if status.state in GIVE_UP_STATES:
        return "give_up"
    if status.state == "READY" and status.health == "HEALTHY":
        return "ready"
    return "wait"


def _read_status(node: TPUNodeClient) -> NodeStatus:
    return NodeStatus(node.state(), node.health())


def _http_status(err: BaseException) -> int | None:
    """The HTTP status behind an API error (cloud_tpu_client wraps HttpError in ValueError)."""
    seen: BaseException | None = err
    for _ in range(4):
        if seen is None:
            return None
        resp = getattr(seen, "resp", None)
        status = getattr(resp, "status", None)
        if isinstance(status, int):
            return status
        seen = seen.__cause__ or seen.__context__
    return None


def _is_permanent(err: BaseException) -> bool:
    """A client error (wrong name, project, permissions) will not go away by asking again."""
    status = _http_status(err)
    return status is not None and 400 <= status < 500 and status not in (408, 429)


def _recent_oom(symptoms: list[dict[str, Any]] | None, now: datetime.datetime) -> str | None:
    """The details of an OUT_OF_MEMORY symptom created less than 90 s before ``now``."""
    for symptom in reversed(symptoms or []):
        if symptom.get("symptomType") != "OUT_OF_MEMORY":
            continue
        try:
            created = datetime.datetime.strptime(
                str(symptom.get("createTime", ""))[:19], "%Y-%m-%dT%H:%M:%S"
            ).replace(tzinfo=datetime.timezone.utc)
        except ValueError:
            continue
        if now - created < _OOM_COOL_DOWN:
            return str(symptom.get("details") or "runtime out of memory")
    return None


def _fresh_oom(node: TPUNodeClient) -> str | None:
    try:
        symptoms = node.symptoms()
    except Exception:  # symptoms are advisory: the state and health decide
        return None
    return _recent_oom(symptoms, datetime.datetime.now(datetime.timezone.utc))


def _describe(name: str) -> str:
    return f"`gcloud compute tpus describe {name} --zone=ZONE --project=PROJECT`"


def _one_line(err: BaseException) -> str:
    text = str(getattr(err, "message", None) or err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def wait_until_healthy(
    node: TPUNodeClient,
    config: SupervisorConfig,
    *,
    log: Log,
    restarts: int = 0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> float:
    """Polls ``node`` until it is READY and HEALTHY, or gives up.

    Conceptually::

        start = clock()
        while classify(state, health) == "wait" and clock() - start + poll <= timeout:
            sleep(poll)

    The first answered look also checks the node's symptoms for a fresh runtime OOM (when
    ``config.oom_is_fatal``). An API error that asking again cannot fix (HTTP 4xx: no such
    node, no permission) gives up at once; other API errors count as "not ready yet".

    ``Client.wait_for_healthy()`` is not used: it looks at health only (a TERMINATED node is
    waited for until the timeout), and it sleeps on the real clock.

    Args:
      node: the node's client.
      config: the timeout and the polling interval.
      log: receives one line per look at the node.
      restarts: restarts made so far (for the error).
      sleep: waits this many seconds (injectable for tests).
      clock: monotonic seconds (injectable for tests).

    Returns:
      Seconds waited until the node was READY and HEALTHY (0 when it was at once).

    Raises:
      TPURecoveryError: the node is in a give-up state, reports a fresh OOM, cannot be read,
        or is still not READY and HEALTHY after ``config.wait_timeout_s``.
    """
    name = node.name()
    start = clock()
    status = NodeStatus(None, None)
    api_error: BaseException | None = None
    oom_checked = not config.oom_is_fatal  # else: on the first look the API answers

    def give_up(why: str, todo: str) -> TPURecoveryError:
        waited = clock() - start
        return TPURecoveryError(
            f"giving up on TPU node {name!r}: {why} (last {status}; waited {waited:.0f} s, "
            f"{restarts} restart(s) so far). {todo}",
            name,
            status,
            waited,
            restarts,
        )

    for look in range(1 + int(config.wait_timeout_s // config.poll_interval_s)):
        try:
            status, api_error = _read_status(node), None
        except Exception as err:  # any failure to read the API: classified and reported below
            if _is_permanent(err):
                raise give_up(
                    f"the Cloud TPU API cannot describe it: {_one_line(err)}",
                    "Check --tpu, --tpu_zone, --gcp_project and the credentials of this VM.",
                ) from err
            status, api_error = NodeStatus(None, None), err
        verdict = classify(status)
        if verdict == "give_up":
            raise give_up(
                f"it is {status.state}, which does not end by itself",
                f"Start or recreate the node ({_describe(name)}), then run again: training "
                "resumes from the last checkpoint.",
            )
        if not oom_checked and api_error is None:
            oom_checked, oom = True, _fresh_oom(node)
            if oom is not None:
                raise give_up(f"its runtime ran out of memory ({oom})", _OOM_HINT)
        waited = clock() - start
        if verdict == "ready":
            if look == 0:
                log(f"TPU {name} is READY and HEALTHY: the failure was transient")
            else:
                log(f"TPU {name} is READY and HEALTHY again after {waited:.0f} s")
            return waited
        if waited + config.poll_interval_s > config.wait_timeout_s:
            break
        reason = f" (API error: {_one_line(api_error)})" if api_error is not None else ""
        log(
            f"TPU {name}: {status}{reason}; waited {waited:.0f} of {config.wait_timeout_s:.0f} s,"
            f" next look in {config.poll_interval_s:g} s"
        )
        sleep(config.poll_interval_s)
    last_error = f"; last API error {_one_line(api_error)}" if api_error is not None else ""
    raise give_up(
        f"it did not become READY and HEALTHY within {config.wait_timeout_s:.0f} s{last_error}",
        f"Look at the node ({_describe(name)}); wait longer (--tpu_wait_timeout) or run again "
        "later: training resumes from the last checkpoint.",
    )


def supervise(
    attempt: Callable[[int], T],
    node: TPUNodeClient,
    config: SupervisorConfig = SupervisorConfig(),  # noqa: B008 - frozen, so sharing is safe
    *,
    log: Log,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Runs ``attempt(0)``, and after each runtime failure waits for the node and runs the next.

    See the module docstring for the policy. ``attempt(restart)`` must restore the latest
    checkpoint itself (and, on a real TPU, call ``resolve()`` again) and train to the end.

    Args:
      attempt: one training attempt; receives the restart index 0, 1, ...
      node: the node's client (``client(...)``).
      config: restart bound, wait timeout and polling interval.
      log: receives one line per failure, per look at the node and per restart.
      sleep: waits this many seconds (injectable for tests).
      clock: monotonic seconds (injectable for tests).

    Returns:
      What the first attempt that finishes returns.

    Raises:
      TPURecoveryError: the node will not come back, or ``config.max_restarts`` restarts
        were used up; chained from the last runtime failure.
      Exception: anything ``attempt`` raises that is not in ``RUNTIME_ERRORS``, at once.
    """
    restart = 0
    while True:
        try:
            return attempt(restart)
        except RUNTIME_ERRORS as err:
            log(f"attempt {restart} failed: {_one_line(err)}")
            if restart >= config.max_restarts:
                raise TPURecoveryError(
                    f"giving up on TPU node {node.name()!r}: attempt {restart} failed with "
                    f"{_one_line(err)} and all {config.max_restarts} restart(s) are used up. "
                    "If the failures are preemptions, allow more (--tpu_max_restarts); if the "
                    "same step fails every time, look at that step.",
                    node.name(),
                    NodeStatus(None, None),
                    0.0,
                    restart,
                ) from err
            try:
                wait_until_healthy(
                    node, config, log=log, restarts=restart, sleep=sleep, clock=clock
                )
            except TPURecoveryError as gave_up:
                raise gave_up from err
        restart += 1
        log(
            f"restart {restart} of at most {config.max_restarts}: resuming from the last checkpoint"
        )
