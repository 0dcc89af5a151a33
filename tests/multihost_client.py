"""The client of tests/test_multihost.py: trains the test MLP on a 2×2 mesh over a cluster.

A connection to a cluster cannot be undone in a process, and the pytest process already has
its simulated devices, so the client runs as its own process:

    python tests/multihost_client.py --cluster=JSON --init=weights.npz --out=DIR --steps=3

It sets the initial weights from ``--init``, trains ``--steps`` steps on ``reference.batch``
batches (printing ``step N loss L`` after each), and writes ``DIR/result.npz`` (``losses``
and the final weights ``w0, w1, ...``), ``DIR/mesh.json`` and, with ``--checkpoint_dir``, a
``hybrid.run.checkpoint`` checkpoint of the final state. A lost worker (an error from
``Cluster.guard``, or ``Cluster.watch`` finding a task that stopped answering) is reported
as ``client: ...`` on stderr with exit code 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from hybrid.platforms import cluster  # noqa: E402

EXIT_LOST_TASK = 3
BATCH = 64
MICRO_BATCHES = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cluster", required=True, help="cluster spec JSON")
    parser.add_argument("--init", required=True, help="initial weights (.npz of w0, w1, ...)")
    parser.add_argument("--out", required=True, help="directory for result.npz and mesh.json")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--order", default="replica_groups_in_host", choices=cluster.ORDERS)
    parser.add_argument("--optimizer", default="sgd_momentum")
    parser.add_argument("--timeout_s", type=float, default=60.0)
    parser.add_argument("--no_jit", action="store_true", help="stage programs without XLA")
    parser.add_argument("--checkpoint_dir", default=None, help="save a checkpoint at the end")
    return parser.parse_args()


def main() -> int:
    args = parse_args()

    import reference as ref

    job = cluster.connect(args.cluster, timeout_s=args.timeout_s)
    mesh = cluster.mesh(job, stages=2, replicas=2, order=args.order)
    with open(os.path.join(args.out, "mesh.json"), "w") as f:
        json.dump({"devices": mesh.devices}, f)
    init = np.load(args.init)
    pipe = ref.pipeline(
        mesh=mesh,
        layers=ref.mlp_layers(seed=99),
        optimizer=args.optimizer,
        micro_batches=MICRO_BATCHES,
        jit_compile=not args.no_jit,
        weights=[init[f"w{i}"] for i in range(len(init.files))],
    )

    def lost(tasks: tuple[cluster.Task, ...]) -> None:  # a hung task: the step never returns
        names = ", ".join(map(str, tasks))
        print(f"client: {names} stopped answering; giving up", file=sys.stderr, flush=True)
        os._exit(EXIT_LOST_TASK)

    watching = job.watch(lost, interval_s=2.0)
    losses = []
    try:
        with job.guard():
            for step in range(args.steps):
                x, y = ref.batch(BATCH, seed=step + 1)
                losses.append(pipe.train_step(x, y)["loss"])
                print(f"step {step} loss {losses[-1]:.6f}", flush=True)
            weights = pipe.get_weights()
            if args.checkpoint_dir:
                from hybrid.run import checkpoint

                checkpoint.Checkpointer(pipe, args.checkpoint_dir).save(args.steps)
    except cluster.UnreachableTaskError as err:
        watching.set()
        print(f"client: {err}", file=sys.stderr, flush=True)
        return EXIT_LOST_TASK
    watching.set()
    arrays: dict[str, Any] = {f"w{i}": w for i, w in enumerate(weights)}
    np.savez(os.path.join(args.out, "result.npz"), losses=np.array(losses), **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
