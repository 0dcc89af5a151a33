"""A simulated mesh whose devices have real memory limits: one local worker process per
device, its CPU allocator capped.

TensorFlow's simulated CPU devices (``hybrid.simulate_cpu_devices``) share one process and
one allocator, so nothing stops a stage from using more memory than a device would have. Here
each device is the one CPU device of its own ``hybrid-worker`` process on loopback, started
with TensorFlow's BFC CPU allocator capped at ``memory_per_device``
(``TF_CPU_ALLOCATOR_USE_BFC=true``, ``TF_CPU_BFC_MEM_LIMIT_IN_MB``): an allocation beyond the
cap fails on that device with ``ResourceExhaustedError``, as it would on a GPU, and the
client (this process) drives the mesh over TensorFlow's distributed runtime:

    with local_workers.start(devices=4, memory_per_device=512 * 2**20) as workers:
        job = cluster.connect(workers.spec)
        pipe = hybrid.Pipeline(layers, cluster.mesh(job, stages=4), ...)
        pipe.fit(...)

``hybrid-train --memory_per_device=512MiB`` on ``--platform=cpu`` does the same.

Each worker serves until its standard input closes (``hybrid-worker --until_stdin_closes``),
so the workers end with this process however it ends; :meth:`LocalWorkers.close` ends them
sooner. Meanwhile a worker answers a ``memory`` line on its standard input with its
allocator's statistics (:meth:`LocalWorkers.memory_info`, which ``hybrid.core.device_limits``
asks for the launcher's measured peak per stage). Their output goes to ``worker-<i>.log`` in
``log_dir`` (TensorFlow's allocator dump after an out-of-memory error is long); a worker that
cannot start is reported with its log's last lines. A process connects to one cluster in its
life (``cluster.connect``): start the workers once per process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from hybrid.core import device_limits, memory

__all__ = ["MIB", "LocalWorkers", "cap_mib", "free_ports", "start"]

MIB = 1 << 20
_WORKER = ("-m", "hybrid.launch.worker")
_READY = "serving at"  # the worker's line once its server has started
MEMORY_ASK = "memory"  # a line to a worker's stdin: it answers on its stdout ...
MEMORY_REPLY = "memory "  # ... with this and '{"current": bytes, "peak": bytes}'
_REPLY_S = 30.0  # how long a worker may take to answer (it answers between its RPCs)
_ATTEMPTS = 3  # a port picked free can be taken before the worker binds it: pick again
_OUT_OF_MEMORY = re.compile(r"ran out of memory trying to allocate [^(\n]*")


def cap_mib(memory_per_device: float) -> int:
    """The allocator cap in whole MiB (what ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` takes), rounded
    down, for ``memory_per_device`` bytes.

    Raises:
      ValueError: under 1 MiB.
    """
    mib = int(memory_per_device // MIB)
    if mib < 1:
        raise ValueError(
            f"memory_per_device={memory.format_bytes(memory_per_device)} is under 1 MiB, the "
            "smallest cap TensorFlow's CPU allocator takes; give at least 1MiB"
        )
    return mib


@dataclasses.dataclass
class LocalWorkers:
    """Running local workers, one simulated device each.

    Attributes:
      spec: the cluster, ``{"worker": ["127.0.0.1:PORT", ...]}`` (task i serves device i).
      memory_per_device: each device's allocator cap in bytes (whole MiB); None: uncapped.
      log_dir: where ``worker-<i>.log`` holds each worker's output.
    """

    spec: dict[str, list[str]]
    memory_per_device: int | None
    log_dir: str
    _processes: list[subprocess.Popen[str]]
    _own_log_dir: bool = False
    _replies: list[queue.Queue[str]] = dataclasses.field(default_factory=list)
    _asking: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices, in task order."""
        return tuple(f"{_task(i)}/device:CPU:0" for i in range(len(self._processes)))

    def log_tail(self, task: int, lines: int = 5) -> str:
        """The last ``lines`` lines of task ``task``'s log."""
        with open(self._log_path(task), errors="replace") as log:
            return "".join(log.readlines()[-lines:]).strip()

    def lost_to_memory(self) -> dict[str, str]:
        """The devices whose worker ended after its allocator ran out of memory, each with
        the allocator's line (``ran out of memory trying to allocate 64.00MiB``): TensorFlow's
        CPU runtime can crash on an allocation it cannot serve instead of raising, and the
        client then sees only a lost connection."""
        lost = {}
        for task, device in enumerate(self.devices):
            with open(self._log_path(task), errors="replace") as log:
                said = _OUT_OF_MEMORY.findall(log.read())
            if said and self._ended(task):
                lost[device] = said[-1].strip()
        return lost

    def memory_info(self, device: str) -> dict[str, int] | None:
        """``device``'s allocator statistics, asked of its worker: ``current`` and ``peak``
        bytes in use (the peak since the worker reserved its pool and began serving); None
        for a device not served here, a worker that has ended or does not answer in time,
        or one whose allocator keeps no statistics (uncapped: TensorFlow's default CPU
        allocator)."""
        tasks = range(len(self._processes))
        task = next((t for t in tasks if device_limits.covers(_task(t), device)), None)
        if task is None:
            return None
        process = self._processes[task]
        with self._asking:
            if process.poll() is not None or process.stdin is None:
                return None
            try:
                process.stdin.write(MEMORY_ASK + "\n")
                process.stdin.flush()
                reply = self._replies[task].get(timeout=_REPLY_S)
            except (OSError, queue.Empty):
                return None
        info = json.loads(reply[len(MEMORY_REPLY) :])
        return info if info else None

    def _ended(self, task: int, wait_s: float = 5.0) -> bool:
        """Whether task ``task``'s worker has ended (waiting up to ``wait_s`` for one that
        is ending: the client can hear of a death before the process is gone)."""
        try:
            self._processes[task].wait(wait_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def close(self, grace_s: float = 15.0) -> None:
        """Ends every worker (SIGTERM, then SIGKILL after ``grace_s``), forgets their limits'
        reporter, and removes the log folder if this object made it."""
        device_limits.remove_reporter(self.lost_to_memory)
        device_limits.remove_reader(self.memory_info)
        for process in self._processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self._processes:
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdin is not None:
                process.stdin.close()
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _log_path(self, task: int) -> str:
        return os.path.join(self.log_dir, f"worker-{task}.log")


def start(
    devices: int,
    memory_per_device: float | None = None,
    log_dir: str | None = None,
    xla_cache_dir: str | None = None,
    timeout_s: float = 120.0,
) -> LocalWorkers:
    """Starts ``devices`` local workers of one CPU device each and returns once every one
    serves.

    Args:
      devices: how many devices (worker processes).
      memory_per_device: each device's memory in bytes, rounded down to whole MiB (the
        allocator's unit); None: no cap.
      log_dir: the folder for the workers' logs (made if missing); None: a temporary one,
        removed by :meth:`LocalWorkers.close`.
      xla_cache_dir: the workers' ``--xla_cache_dir`` (None: their default, on).
      timeout_s: how long a worker may take to start serving.

    Raises:
      ValueError: ``devices`` under 1 or ``memory_per_device`` under 1 MiB.
      RuntimeError: a worker did not start (its log's last lines say why).
    """
    if devices < 1:
        raise ValueError(f"devices must be at least 1, got {devices}")
    mib = cap_mib(memory_per_device) if memory_per_device is not None else None
    own = log_dir is None
    log_dir = tempfile.mkdtemp(prefix="hybrid-workers-") if log_dir is None else log_dir
    os.makedirs(log_dir, exist_ok=True)
    for attempt in range(_ATTEMPTS):
        addresses = [f"127.0.0.1:{port}" for port in free_ports(devices)]
        workers = LocalWorkers({"worker": addresses}, mib * MIB if mib else None, log_dir, [], own)
        for task in range(devices):
            workers._processes.append(_launch(workers, task, mib, xla_cache_dir))
            workers._replies.append(queue.Queue())
        failed = _wait_ready(workers, timeout_s)
        if failed is None:
            if workers.memory_per_device is not None:
                for device in workers.devices:
                    device_limits.declare(device, workers.memory_per_device)
            device_limits.add_reporter(workers.lost_to_memory)
            device_limits.add_reader(workers.memory_info)
            return workers
        task, tail = failed
        workers._own_log_dir = False  # keep the logs the error points at
        workers.close()
        if "already in use" not in tail or attempt == _ATTEMPTS - 1:
            raise RuntimeError(
                f"local worker {task} of {devices} did not start serving "
                f"({workers._log_path(task)}): {tail or 'no output'}"
            )
    raise AssertionError("unreachable")


def _task(index: int) -> str:
    """The name of task ``index``, the prefix of its device's."""
    return f"/job:worker/replica:0/task:{index}"


def free_ports(count: int) -> list[int]:
    """``count`` TCP ports free on 127.0.0.1 now (held open together, so they differ), for a
    loopback cluster's tasks; one can still be taken before its task binds it."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _launch(
    workers: LocalWorkers, task: int, mib: int | None, xla_cache_dir: str | None
) -> subprocess.Popen[str]:
    """Starts task ``task``'s worker: its stdin a pipe it serves while open, its stdout a
    pipe (read for its ready line, then copied to its log), its stderr the log."""
    command = [
        sys.executable,
        *_WORKER,
        f"--cluster={json.dumps(workers.spec)}",
        f"--task_index={task}",
        "--simulated_devices=1",
        "--until_stdin_closes",
    ]
    if mib is not None:
        command.append(f"--memory_per_device={mib}MiB")
    if xla_cache_dir is not None:
        command.append(f"--xla_cache_dir={xla_cache_dir}")
    open(workers._log_path(task), "w").close()
    # Appending, as the thread that copies its stdout does: neither overwrites the other.
    log = open(workers._log_path(task), "a")  # noqa: SIM115 (the child holds it)
    try:
        return subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    finally:
        log.close()


def _wait_ready(workers: LocalWorkers, timeout_s: float) -> tuple[int, str] | None:
    """Waits for every worker's ready line; None when all serve, else the first task that
    ended or did not serve within ``timeout_s``, and its log's last lines."""
    answers: queue.Queue[tuple[int, bool]] = queue.Queue()

    def read(task: int, process: subprocess.Popen[str]) -> None:
        """Copies ``process``'s stdout to its log, answering at its ready line (True) or at
        its end without one (False); its answers to ``memory`` go to its reply queue."""
        assert process.stdout is not None
        ready = False
        with open(workers._log_path(task), "a") as log:
            for line in process.stdout:
                if line.startswith(MEMORY_REPLY):
                    workers._replies[task].put(line.strip())
                    continue
                log.write(line)
                log.flush()
                if not ready and _READY in line:
                    ready = True
                    answers.put((task, True))
        if not ready:
            answers.put((task, False))

    for task, process in enumerate(workers._processes):
        name = f"hybrid-worker-{task}-output"
        threading.Thread(target=read, args=(task, process), daemon=True, name=name).start()
    deadline = time.monotonic() + timeout_s
    waiting = set(range(len(workers._processes)))
    while waiting:
        try:
            task, ready = answers.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return min(waiting), f"not serving after {timeout_s:g} s"
        if not ready:
            workers._processes[task].wait()
            return task, workers.log_tail(task)
        waiting.discard(task)
    return None
