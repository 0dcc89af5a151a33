"""The tasks of a TensorFlow cluster: its spec, their devices, which answer, and the errors.

A task is one ``tf.distribute.Server`` at an address. :func:`spec_from` normalises the ways
of naming a cluster to a ``tf.train.ClusterSpec``, :func:`task_devices` lists each task's
devices once connected, :func:`unreachable` probes the tasks' gRPC servers with a deadline
(TensorFlow's own connection has none), and the ``*_error`` functions build the errors that
name lost tasks.

Errors name a task's server as the call that starts it, ``start_server(cluster,
job='worker', task_index=1)`` (see :func:`start_call`); launchers may reword that form.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import tensorflow as tf

__all__ = [
    "ClusterError",
    "ClusterLike",
    "Task",
    "UnreachableTaskError",
    "dropped_error",
    "job_tasks",
    "lost_error",
    "restarted_error",
    "spec_from",
    "start_call",
    "task_devices",
    "tasks_named_in",
    "unreachable",
    "unreachable_error",
]

# A ClusterResolver, a tf.train.ClusterSpec, a {job: [address, ...]} mapping, a TF_CONFIG
# shaped mapping ({"cluster": {...}, "task": {...}}), their JSON text, a connected Cluster,
# or None for the TF_CONFIG environment variable.
ClusterLike: TypeAlias = Any

_TASK_NAME = re.compile(r"/job:([\w-]+)/replica:\d+/task:(\d+)")
_ROOT_ERROR = re.compile(r"^\s*(?:\(\d+\)\s*)?([A-Z_]+):\s*(.+)$", re.MULTILINE)
_PROBE_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


class ClusterError(RuntimeError):
    """The cluster cannot be used as asked (a task is missing, the connection failed)."""


class UnreachableTaskError(ClusterError):
    """One or more tasks do not answer; ``tasks`` names them."""

    def __init__(self, message: str, tasks: Sequence[Task]) -> None:
        super().__init__(message)
        self.tasks = tuple(tasks)


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of the cluster: a ``tf.distribute.Server`` at ``address``."""

    job: str
    index: int
    address: str

    @property
    def name(self) -> str:
        """The device-name prefix of the task's devices."""
        return f"/job:{self.job}/replica:0/task:{self.index}"

    def __str__(self) -> str:
        return f"{self.job} task {self.index} ({self.address})"


def start_call(task: Task) -> str:
    """The call that serves ``task``, as errors print it:
    ``start_server(cluster, job='worker', task_index=1)``."""
    return f"start_server(cluster, job={task.job!r}, task_index={task.index})"


# -- cluster specs -----------------------------------------------------------------------


def spec_from(cluster: ClusterLike = None) -> tf.train.ClusterSpec:
    """Normalises a :data:`ClusterLike` other than a connected ``Cluster`` to a
    ``tf.train.ClusterSpec`` (``hybrid.platforms.cluster.cluster_spec`` takes those too).

    Raises:
      ValueError: the value (or TF_CONFIG) holds no usable cluster.
    """
    if isinstance(cluster, tf.train.ClusterSpec):
        spec = cluster
    elif isinstance(cluster, tf.distribute.cluster_resolver.ClusterResolver):
        spec = cluster.cluster_spec()
    else:
        spec = tf.train.ClusterSpec(_jobs_of(cluster))
    if not spec.jobs:
        raise ValueError(f"the cluster spec {spec.as_dict()} has no jobs")
    return spec


def _jobs_of(cluster: Any) -> dict[str, Any]:
    """The ``{job: addresses}`` of a mapping, its JSON text, or (None) TF_CONFIG."""
    if cluster is None:
        text = os.environ.get("TF_CONFIG")
        if not text:
            raise ValueError(
                "no cluster given and TF_CONFIG is not set; pass a ClusterSpec, a "
                'ClusterResolver or a mapping like {"worker": ["host0:2222", '
                '"host1:2222"]}, or set TF_CONFIG'
            )
        cluster = text
    if isinstance(cluster, str):
        try:
            cluster = json.loads(cluster)
        except json.JSONDecodeError as err:
            raise ValueError(f"cluster {cluster!r} is not valid JSON: {err}") from err
    if not isinstance(cluster, Mapping):
        raise ValueError(
            f"cannot make a cluster spec from {type(cluster).__name__}; pass a ClusterSpec, "
            'a ClusterResolver or a mapping like {"worker": ["host0:2222"]}'
        )
    return dict(cluster.get("cluster", cluster))  # a TF_CONFIG dict nests the cluster


def tasks_named_in(tasks: Sequence[Task], text: str) -> list[Task]:
    """The tasks among ``tasks`` whose device-name prefix (``/job:J/replica:0/task:I``)
    occurs in ``text``, in the order of ``tasks``."""
    named = {(m.group(1), int(m.group(2))) for m in _TASK_NAME.finditer(text)}
    return [t for t in tasks if (t.job, t.index) in named]


def job_tasks(spec: tf.train.ClusterSpec, job: str) -> tuple[Task, ...]:
    """The tasks of ``job`` in ``spec``, by index.

    Raises:
      ValueError: the spec has no job ``job``.
    """
    if job not in spec.jobs:
        raise ValueError(
            f"the cluster has no job {job!r} (its jobs: {sorted(spec.jobs)}); pass one of "
            "those as job"
        )
    return tuple(Task(job, i, spec.task_address(job, i)) for i in spec.task_indices(job))


# -- probing -----------------------------------------------------------------------------


