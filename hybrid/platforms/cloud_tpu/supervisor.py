"""Supervise a training run on a Cloud TPU through preemptions.

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
its last state and health, how long the supervisor waited and what to do next (in terms of
``SupervisorConfig`` fields, e.g. ``SupervisorConfig.wait_timeout_s``).

The supervisor decides from ``Client.state()``, ``health()`` and ``symptoms()`` itself rather
than calling ``Client.recoverable()``, for two reasons: ``recoverable()`` reads absl's
``runtime_oom_exit`` flag, which raises ``UnparsedFlagAccessError`` in a program that is not
an absl app (a notebook, a test, a library caller); and it calls a PREEMPTED node
unrecoverable, whereas a preemptible node or a queued resource comes back READY under the
same name, so the supervisor waits for it (bounded by ``wait_timeout_s``). Its other rules
are kept: TERMINATED gives up, and so does a runtime OOM reported in the last 90 s
(``SupervisorConfig.oom_is_fatal`` stands in for the flag).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Literal, TypeVar

import tensorflow as tf

from hybrid.platforms.cloud_tpu.node import (
    NodeStatus,
    TPUConnectionError,
    TPUNodeClient,
    fresh_oom,
    is_permanent,
    read_status,
)

__all__ = [
    "GIVE_UP_STATES",
    "RUNTIME_ERRORS",
    "SupervisorConfig",
    "TPURecoveryError",
    "classify",
    "supervise",
    "wait_until_healthy",
]

T = TypeVar("T")
Log = Callable[[str], None]
Verdict = Literal["ready", "wait", "give_up"]

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

_OOM_HINT = (
    "A restart would run out of memory again: use a smaller batch or model, more "
    "micro-batches or remat."
)


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
        90 s (cloud_tpu_client's ``runtime_oom_exit`` rule: a restart would run out of
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


# -- messages ----------------------------------------------------------------------------------


def _describe(name: str) -> str:
    """The gcloud command that shows node ``name``."""
    return f"`gcloud compute tpus describe {name} --zone=ZONE --project=PROJECT`"


def _one_line(err: BaseException) -> str:
    """``ErrorType: first line of its message``."""
    text = str(getattr(err, "message", None) or err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


# -- waiting for the node ----------------------------------------------------------------------


@dataclasses.dataclass
class _Wait:
    """One wait for a node: the clock it started on, and what the last look saw."""

    name: str
    restarts: int
    clock: Callable[[], float]
    start: float
    status: NodeStatus = NodeStatus(None, None)
    api_error: BaseException | None = None

    def waited(self) -> float:
        """Seconds since the wait began."""
        return self.clock() - self.start

    def give_up(self, why: str, todo: str) -> TPURecoveryError:
        """The error that ends the wait: ``why``, the last status and time, and ``todo``."""
        waited = self.waited()
        return TPURecoveryError(
            f"giving up on TPU node {self.name!r}: {why} (last {self.status}; waited "
            f"{waited:.0f} s, {self.restarts} restart(s) so far). {todo}",
            self.name,
            self.status,
            waited,
            self.restarts,
        )


def _look(node: TPUNodeClient, wait: _Wait) -> Verdict:
    """Reads the node into ``wait`` and classifies it; an API error counts as "wait".

    Raises:
      TPURecoveryError: the API cannot describe the node (HTTP 4xx), or it is in a give-up
        state.
    """
    try:
        wait.status, wait.api_error = read_status(node), None
    except Exception as err:  # any failure to read the API: classified and reported here
        if is_permanent(err):
            raise wait.give_up(
                f"the Cloud TPU API cannot describe it: {_one_line(err)}",
                "Check that tpu, zone and project name the node, and the credentials of this VM.",
            ) from err
        wait.status, wait.api_error = NodeStatus(None, None), err
    verdict = classify(wait.status)
    if verdict == "give_up":
        raise wait.give_up(
            f"it is {wait.status.state}, which does not end by itself",
            f"Start or recreate the node ({_describe(wait.name)}), then run again: training "
            "resumes from the last checkpoint.",
        )
    return verdict


def _check_oom(node: TPUNodeClient, wait: _Wait) -> None:
    """Raises TPURecoveryError if the node reports a runtime OOM of the last 90 s."""
    oom = fresh_oom(node)
    if oom is not None:
        raise wait.give_up(f"its runtime ran out of memory ({oom})", _OOM_HINT)


def _timed_out(wait: _Wait, config: SupervisorConfig) -> TPURecoveryError:
    """The error for a node still not READY and HEALTHY after ``config.wait_timeout_s``."""
    timeout = config.wait_timeout_s
    last = f"; last API error {_one_line(wait.api_error)}" if wait.api_error is not None else ""
    return wait.give_up(
        f"it did not become READY and HEALTHY within {timeout:.0f} s{last}",
        f"Look at the node ({_describe(wait.name)}); wait longer (raise "
        f"SupervisorConfig.wait_timeout_s above {timeout:g} s) or run again later: training "
        "resumes from the last checkpoint.",
    )


def _ready_line(name: str, look: int, waited: float) -> str:
    """The log line of the look (0: the first) that found the node READY and HEALTHY."""
    if look == 0:
        return f"TPU {name} is READY and HEALTHY: the failure was transient"
    return f"TPU {name} is READY and HEALTHY again after {waited:.0f} s"


def _waiting_line(wait: _Wait, waited: float, config: SupervisorConfig) -> str:
    """The log line of a look that found the node not ready yet."""
    reason = f" (API error: {_one_line(wait.api_error)})" if wait.api_error is not None else ""
    return (
        f"TPU {wait.name}: {wait.status}{reason}; waited {waited:.0f} of "
        f"{config.wait_timeout_s:.0f} s, next look in {config.poll_interval_s:g} s"
    )


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
    wait = _Wait(node.name(), restarts, clock, clock())
    oom_checked = not config.oom_is_fatal  # else: on the first look the API answers
    for look in range(1 + int(config.wait_timeout_s // config.poll_interval_s)):
        verdict = _look(node, wait)
        if not oom_checked and wait.api_error is None:
            oom_checked = True
            _check_oom(node, wait)
        waited = wait.waited()
        if verdict == "ready":
            log(_ready_line(wait.name, look, waited))
            return waited
        if waited + config.poll_interval_s > config.wait_timeout_s:
            break
        log(_waiting_line(wait, waited, config))
        sleep(config.poll_interval_s)
    raise _timed_out(wait, config)


# -- the supervisor ----------------------------------------------------------------------------


def _restarts_used_up(
    node: TPUNodeClient, err: BaseException, restart: int, config: SupervisorConfig
) -> TPURecoveryError:
    """The error for attempt ``restart`` failing with ``err`` when no restart is left."""
    return TPURecoveryError(
        f"giving up on TPU node {node.name()!r}: attempt {restart} failed with "
        f"{_one_line(err)} and all {config.max_restarts} restart(s) are used up. If the "
        f"failures are preemptions, allow more (raise SupervisorConfig.max_restarts above "
        f"{config.max_restarts}); if the same step fails every time, look at that step.",
        node.name(),
        NodeStatus(None, None),
        0.0,
        restart,
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
                raise _restarts_used_up(node, err, restart, config) from err
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
