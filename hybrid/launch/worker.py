"""Serves one task of a multi-host job: a TensorFlow gRPC server that waits for the client.

Start one per task (host), then the client with the same cluster spec:

    hybrid-worker --cluster='{"worker": ["host0:2222", "host1:2222"]}' --task_index=0
    hybrid-worker --cluster='{"worker": ["host0:2222", "host1:2222"]}' --task_index=1

or with TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 0}}' and no flags,
or under ``srun`` with ``--cluster=SLURM`` (``hybrid.platforms.slurm``).
On a CPU host, ``--simulated_devices=N`` splits the CPU into N logical devices. The worker
serves until SIGTERM or SIGINT (exit code 0) or until ``--lifetime_s`` has passed (exit code
3, so a forgotten worker does not live forever); a server that cannot start (a bad spec, a
port in use) exits with code 2 and says why.

``hybrid.platforms.cluster`` speaks in its own terms (``start_server(cluster, job='worker',
task_index=1)``, ``simulated_devices``, ``device_type``, ``order``); :func:`flag_terms` rewords
its messages as the flags of this worker and of ``hybrid.launch.train``, for the person at the
command line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from absl import app, flags  # noqa: E402

from hybrid.launch import define_xla_cache_flag, run_app, show_in_help, use_xla_cache  # noqa: E402

FLAGS = flags.FLAGS
EXIT_LIFETIME = 3

# The cluster library's wording -> the launchers' flags (the worker's; --mesh_order and
# --platform are hybrid-train's). Applied in order.
_FLAG_TERMS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"start_server\(cluster, job='([^']*)', task_index=(\d+)\)"),
        r"python -m hybrid.launch.worker --cluster=... --job_name=\1 --task_index=\2",
    ),
    (
        re.compile(r"start_server\(\.\.\., simulated_devices=N\)"),
        "hybrid-worker --simulated_devices=N",
    ),
    (re.compile(r"\(start_server's job\)"), "(hybrid-worker --job_name)"),
    (re.compile(r"(?<![\w-])task_index\b"), "--task_index"),
    (re.compile(r"pass one of those as job\b"), "pass one of those as --job_name"),
    (re.compile(r"^no cluster given"), "no --cluster given"),
    (re.compile(r"^cluster (?=')"), "--cluster="),
    (re.compile(r"use the other order\b"), "use the other --mesh_order"),
    (re.compile(r"pass another device_type\b"), "pass another --platform"),
)


def flag_terms(message: str) -> str:
    """``message`` from ``hybrid.platforms.cluster`` with its calls and argument names
    replaced by the launchers' flags.

    ``start_server(cluster, job='worker', task_index=1)`` becomes ``python -m hybrid.launch.worker
    --cluster=... --job_name=worker --task_index=1``; ``task_index``, ``simulated_devices``,
    the ``job`` to pass and an unset ``cluster`` become ``--task_index``,
    ``--simulated_devices``, ``--job_name`` and ``--cluster``; the device ``order`` and
    ``device_type`` become ``hybrid.launch.train``'s ``--mesh_order`` and ``--platform``.
    """
    for pattern, replacement in _FLAG_TERMS:
        message = pattern.sub(replacement, message)
    return message


def define_flags() -> None:
    """Defines ``--cluster``, ``--job_name``, ``--task_index``, ``--simulated_devices``,
    ``--lifetime_s`` and ``--xla_cache_dir`` (the programs this task compiles)."""
    flags.DEFINE_string(
        "cluster",
        None,
        'Cluster spec as JSON, e.g. {"worker": ["host0:2222", "host1:2222"]} (or a TF_CONFIG '
        "shaped object); SLURM (or SLURM:PORT): one task per SLURM task of this job, the task "
        "index from SLURM's environment; default: the TF_CONFIG environment variable.",
    )
    flags.DEFINE_string("job_name", None, "This task's job (default: TF_CONFIG's, else worker).")
    flags.DEFINE_integer(
        "task_index", None, "This task's index in its job (default: TF_CONFIG's).", lower_bound=0
    )
    flags.DEFINE_integer(
        "simulated_devices",
        None,
        "CPU only: logical CPU devices this task offers (default: the host's devices).",
        lower_bound=1,
    )
    flags.DEFINE_string(
        "memory_per_device",
        None,
        "CPU only: cap this task's CPU allocator, e.g. '512MiB' (whole MiB; one device per "
        "task: --simulated_devices=1). An allocation beyond it fails with TensorFlow's "
        "ResourceExhaustedError, as on a GPU.",
    )
    flags.DEFINE_bool(
        "until_stdin_closes",
        False,
        "Also stop when standard input closes (a parent that starts its workers on a pipe: "
        "they end with it); meanwhile answer each 'memory' line read there with "
        '\'memory {"current": bytes, "peak": bytes}\' (this task\'s CPU allocator) on stdout.',
    )
    flags.DEFINE_float(
        "lifetime_s", 0.0, "Exit after this many seconds (0: serve until signalled).", lower_bound=0
    )
    define_xla_cache_flag()


def _task_of(text: str | None) -> dict[str, Any]:
    """The "task" entry of a TF_CONFIG-shaped JSON object, if any."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}  # cluster_spec() reports the bad JSON
    task = value.get("task", {}) if isinstance(value, dict) else {}
    return task if isinstance(task, dict) else {}