def unreachable(tasks: Sequence[Task], timeout_s: float) -> tuple[Task, ...]:
    """The tasks whose gRPC server does not accept a connection within ``timeout_s``.

    All tasks are probed at once, each until it answers or the deadline passes; a task that
    starts within the deadline counts as reachable.
    """
    import grpc  # a TensorFlow dependency; only the probe needs it

    channels = [grpc.insecure_channel(t.address, options=_PROBE_OPTIONS) for t in tasks]
    futures = [grpc.channel_ready_future(c) for c in channels]
    deadline = time.monotonic() + timeout_s
    down = []
    try:
        for task, future in zip(tasks, futures, strict=True):
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except grpc.FutureTimeoutError:
                down.append(task)
    finally:
        for future in futures:
            future.cancel()
        for channel in channels:
            channel.close()
    return tuple(down)


def unreachable_error(down: Sequence[Task], timeout_s: float, what: str) -> UnreachableTaskError:
    """The error for tasks ``down`` that did not answer within ``timeout_s``: each task, its
    address and device-name prefix, and the call that starts its server."""
    names = "; ".join(f"{t} [{t.name}]" for t in down)
    starts = " and ".join(f"`{start_call(t)}`" for t in down)
    return UnreachableTaskError(
        f"{what}: {names} did not answer within {timeout_s:g} s. Run {starts} on that host "
        "(or check the address, port and firewall), then run the client again",
        down,
    )


def lost_error(down: Sequence[Task], err: tf.errors.OpError) -> UnreachableTaskError:
    """The error for a job step that failed with ``err`` because tasks ``down`` stopped
    answering: the tasks, the root error, and the restart that recovers."""
    names = "; ".join(f"{t} [{t.name}]" for t in down)
    return UnreachableTaskError(
        f"lost {names} during the job {_what(err)}. This process cannot reconnect: restart "
        f"that worker (`{start_call(down[0])}` in a new process on its host; every worker "
        "when a stage's replica group spans tasks), then restart the client (from its last "
        "checkpoint)",
        down,
    )


def dropped_error(named: Sequence[Task], err: tf.errors.OpError) -> UnreachableTaskError:
    """The error for an UNAVAILABLE ``err`` while every task answers: the connection to
    ``named`` (the tasks its message names) dropped, e.g. because a task restarted."""
    return UnreachableTaskError(
        f"a connection to {', '.join(map(str, named)) or 'the cluster'} failed during "
        f"the job {_what(err)}, though every task answers now: a task may have restarted "
        "and lost its state. Restart the client (from its last checkpoint)",
        named,
    )


def restarted_error(tasks: Sequence[Task], err: tf.errors.OpError) -> UnreachableTaskError:
    """The error for a collective that ``err`` refused because some of ``tasks`` restarted
    while the others kept their state of the previous client's collectives (TensorFlow's
    group leader and device caches keep each device's incarnation for the life of the
    process): every worker must restart."""
    named = [t for t in tasks if any(t.name == n for n in _RESTARTED.findall(err.message))]
    who = ", ".join(map(str, named)) or "a task"
    return UnreachableTaskError(
        f"{who} restarted, but the other workers kept the previous client's collective "
        "state (TensorFlow: its devices' incarnation changed): a replica group that spans "
        "tasks needs every worker restarted after one is lost. Restart all the workers, "
        "then the client (from its last checkpoint)",
        named,
    )


# A device whose incarnation no longer matches a collective's record of it.
_RESTARTED = re.compile(
    r"(/job:[^/\s]+/replica:\d+/task:\d+)/device:\S*?\s*(?:current incarnation|exists in cache)"
)


def _what(err: tf.errors.OpError) -> str:
    """``(ErrorType: first root error)`` of a TensorFlow error, on one line."""
    found = _ROOT_ERROR.search(err.message)
    if found:
        summary = f"{found.group(1)}: {found.group(2).strip()}"
    else:
        lines = err.message.strip().splitlines()
        summary = lines[0] if lines else err.__class__.__name__
    return f"({type(err).__name__}: {summary})"


# -- devices -----------------------------------------------------------------------------


def _device_index(name: str) -> int:
    """The index of a device name (0 when it has none)."""
    return int(tf.DeviceSpec.from_string(name).device_index or 0)


def task_devices(
    tasks: Sequence[Task], device_type: str | None = None
) -> tuple[tuple[str, ...], ...]:
    """Per task: the names of its logical devices of ``device_type``, by device index.

    With no type: GPU if any task has one, else CPU. Needs a connection (:func:`connect`).

    Raises:
      ValueError: a task shows no device of the type.
    """
    names = [d.name for d in tf.config.list_logical_devices()]

    def of(kind: str) -> list[list[str]]:
        """Per task: its devices of ``kind``, by index."""
        found = []
        for t in tasks:
            prefix = f"{t.name}/device:{kind}:"
            found.append(sorted((n for n in names if n.startswith(prefix)), key=_device_index))
        return found

    kind = device_type.upper() if device_type else ("GPU" if any(of("GPU")) else "CPU")
    per_task = of(kind)
    missing = [t for t, devs in zip(tasks, per_task, strict=True) if not devs]
    if missing:
        seen = sorted({n.rsplit("/device:", 1)[0] for n in names})
        raise ValueError(
            f"{', '.join(str(t) for t in missing)} show(s) no {kind} device (this process sees "
            f"tasks {seen}); start every worker before the client and check that it serves job "
            f"{missing[0].job!r} (start_server's job), or pass another device_type"
        )
    return tuple(tuple(devs) for devs in per_task)
