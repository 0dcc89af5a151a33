"""Meshes over many hosts, on TensorFlow's own distributed runtime (gRPC servers).

A multi-host job is one client process and one ``tf.distribute.Server`` per task (see
``launch/worker.py``). The client connects to the cluster, after which one ``tf.function``
places ops on ``/job:worker/replica:0/task:i/device:...`` and all-reduces across tasks:

    workers:  for i in tasks:  start_server(spec, "worker", i)     # one process per host
    client:   cluster = connect(spec, timeout_s=60)                # probe, then connect
              mesh = cluster.mesh(cluster, stages=S, replicas=R)
              pipe = Pipeline(layers, mesh, ...)
              with cluster.guard():                               # clear error if a task dies
                  pipe.train_step(x, y)

Device order (:func:`order_devices`): pipeline traffic is one activation per micro-batch per
stage boundary, data-parallel traffic is a stage's whole gradient every step, so by default
each replica group (the R copies of one stage) stays inside one host and the pipeline
crosses hosts (``order="replica_groups_in_host"``); ``order="pipelines_in_host"`` keeps each
replica's S stages inside one host instead.

Why the connect probes first: TensorFlow's remote context creation waits without a deadline
for every task to answer (neither ``operation_timeout_in_ms`` nor the init timeout of
``SetServerDef`` bounds its device discovery), so :func:`connect` first waits, with a
deadline, until every task's gRPC server accepts a connection, and then connects in a
helper thread it stops waiting for at the same deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import tensorflow as tf

from hybrid.core.mesh import DeviceMesh

__all__ = [
    "ORDERS",
    "Cluster",
    "ClusterError",
    "ClusterLike",
    "Task",
    "UnreachableTaskError",
    "cluster_spec",
    "connect",
    "mesh_devices",
    "order_devices",
    "server_config",
    "start_server",
    "task_devices",
]

ORDERS = ("replica_groups_in_host", "pipelines_in_host")

# A ClusterResolver, a tf.train.ClusterSpec, a {job: [address, ...]} mapping, a TF_CONFIG
# shaped mapping ({"cluster": {...}, "task": {...}}), their JSON text, a connected Cluster,
# or None for the TF_CONFIG environment variable.
ClusterLike: TypeAlias = Any

_TASK_NAME = re.compile(r"/job:([\w-]+)/replica:\d+/task:(\d+)")
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


# -- cluster specs -----------------------------------------------------------------------


def cluster_spec(cluster: ClusterLike = None) -> tf.train.ClusterSpec:
    """Normalises any :data:`ClusterLike` to a ``tf.train.ClusterSpec``.

    Raises:
      ValueError: the value (or TF_CONFIG) holds no usable cluster.
    """
    if isinstance(cluster, Cluster):
        return cluster.spec()
    if isinstance(cluster, tf.train.ClusterSpec):
        spec = cluster
    elif isinstance(cluster, tf.distribute.cluster_resolver.ClusterResolver):
        spec = cluster.cluster_spec()
    else:
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
        jobs = cluster.get("cluster", cluster)  # a TF_CONFIG dict nests the cluster
        spec = tf.train.ClusterSpec(dict(jobs))
    if not spec.jobs:
        raise ValueError(f"the cluster spec {spec.as_dict()} has no jobs")
    return spec


def _tasks(spec: tf.train.ClusterSpec, job: str) -> tuple[Task, ...]:
    if job not in spec.jobs:
        raise ValueError(
            f"the cluster has no job {job!r} (its jobs: {sorted(spec.jobs)}); use one of those"
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


def _unreachable_error(down: Sequence[Task], timeout_s: float, what: str) -> UnreachableTaskError:
    names = "; ".join(f"{t} [{t.name}]" for t in down)
    starts = " and ".join(
        f"`python -m launch.worker --cluster=... --job_name={t.job} --task_index={t.index}`"
        for t in down
    )
    return UnreachableTaskError(
        f"{what}: {names} did not answer within {timeout_s:g} s. Start {starts} on that host "
        "(or check the address, port and firewall), then run the client again",
        down,
    )


# -- connecting --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster this process is connected to.

    Attributes:
      tasks: every task of every job except the client's, in (job, index) order.
      job: the job whose tasks hold the mesh's devices.
      client_job: the client's job name in the connection.
    """

    tasks: tuple[Task, ...]
    job: str = "worker"
    client_job: str = "localhost"

    @property
    def workers(self) -> tuple[Task, ...]:
        """The tasks of :attr:`job`, by index."""
        return tuple(t for t in self.tasks if t.job == self.job)

    def spec(self) -> tf.train.ClusterSpec:
        jobs: dict[str, dict[int, str]] = {}
        for t in self.tasks:
            jobs.setdefault(t.job, {})[t.index] = t.address
        return tf.train.ClusterSpec(jobs)

    def task_of(self, device: str) -> Task:
        """The task that holds ``device`` (a full device name)."""
        found = _TASK_NAME.search(device)
        for t in self.tasks:
            if found and (t.job, t.index) == (found.group(1), int(found.group(2))):
                return t
        raise ValueError(f"device {device!r} belongs to no task of {self}")

    def task_devices(self, device_type: str | None = None) -> tuple[tuple[str, ...], ...]:
        """Per task of :attr:`job`: its devices of ``device_type`` (see :func:`task_devices`)."""
        return task_devices(self.workers, device_type)

    def unreachable(self, timeout_s: float = 2.0) -> tuple[Task, ...]:
        """The tasks that do not answer a connection probe within ``timeout_s``."""
        return unreachable(self.tasks, timeout_s)

    def check(self, timeout_s: float = 2.0) -> None:
        """Raises :class:`UnreachableTaskError` naming every task that does not answer."""
        down = self.unreachable(timeout_s)
        if down:
            raise _unreachable_error(down, timeout_s, "the cluster lost tasks")

    def watch(
        self,
        on_lost: Callable[[tuple[Task, ...]], None],
        interval_s: float = 5.0,
        probe_timeout_s: float = 2.0,
    ) -> threading.Event:
        """Probes every task each ``interval_s`` in a daemon thread; calls ``on_lost`` once
        with the tasks that stopped answering, then stops.

        A task that dies closes its connections and the step fails at once (see
        :meth:`guard`); a task that hangs, or a host that drops off the network, leaves
        the step waiting forever. The watcher bounds that wait: ``on_lost`` runs on the
        watcher's thread while the step still blocks, so it should end the process (log
        the tasks, then ``os._exit``). Set the returned event to stop watching.
        """
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(interval_s):
                down = self.unreachable(probe_timeout_s)
                if down and not stop.is_set():
                    on_lost(down)
                    return

        threading.Thread(target=run, name="hybrid-cluster-watch", daemon=True).start()
        return stop

    @contextlib.contextmanager
    def guard(self, probe_timeout_s: float = 2.0) -> Iterator[None]:
        """Turns a runtime error caused by a lost task into one that names the task.

        A TensorFlow error raised inside the block is followed by a probe of every task;
        tasks that no longer answer are reported in an :class:`UnreachableTaskError`
        chained to the original error. An UNAVAILABLE error while every task answers (a
        task that restarted, a dropped connection) is reported with the tasks its message
        names. Other errors pass through unchanged.
        """
        try:
            yield
        except tf.errors.OpError as err:
            down = self.unreachable(probe_timeout_s)
            what = f"({type(err).__name__}: {_summary(err)})"
            if down:
                names = "; ".join(f"{t} [{t.name}]" for t in down)
                raise UnreachableTaskError(
                    f"lost {names} during the job {what}. This process cannot reconnect: "
                    f"restart that worker (python -m launch.worker --task_index={down[0].index} "
                    "...), then restart the client (from its last checkpoint)",
                    down,
                ) from err
            if not isinstance(err, tf.errors.UnavailableError):
                raise
            named = self._named_in(err.message)
            raise UnreachableTaskError(
                f"a connection to {', '.join(map(str, named)) or 'the cluster'} failed during "
                f"the job {what}, though every task answers now: a task may have restarted "
                "and lost its state. Restart the client (from its last checkpoint)",
                named,
            ) from err

    def _named_in(self, message: str) -> list[Task]:
        named = {(m.group(1), int(m.group(2))) for m in _TASK_NAME.finditer(message)}
        return [t for t in self.tasks if (t.job, t.index) in named]

    def __str__(self) -> str:
        return f"Cluster({', '.join(str(t) for t in self.tasks)})"


