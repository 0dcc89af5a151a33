"""One stage's task of the per-stage memory benchmark: a gRPC worker that reports its own
allocator.

    python benchmarks/memory_worker.py --cluster=JSON --task_index=I

Serves task I of ``--cluster`` (one CPU device) like ``hybrid.launch.worker``, starts the
profiler (into ``--profile_dir``, a fresh temporary folder by default), prints ``READY``, and
for every line it reads on stdin prints
``MEMORY {"baseline": B, "current": C, "peak": P}`` (bytes of this process's CPU allocator:
after the server started; now; the high-water mark so far); at ``stop`` it stops the
profiler and adds ``requested_peak``, ``waste`` and ``by_op`` (``allocations.replay``: the
high-water mark of the bytes requested, the chunk bytes beyond the requests at the allocator's
peak, the requested bytes per op at the requested peak); at ``exit`` or the end of stdin it
exits. Read them while the client is connected: its variables are freed when it leaves.
The parent runs it with ``TF_CPU_ALLOCATOR_USE_BFC=true``: TensorFlow's default CPU
allocator keeps no statistics, its BFC allocator does. Every tensor a stage's ops allocate on
this task's device (weights, gradient accumulators, optimizer slots, activations, transfers
received from the other task) comes from this process's allocator, and nothing else does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # allocations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--task_index", type=int, required=True)
    parser.add_argument("--profile_dir", default="", help="The profile's folder (kept).")
    args = parser.parse_args()

    import tensorflow as tf

    from hybrid.platforms import cluster

    import allocations

    server = cluster.start_server(cluster.cluster_spec(args.cluster), "worker", args.task_index, 1)
    baseline = tf.config.experimental.get_memory_info("CPU:0")["current"]
    profile_dir = args.profile_dir or tempfile.mkdtemp(prefix="memory_worker_")
    tf.profiler.experimental.start(profile_dir)
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break
        info = tf.config.experimental.get_memory_info("CPU:0")
        if line.strip() == "stop":
            tf.profiler.experimental.stop()
            peak = allocations.replay(allocations.events(allocations.latest_xplane(profile_dir)))
            info.update(requested_peak=peak.requested, waste=peak.waste, by_op=peak.by_op[:12])
            if not args.profile_dir:
                shutil.rmtree(profile_dir, ignore_errors=True)
        print("MEMORY " + json.dumps({"baseline": baseline, **info}), flush=True)
    del server
    os._exit(0)  # a tf.distribute.Server cannot be stopped; end the process


if __name__ == "__main__":
    sys.exit(main())
