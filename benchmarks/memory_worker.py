"""One stage's task of the per-stage memory benchmark: a gRPC worker that reports its own
allocator.

    python benchmarks/memory_worker.py --cluster=JSON --task_index=I

Serves task I of ``--cluster`` (one CPU device) like ``hybrid.launch.worker``, prints
``READY``, and for every line it reads on stdin prints
``MEMORY {"baseline": B, "current": C, "peak": P}`` (bytes of this process's CPU allocator:
after the server started; now; the high-water mark so far); at ``exit`` or the end of stdin it
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
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--task_index", type=int, required=True)
    parser.add_argument("--log", default="", help="Write this process's stderr here.")
    args = parser.parse_args()
    if args.log:  # before TensorFlow logs anything: its memory log is what --trace reads
        os.dup2(os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)

    import tensorflow as tf

    from hybrid.platforms import cluster

    server = cluster.start_server(cluster.cluster_spec(args.cluster), "worker", args.task_index, 1)
    baseline = tf.config.experimental.get_memory_info("CPU:0")["current"]
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break
        info = tf.config.experimental.get_memory_info("CPU:0")
        sys.stderr.write(f"__MARK__ {json.dumps(info)}\n")  # a phase boundary in a --log
        sys.stderr.flush()
        print("MEMORY " + json.dumps({"baseline": baseline, **info}), flush=True)
    del server
    os._exit(0)  # a tf.distribute.Server cannot be stopped; end the process


if __name__ == "__main__":
    sys.exit(main())