_ROOT_ERROR = re.compile(r"^\s*(?:\(\d+\)\s*)?([A-Z_]+):\s*(.+)$", re.MULTILINE)


def _summary(err: tf.errors.OpError) -> str:
    """The first root error of a TensorFlow error message, on one line."""
    found = _ROOT_ERROR.search(err.message)
    if found:
        return f"{found.group(1)}: {found.group(2).strip()}"
    lines = err.message.strip().splitlines()
    return lines[0] if lines else err.__class__.__name__


def _connected_tasks() -> set[tuple[str, int, str]] | None:
    from tensorflow.python.eager import context

    server_def = context.get_server_def()
    if server_def is None:
        return None
    return {(j.name, i, a) for j in server_def.cluster.job for i, a in j.tasks.items()}


def connect(
    cluster: ClusterLike = None,
    timeout_s: float = 60.0,
    job: str = "worker",
    client_job: str = "client",
) -> Cluster:
    """Connects this process, as the job's only client, to a running cluster.

    Waits until every task answers (tasks may still be starting), then calls
    ``tf.config.experimental_connect_to_cluster``; from then on ops can be placed on every
    task's devices. Connecting again to the same cluster is a no-op.

    Args:
      cluster: the cluster (see :data:`ClusterLike`); None reads TF_CONFIG.
      timeout_s: the deadline for the whole connection, probes included.
      job: the job whose tasks hold the mesh's devices.
      client_job: if the spec lists this job, its task 0 is this process (give it an address
        the workers can reach when they run on other hosts); otherwise TensorFlow adds a
        ``localhost`` job for the client, which is enough when every task is on this host.

    Returns:
      The connected :class:`Cluster`.

    Raises:
      UnreachableTaskError: a task did not answer within ``timeout_s``.
      ClusterError: this process is already connected to another cluster, or the
        connection did not finish in time.
      ValueError: the spec has no job ``job``.
    """
    spec = cluster_spec(cluster)
    _tasks(spec, job)  # the job must exist
    in_spec = client_job in spec.jobs
    tasks = tuple(t for j in sorted(spec.jobs) if j != client_job for t in _tasks(spec, j))
    connected = Cluster(tasks, job, client_job if in_spec else "localhost")
    wanted = {(t.job, t.index, t.address) for t in tasks}
    current = _connected_tasks()
    if current is not None:
        if wanted <= current:
            return connected
        raise ClusterError(
            f"this process is already connected to another cluster ({sorted(current)}); a "
            f"process connects once: run the job on {connected} in a new process"
        )
    deadline = time.monotonic() + timeout_s
    down = unreachable(tasks, timeout_s)
    if down:
        raise _unreachable_error(down, timeout_s, "cannot connect to the cluster")
    _bounded(
        lambda: _connect_now(spec, client_job if in_spec else "localhost"),
        max(1.0, deadline - time.monotonic()),
        f"connecting to {connected}",
    )
    return connected


