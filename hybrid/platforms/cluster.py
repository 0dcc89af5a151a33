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

This module connects (:func:`connect`), guards and watches a connected :class:`Cluster`,
lays meshes over its devices (:func:`mesh`, in the order of
:func:`~hybrid.platforms.device_order.order_devices`) and serves tasks (:func:`start_server`).
Specs, tasks and probes live in :mod:`hybrid.platforms.cluster_tasks`; their names are
re-exported here.

Why the connect probes first: TensorFlow's remote context creation waits without a deadline
for every task to answer (neither ``operation_timeout_in_ms`` nor the init timeout of
``SetServerDef`` bounds its device discovery), so :func:`connect` first waits, with a
deadline, until every task's gRPC server accepts a connection, and then connects in a
helper thread it stops waiting for at the same deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import tensorflow as tf

from hybrid.core.mesh import DeviceMesh
from hybrid.engine.devices import run_xla_programs_in_order
from hybrid.platforms.cluster_tasks import (
    ClusterError,
    ClusterLike,
    Task,
    UnreachableTaskError,
    dropped_error,
    job_tasks,
    lost_error,
    restarted_error,
    spec_from,
    task_devices,
    tasks_named_in,
    unreachable,
    unreachable_error,
)
from hybrid.platforms.device_order import ORDERS, check_mesh_shape, check_order, order_devices

__all__ = [
    "ORDERS",
    "Cluster",
    "ClusterError",
    "ClusterLike",
    "Task",
    "UnreachableTaskError",
    "cluster_spec",
    "connect",
    "mesh",
    "mesh_devices",
    "order_devices",
    "server_config",
    "start_server",
    "task_devices",
    "unreachable",
]


def cluster_spec(cluster: ClusterLike = None) -> tf.train.ClusterSpec:
    """Normalises any :data:`ClusterLike`, a connected :class:`Cluster` included, to a
    ``tf.train.ClusterSpec``.

    Raises:
      ValueError: the value (or TF_CONFIG) holds no usable cluster.
    """
    if isinstance(cluster, Cluster):
        return cluster.spec()
    return spec_from(cluster)


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
        """The tasks (the client's job left out) as a ``tf.train.ClusterSpec``."""
        jobs: dict[str, dict[int, str]] = {}
        for t in self.tasks:
            jobs.setdefault(t.job, {})[t.index] = t.address
        return tf.train.ClusterSpec(jobs)

    def task_of(self, device: str) -> Task:
        """The task that holds ``device`` (a full device name)."""
        named = tasks_named_in(self.tasks, device)
        if named:
            return named[0]
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
            raise unreachable_error(down, timeout_s, "the cluster lost tasks")

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
            """Probes until a task is lost (then reports it) or ``stop`` is set."""
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
        names, as is a collective refused because a task restarted while the others
        kept the previous client's state (every worker must restart then). Other errors,
        and a task's out-of-memory error (a task that died of one included: the engine
        says it so), pass through unchanged.
        """
        try:
            yield
        except tf.errors.ResourceExhaustedError:
            raise
        except tf.errors.FailedPreconditionError as err:
            if "incarnation" not in err.message:
                raise
            raise restarted_error(self.tasks, err) from err
        except tf.errors.OpError as err:
            down = self.unreachable(probe_timeout_s)
            if down:
                raise lost_error(down, err) from err
            if not isinstance(err, tf.errors.UnavailableError):
                raise
            raise dropped_error(tasks_named_in(self.tasks, err.message), err) from err

    def __str__(self) -> str:
        return f"Cluster({', '.join(str(t) for t in self.tasks)})"


def _connected_tasks() -> set[tuple[str, int, str]] | None:
    """(job, index, address) of every task this process is connected to; None: none yet."""
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
    job_tasks(spec, job)  # the job must exist
    in_spec = client_job in spec.jobs
    tasks = tuple(t for j in sorted(spec.jobs) if j != client_job for t in job_tasks(spec, j))
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
        raise unreachable_error(down, timeout_s, "cannot connect to the cluster")
    _bounded(
        lambda: _connect_now(spec, client_job if in_spec else "localhost"),
        max(1.0, deadline - time.monotonic()),
        f"connecting to {connected}",
    )
    return connected


def _connect_now(spec: tf.train.ClusterSpec, client_job: str) -> None:
    """Connects to ``spec`` as ``client_job`` and waits until every remote context exists."""
    tf.config.experimental_connect_to_cluster(spec, job_name=client_job)
    tf.config.list_logical_devices()  # creates the remote contexts: this is where it waits


def _bounded(fn: Callable[[], None], timeout_s: float, what: str) -> None:
    """Runs ``fn`` in a helper thread and waits at most ``timeout_s`` for it."""
    errors: list[BaseException] = []

    def run() -> None:
        """Runs ``fn``, keeping what it raises for the caller's thread."""
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


# -- devices and the mesh ----------------------------------------------------------------


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
    check_order(order)
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
    check_mesh_shape(stages, replicas)
    return DeviceMesh(mesh_devices(cluster, stages, replicas, order, device_type, job, timeout_s))


# -- the worker side ---------------------------------------------------------------------


def server_config(simulated_devices: int | None = None) -> tf.compat.v1.ConfigProto:
    """The worker server's session config: ``simulated_devices`` logical CPUs, each with one
    intra-op thread (like :func:`hybrid.simulate_cpu_devices`; :func:`start_server` also
    runs their XLA programs in order), or the defaults."""
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
    tasks = job_tasks(spec, job)
    if task_index not in {t.index for t in tasks}:
        raise ValueError(
            f"job {job!r} has tasks {[t.index for t in tasks]}, not task_index={task_index}; "
            "pass one of those as task_index"
        )
    address = spec.task_address(job, task_index)
    if simulated_devices is not None:
        run_xla_programs_in_order()  # as a simulated device in one process does
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
