"""A cluster from SLURM's environment: ``--cluster=SLURM`` (or ``SLURM:PORT``).

Inside a SLURM job, TensorFlow's ``SlurmClusterResolver`` turns the allocation into a
cluster spec: one ``worker`` task per SLURM task, ``host:PORT``, ``host:PORT+1``, ... for
the tasks that share a host, hosts in sorted order. It reads a job step's variables
(``SLURM_STEP_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE``), which the workers started by
``srun`` have; the client runs in the batch script, outside any step, so there the job's
own allocation (``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE``) stands in for them — the
same hosts and tasks when the workers' ``srun`` takes the whole allocation, as the job
script in ``docs/guide/multihost.md`` does.

A worker finds its own task by its address (``SLURMD_NODENAME`` and ``SLURM_LOCALID``:
``host:PORT + local id``), so the spec's host order need not be SLURM's rank order.
TensorFlow loads only when a spec is made: the launchers check ``--cluster=SLURM:PORT``
before it does.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["DEFAULT_PORT", "check_environment", "is_slurm", "port_of", "spec", "task_index"]

DEFAULT_PORT = 8888  # SlurmClusterResolver's port_base


def is_slurm(text: str | None) -> bool:
    """Whether a ``--cluster`` value names SLURM (``SLURM`` or ``SLURM:PORT``)."""
    return text is not None and (text == "SLURM" or text.startswith("SLURM:"))


def port_of(text: str) -> int:
    """The first port of ``SLURM:PORT`` (:data:`DEFAULT_PORT` for ``SLURM``).

    Raises:
      ValueError: PORT is not a port number.
    """
    _, _, port = text.partition(":")
    if not port:
        return DEFAULT_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--cluster={text}: {port!r} is not a port; e.g. --cluster=SLURM:2222")
    return int(port)


def _var(*names: str) -> str:
    """The first of the SLURM variables ``names`` that is set.

    Raises:
      ValueError: none is (not inside a SLURM job).
    """
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    raise ValueError(
        f"--cluster=SLURM reads SLURM's environment, but {' and '.join(names)} "
        f"{'is' if len(names) == 1 else 'are'} not set: run inside a SLURM job (sbatch or "
        "salloc), or give --cluster as JSON"
    )


_NODES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")  # a step's hosts, else the job's
_TASKS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def check_environment() -> None:
    """Raises ValueError unless this process is inside a SLURM job (its hosts are set);
    no TensorFlow, for the launchers' flag checks."""
    _var(*_NODES)


def spec(text: str = "SLURM") -> tf.train.ClusterSpec:
    """The cluster of this SLURM job: a ``worker`` job of one task per SLURM task.

    Raises:
      ValueError: not inside a SLURM job, or a bad port.
    """
    import tensorflow as tf

    # TensorFlow's own parsers of SLURM's compressed lists ("node[01-03]", "2(x3),1"); the
    # resolver uses them itself, but does not export them.
    from tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver import (
        expand_hostlist,
        expand_tasks_per_node,
    )

    port = port_of(text)
    hosts = expand_hostlist(_var(*_NODES))
    counts = expand_tasks_per_node(_var(*_TASKS))
    per_host = dict(zip(hosts, counts, strict=True))
    most = max(per_host.values())
    os.environ.setdefault("SLURM_PROCID", "0")  # the batch script is the job's task 0
    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
        jobs={"worker": sum(per_host.values())},
        port_base=port,
        tasks_per_node=per_host,
        gpus_per_node=most,  # one "GPU" per task: the resolver assigns none (auto_set_gpu)
        gpus_per_task=1,
        auto_set_gpu=False,
    )
    return resolver.cluster_spec()


def task_index(cluster: tf.train.ClusterSpec, text: str = "SLURM") -> int:
    """This worker's index in ``cluster``'s ``worker`` job: the task at its own address
    (``SLURMD_NODENAME:PORT+SLURM_LOCALID``), else its ``SLURM_PROCID``.

    Raises:
      ValueError: not inside a SLURM job step.
    """
    host, local = os.environ.get("SLURMD_NODENAME"), os.environ.get("SLURM_LOCALID")
    addresses = cluster.job_tasks("worker")
    if host and local is not None and local.isdigit():
        own = f"{host}:{port_of(text) + int(local)}"
        if own in addresses:
            return addresses.index(own)
    return int(_var("SLURM_PROCID"))
