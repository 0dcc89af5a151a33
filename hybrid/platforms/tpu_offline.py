"""A TPU slice without a TPU: a real ``TPUStrategy`` on a described topology, for tracing.

    topology = tf.tpu.experimental.Topology(mesh_shape=..., device_coordinates=...)
    strategy, tpu = offline_strategy(topology, stages=2, replicas=2)
    pipe = Pipeline(model, tpu.mesh, strategy=strategy); pipe.compile(optimizer, loss)
    program = pipe.traced_train_step(x, y)       # the step's graph, never executed

``TPUStrategy`` asks its cluster resolver for the slice (``get_tpu_system_metadata``: the
topology, the TPU devices, the cores per host); a resolver that answers from a topology
given here lets a real strategy build its device assignment, replicate variables and trace
``strategy.run`` into the TPU program a slice would compile: ops annotated with their
logical core (``/device:TPU_REPLICATED_CORE:s``), ``CrossReplicaSum`` for every all-reduce,
the replica's inputs as ``TPUReplicatedInput``. Nothing connects to a TPU: variables the
strategy creates eagerly land on the host CPU (soft placement), and the traced program is
never run. What this cannot show: the compiled program's speed, memory and whether XLA
keeps the stages overlapped on the chips (``benchmarks/tpu_smoke.py`` on a slice).
"""

from __future__ import annotations

from typing import Any

from hybrid.platforms.tpu_mesh import TpuLayout, layout

__all__ = ["OFFLINE_JOB", "offline_resolver", "offline_strategy"]

# The job of the offline slice's devices: the local job, so that eager variable creation on
# a TPU device name falls back to this host's CPU instead of failing to find a remote job.
OFFLINE_JOB = "localhost"


def offline_resolver(topology: Any) -> Any:
    """A ``TPUClusterResolver`` whose TPU system is ``topology`` (one task per host in its
    device coordinates), without a TPU or a network.

    Raises:
      TypeError: ``topology`` is not a ``tf.tpu.experimental.Topology``.
    """
    import tensorflow as tf
    from tensorflow.python.tpu import tpu_system_metadata

    if not isinstance(topology, tf.tpu.experimental.Topology):
        raise TypeError(f"expected a tf.tpu.experimental.Topology, got {type(topology)}")
    tasks, per_task = int(topology.num_tasks), int(topology.num_tpus_per_task)
    devices = [
        tf.config.LogicalDevice(f"/job:{OFFLINE_JOB}/replica:0/task:{t}/device:{kind}:{i}", kind)
        for t in range(tasks)
        for kind, count in (("TPU", per_task), ("CPU", 1))
        for i in range(count)
    ]
    metadata = tpu_system_metadata.TPUSystemMetadata(
        num_cores=tasks * per_task,
        num_hosts=tasks,
        num_of_cores_per_host=per_task,
        topology=topology,
        devices=devices,
    )

    class OfflineResolver(tf.distribute.cluster_resolver.TPUClusterResolver):
        """Answers the strategy's questions from the topology (no TPU, no network)."""

        def __init__(self) -> None:  # the base connects to a TPU: skipped on purpose
            pass

        def get_tpu_system_metadata(self) -> Any:
            return metadata

        def master(self, task_type: Any = None, task_id: Any = None, rpc_layer: Any = None) -> str:
            return ""

        def cluster_spec(self) -> Any:
            return tf.train.ClusterSpec({})

        def get_job_name(self) -> str:
            return OFFLINE_JOB

    return OfflineResolver()


def offline_strategy(topology: Any, stages: int, replicas: int = 1) -> tuple[Any, TpuLayout]:
    """A real ``TPUStrategy`` on ``topology`` with the pipeline's device assignment: the
    placement of ``layout(topology, stages, replicas)`` (R replicas of S cores each), and
    that layout (its ``mesh`` is what the pipeline takes)."""
    import tensorflow as tf

    tpu = layout(topology, stages, replicas, job=OFFLINE_JOB)
    strategy = tf.distribute.TPUStrategy(
        offline_resolver(topology), experimental_device_assignment=tpu.device_assignment()
    )
    return strategy, tpu