def _resolve_task() -> tuple[str, int, str | None]:
    """This task's job and index (flags first, then TF_CONFIG), and the cluster's JSON text.

    Raises:
      app.UsageError: neither a flag nor TF_CONFIG says which task this is.
    """
    text = FLAGS.cluster if FLAGS.cluster is not None else os.environ.get("TF_CONFIG")
    task = _task_of(text)
    job = FLAGS.job_name or task.get("type") or "worker"
    index = FLAGS.task_index if FLAGS.task_index is not None else task.get("index")
    if index is None and text is not None and text.startswith("SLURM"):
        return job, -1, text  # SLURM's environment says, once TensorFlow has loaded
    if index is None:
        raise app.UsageError(
            "which task is this? pass --task_index (or set TF_CONFIG's task.index)"
        )
    return job, int(index), text


def main(argv: list[str]) -> int:
    """Serves this task until signalled (0) or ``--lifetime_s`` passes (3); 2 if the server
    cannot start."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; everything is a --flag")
    job, index, text = _resolve_task()
    try:  # before TensorFlow loads: it reads its XLA flags once
        use_xla_cache(FLAGS.xla_cache_dir)
    except ValueError as err:
        print(f"worker: {err}", file=sys.stderr, flush=True)
        return 2
    try:
        cap = _cap_memory()
    except ValueError as err:
        print(f"worker: --memory_per_device={FLAGS.memory_per_device}: {err}", file=sys.stderr)
        return 2
    # After the flag checks: TensorFlow takes seconds to import.
    from hybrid.platforms import cluster, slurm

    try:
        if text is not None and slurm.is_slurm(text):
            spec = slurm.spec(text)
            index = slurm.task_index(spec, text) if index < 0 else index
        else:
            spec = cluster.cluster_spec(text)
        server = cluster.start_server(spec, job, index, FLAGS.simulated_devices)
    except (ValueError, cluster.ClusterError) as err:
        print(f"worker: {flag_terms(str(err))}", file=sys.stderr, flush=True)
        return 2
    if cap:
        _reserve(cap)
    devices = FLAGS.simulated_devices or "all local"
    capped = f", its allocator capped at {cap} MiB" if cap else ""
    stop, received = _stop_on_signals()  # before the line that tells a supervisor to signal
    print(
        f"worker {job}:{index} serving at {spec.task_address(job, index)} "
        f"({server.target}, {devices} devices{capped}); stop with SIGTERM",
        flush=True,
    )
    return _serve(server, f"{job}:{index}", stop, received)


def _cap_memory() -> int | None:
    """Caps this process's CPU allocator at ``--memory_per_device`` (before TensorFlow loads:
    it reads the variables once); the cap in MiB, None without the flag.

    Raises:
      ValueError: not a size, under 1 MiB, or more than one device shares the allocator.
    """
    if FLAGS.memory_per_device is None:
        return None
    from hybrid.core.memory import parse_bytes
    from hybrid.platforms.local_workers import cap_mib

    if (FLAGS.simulated_devices or 1) != 1:
        raise ValueError(
            f"the {FLAGS.simulated_devices} simulated devices of one task share its allocator, "
            "so a cap per device needs one task per device: --simulated_devices=1 (hybrid-train "
            "--memory_per_device on --platform=cpu starts such workers itself)"
        )
    mib = cap_mib(parse_bytes(FLAGS.memory_per_device))
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(mib)
    return mib


def _reserve(mib: int) -> None:
    """Makes the capped allocator's pool one region of what the cap leaves, as a GPU's
    allocator holds its memory by default (TensorFlow's BFC allocator on a CPU grows its
    pool in regions that double, so a large tensor would need a free region of its own):
    the largest allocation that fits (never written: no page of it is touched), freed; then
    the statistics start from zero."""
    import tensorflow as tf

    for spare in range(2, mib):  # the server's start holds a first region of 2 MiB
        try:
            with tf.device("CPU:0"):
                whole = tf.raw_ops.Empty(shape=[mib - spare, 1 << 20], dtype=tf.uint8)
        except tf.errors.ResourceExhaustedError:
            continue
        del whole
        print(f"reserved {mib - spare} MiB of the {mib} MiB cap as one region", flush=True)
        break
    tf.config.experimental.reset_memory_stats("CPU:0")


def _stop_on_signals() -> tuple[threading.Event, list[str]]:
    """An event SIGTERM and SIGINT set from now on, and the list their names are added to."""
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, frame: Any) -> None:
        """Records the signal and ends the wait."""
        del frame
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop, received


def _memory_info() -> dict[str, int]:
    """This task's CPU allocator's bytes in use now and at most so far (``{}`` where the
    allocator keeps no statistics: TensorFlow's default CPU allocator; its BFC one does)."""
    import tensorflow as tf

    try:
        info = tf.config.experimental.get_memory_info("CPU:0")
    except (ValueError, RuntimeError):
        return {}
    return {"current": int(info["current"]), "peak": int(info["peak"])}


def _serve(server: Any, task: str, stop: threading.Event, received: list[str]) -> int:
    """Keeps ``server`` (a ``tf.distribute.Server``, which serves while referenced) until
    ``stop`` is set (a signal: returns 0) or until ``--lifetime_s`` has passed (returns 3)."""
    if FLAGS.until_stdin_closes:

        def until_closed() -> None:
            """Reads standard input to its end, answering each ``memory`` line, then ends
            the wait."""
            from hybrid.platforms.local_workers import MEMORY_ASK, MEMORY_REPLY

            for line in sys.stdin:
                if line.strip() == MEMORY_ASK:
                    print(f"{MEMORY_REPLY}{json.dumps(_memory_info())}", flush=True)
            received.append("standard input closed")
            stop.set()

        threading.Thread(target=until_closed, daemon=True, name="hybrid-stdin").start()
    deadline = time.monotonic() + FLAGS.lifetime_s if FLAGS.lifetime_s else None
    # The main thread waits in Python (not in server.join()) so the signal handlers run.
    while not stop.wait(0.5):
        if deadline is not None and time.monotonic() > deadline:
            print(f"worker {task}: --lifetime_s={FLAGS.lifetime_s:g} passed", flush=True)
            return EXIT_LIFETIME
    print(f"worker {task}: {received[0]}, shutting down", flush=True)
    del server
    return 0


def run() -> None:
    """The ``hybrid-worker`` command: defines the flags, parses argv and runs :func:`main`."""
    define_flags()
    show_in_help(__name__, "hybrid.launch")
    run_app(main, "hybrid-worker")


if __name__ == "__main__":
    run()