def _connect_now(spec: tf.train.ClusterSpec, client_job: str) -> None:
    tf.config.experimental_connect_to_cluster(spec, job_name=client_job)
    tf.config.list_logical_devices()  # creates the remote contexts: this is where it waits


def _bounded(fn: Any, timeout_s: float, what: str) -> None:
    """Runs ``fn`` in a helper thread and waits at most ``timeout_s`` for it."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as err:  # handed to the caller's thread
            errors.append(err)

    thread = threading.Thread(target=run, name="hybrid-connect", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ClusterError(
            f"{what} did not finish within {timeout_s:.1f} s although every task answered its "
            "probe (a task may have stopped meanwhile); this process cannot connect again: "
            "check the workers and start the client in a new process"
        )
    if errors:
        raise ClusterError(f"{what} failed: {errors[0]}") from errors[0]


# -- devices and their order -------------------------------------------------------------


def _device_index(name: str) -> int:
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
            f"tasks {seen}); start every worker before the client and check --job_name, or "
            "pass another device_type"
        )
    return tuple(tuple(devs) for devs in per_task)


def _groups(per_task: Sequence[Sequence[str]], size: int, count: int, what: str) -> list[list[str]]:
    """``count`` groups of ``size`` devices, each inside one task where ``size`` fits.

    Tasks are filled in order, each with as many whole groups as it holds (a task smaller
    than a group holds none), so neighbouring groups share a task. A group larger than every
    task spans whole tasks (all tasks must then have the same number of devices, dividing
    ``size``).
    """
    counts = [len(devs) for devs in per_task]
    if any(size <= n for n in counts):
        groups = [
            list(devs[i : i + size])
            for devs in per_task
            for i in range(0, len(devs) - size + 1, size)
        ]
        if len(groups) >= count:
            return groups[:count]
        raise ValueError(
            f"the mesh needs {count} {what} of {size} devices, each inside one task, but the "
            f"tasks' devices {counts} hold only {len(groups)}; add workers or devices per worker "
            "(--simulated_devices on CPU), shrink the mesh, or use the other order"
        )
    per = counts[0]
    if len(set(counts)) != 1 or size % per:
        raise ValueError(
            f"{what} of {size} devices do not fit inside one task (tasks have {counts} "
            f"devices), and spanning tasks needs every task to have the same number of devices "
            f"dividing {size}; use {size} devices per worker or a multiple-of-{per} size"
        )
    flat = [d for devs in per_task for d in devs]
    if count * size > len(flat):
        raise ValueError(
            f"the mesh needs {count} {what} of {size} devices = {count * size} but the cluster "
            f"has {len(flat)} ({counts} per task); add workers or shrink the mesh"
        )
    return [flat[i * size : (i + 1) * size] for i in range(count)]


def order_devices(
    per_task: Sequence[Sequence[str]],
    stages: int,
    replicas: int,
    order: str = "replica_groups_in_host",
) -> tuple[tuple[str, ...], ...]:
    """Lays the tasks' devices out as ``rows[stage][replica]``.

    ``"replica_groups_in_host"`` (the default): stage s's R copies are one group of
    neighbouring devices inside one task; groups fill task 0 first, so the pipeline crosses
    to the next task only when a task is full::

        2 tasks × 2 devices, mesh 2×2:   stage 0 -> task 0 [d0 d1]   stage 1 -> task 1 [d0 d1]

    ``"pipelines_in_host"``: replica r's S stages are one group inside one task, and each
    replica group spans tasks::

        2 tasks × 2 devices, mesh 2×2:   replica 0 -> task 0 [d0 d1]  replica 1 -> task 1 [d0 d1]

    Raises:
      ValueError: unknown order, or the mesh does not fit the tasks' devices that way.
    """
    if order not in ORDERS:
        raise ValueError(f"unknown device order {order!r}; choose one of {list(ORDERS)}")
    for name, value in (("stages", stages), ("replicas", replicas)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if order == "replica_groups_in_host":
        rows = _groups(per_task, replicas, stages, "replica groups")
        return tuple(tuple(row) for row in rows)
    pipes = _groups(per_task, stages, replicas, "pipelines")
    return tuple(tuple(pipes[r][s] for r in range(replicas)) for s in range(stages))


def mesh_devices(
    cluster: ClusterLike,
    stages: int,
    replicas: int,
    order: str = "replica_groups_in_host",
    device_type: str | None = None,
    job: str = "worker",
    timeout_s: float = 60.0,
) -> tuple[tuple[str, ...], ...]:
    """The device rows of an S × R mesh over a cluster (connecting first if needed).

    Backs :func:`mesh`; see :func:`order_devices` for the order.
    """
    if order not in ORDERS:
        raise ValueError(f"unknown device order {order!r}; choose one of {list(ORDERS)}")
    if not isinstance(cluster, Cluster):
        cluster = connect(cluster, timeout_s=timeout_s, job=job)
    per_task = cluster.task_devices(device_type)
    try:
        return order_devices(per_task, stages, replicas, order)
    except ValueError as err:
        raise ValueError(f"mesh stage:{stages};replica:{replicas} on {cluster}: {err}") from None


def mesh(
    cluster: ClusterLike,
    stages: int,
    replicas: int = 1,
    order: str = "replica_groups_in_host",
    device_type: str | None = None,
    job: str = "worker",
    timeout_s: float = 60.0,
) -> DeviceMesh:
    """An S × R mesh over the devices of every task of a TensorFlow cluster.

    Args:
      cluster: a :class:`Cluster` from :func:`connect`, or anything ``connect`` accepts (a
        ClusterResolver, a ClusterSpec, a ``{job: [address, ...]}`` mapping, its JSON, None
        for TF_CONFIG): then this connects first, within ``timeout_s``.
      stages, replicas: S and R.
      order: ``"replica_groups_in_host"`` keeps each stage's replica group inside one task
        and lets the pipeline cross tasks; ``"pipelines_in_host"`` the reverse.
      device_type: "GPU", "CPU", ...; default GPU if any task has one, else CPU.
      job: the job whose tasks hold the mesh.
    """
    for name, value in (("stages", stages), ("replicas", replicas)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return DeviceMesh(
        mesh_devices(cluster, stages, replicas, order, device_type, job, timeout_s)
    )


# -- the worker side ---------------------------------------------------------------------


def server_config(simulated_devices: int | None = None) -> tf.compat.v1.ConfigProto:
    """The worker server's session config: ``simulated_devices`` logical CPUs, each with one
    intra-op thread (like :func:`hybrid.simulate_cpu_devices`), or the defaults."""
    config = tf.compat.v1.ConfigProto()
    if simulated_devices is not None:
        if simulated_devices < 1:
            raise ValueError(f"simulated_devices must be at least 1, got {simulated_devices}")
        config.device_count["CPU"] = simulated_devices
        config.intra_op_parallelism_threads = 1
        config.inter_op_parallelism_threads = max(2, simulated_devices)
    return config


def start_server(
    cluster: ClusterLike,
    job: str,
    task_index: int,
    simulated_devices: int | None = None,
) -> tf.distribute.Server:
    """Starts task ``task_index`` of ``job``'s gRPC server in this process.

    The server serves until the process ends (TensorFlow's servers cannot be stopped).

    Raises:
      ValueError: no such job or task in the spec.
      ClusterError: the server could not start (usually: its port is taken).
    """
    spec = cluster_spec(cluster)
    tasks = _tasks(spec, job)
    if task_index not in {t.index for t in tasks}:
        raise ValueError(
            f"job {job!r} has tasks {[t.index for t in tasks]}, not task {task_index}; use one "
            "of those as the task index"
        )
    address = spec.task_address(job, task_index)
    try:
        return tf.distribute.Server(
            spec,
            job_name=job,
            task_index=task_index,
            protocol="grpc",
            config=server_config(simulated_devices),
            start=True,
        )
    except tf.errors.OpError as err:
        port = address.rpartition(":")[2]
        raise ClusterError(
            f"could not start the server of {job} task {task_index} at {address} "
            f"({err.message}); is port {port} already in use on this host? Stop whatever holds "
            "it or give this task another port in the cluster spec"
        ) from err
