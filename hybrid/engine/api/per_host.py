"""Input read where it is used: one input pipeline per host, built on that host's CPU.

``Pipeline.distribute_datasets_from_function(dataset_fn)`` is TensorFlow's
``Strategy.distribute_datasets_from_function`` for a pipeline mesh. The hosts that hold a
replica's first stage each call ``dataset_fn(tf.distribute.InputContext(...))`` under their
own CPU, so the dataset, its files and its map functions live and run there; each step
takes one element per replica from the host that feeds it, in replica order, and the
feed copies its inputs to the replica's first-stage device (the same host) and its labels
to the last-stage device (host to host, past the client). The client sends no example
bytes; it only asks each host for its next elements.

Each dataset yields per-replica batches (``ctx.get_per_replica_batch_size(global_batch)``
rows, every element the same size: ``batch(..., drop_remainder=True)``), ``(x, y)`` or
``(x, y, sample_weight)`` as ``fit`` takes them. The step's global batch is the replicas'
elements joined in replica order: a host that feeds replicas r..r+k takes k elements per
step, in order, so plain Keras trained on those joined batches is the reference.

The pipelines are the tasks of the replicas' first-stage devices, numbered by the first
replica each feeds (``input_pipeline_id``); a mesh in one process has one. Which replicas
share a host follows the mesh's device order: with ``--mesh_order=replica_groups_in_host``
(the default) stage 0's replica group is on one host, which then reads every example;
``pipelines_in_host`` puts each replica's stages, and so its input, on its own host.
Python generators (``from_generator``) run in the client's Python and cannot be built on a
remote host.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from hybrid.engine import keras_private
from hybrid.engine.api.batches import Shard, flat_batch
from hybrid.engine.model.graph import Graph

__all__ = ["UNDER_STRATEGY", "PerHostDataset", "host_cpu", "input_hosts", "steps_of"]

UNDER_STRATEGY = (
    "distribute_datasets_from_function feeds a mesh of devices; under a tf.distribute "
    "strategy use the strategy's own (it places the input itself)"
)


def host_cpu(device: str) -> str:
    """The CPU of the task (host) that holds ``device``."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def input_hosts(firsts: Sequence[str]) -> list[tuple[str, list[int]]]:
    """The input pipelines of replicas whose inputs go to ``firsts[r]``: each host's CPU
    with the replicas it feeds, in the order of the first replica each feeds."""
    hosts: dict[str, list[int]] = {}
    for replica, device in enumerate(firsts):
        hosts.setdefault(host_cpu(device), []).append(replica)
    return list(hosts.items())


class PerHostDataset:
    """A dataset made on every input host; ``fit`` and ``evaluate`` take it as ``x``.

    Args:
      dataset_fn: ``InputContext -> tf.data.Dataset`` of per-replica batches.
      firsts: each replica's first-stage device (where its inputs go).
      graph: the model's graph (its inputs and outputs, to flatten each element).

    Raises:
      ValueError: ``dataset_fn`` returns no dataset, or one whose batches are not of one
        known size.
    """

    def __init__(
        self,
        dataset_fn: Callable[[tf.distribute.InputContext], Any],
        firsts: Sequence[str],
        graph: Graph,
    ) -> None:
        self.hosts = input_hosts(firsts)
        self.replicas, self.graph = len(firsts), graph
        self.limit: int | None = None  # steps, from take()
        self.datasets = []
        for index, (cpu, _) in enumerate(self.hosts):
            context = tf.distribute.InputContext(len(self.hosts), index, self.replicas)
            with tf.device(cpu):
                dataset = dataset_fn(context)
            if not isinstance(dataset, tf.data.Dataset):
                raise ValueError(
                    f"distribute_datasets_from_function: dataset_fn returned "
                    f"{type(dataset).__name__} for input pipeline {index}; return a "
                    "tf.data.Dataset of per-replica batches"
                )
            self.datasets.append(dataset)
        self.per_replica_batch = self._batch_size()

    def _batch_size(self) -> int:
        """The rows of every element (the same in every input pipeline)."""
        sizes: set[int | None] = set()
        for d in self.datasets:
            for spec in tf.nest.flatten(d.element_spec):
                sizes.add(spec.shape[0] if spec.shape.rank else None)
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                "distribute_datasets_from_function: every element must be a per-replica batch "
                f"of one known size; the datasets' batch dimensions are {sorted(map(str, sizes))} "
                "(use .batch(ctx.get_per_replica_batch_size(global_batch), "
                "drop_remainder=True))"
            )
        (size,) = sizes
        assert size is not None
        return size

    def check(self, micro_batches: int, specs: Sequence[Any]) -> None:
        """Raises ValueError unless the elements' inputs have the shapes and dtypes the
        pipeline was built for (``specs``) and each replica's batch splits into
        ``micro_batches`` (a per-host batch is not padded: its rows are all real examples)."""
        xs, _, _ = flat_batch(self.graph, *keras_private.unpack_x_y_sample_weight(self.zeros()))
        got = [(tuple(x.shape[1:]), x.dtype.name) for x in xs]
        built = [(tuple(s.shape), tf.as_dtype(s.dtype).name) for s in specs]
        if got != built:
            raise ValueError(
                f"distribute_datasets_from_function: the pipeline was built for inputs "
                f"(shape without the batch, dtype) {built}; the datasets yield {got}"
            )
        if self.per_replica_batch % micro_batches:
            raise ValueError(
                f"distribute_datasets_from_function: each replica's batch of "
                f"{self.per_replica_batch} rows does not split into micro_batches="
                f"{micro_batches}; make it a multiple of {micro_batches} (a global batch a "
                f"multiple of R × M = {self.replicas * micro_batches})"
            )

    @property
    def global_batch(self) -> int:
        """Examples per step: the per-replica batch times R."""
        return self.per_replica_batch * self.replicas

    def take(self, steps: int) -> PerHostDataset:
        """This dataset ending after ``steps`` steps (``tf.data.Dataset.take``'s meaning)."""
        taken = copy.copy(self)
        taken.limit = steps if self.limit is None else min(steps, self.limit)
        return taken

    def steps(self) -> tf.data.Dataset:
        """What Keras's epoch loop iterates: one element per step (a step index), as many
        as the datasets' cardinality allows (infinite, or unknown: endless, and the data's
        end, when it comes, ends the epoch), at most :meth:`take`'s."""
        driver = self._steps()
        return driver if self.limit is None else driver.take(self.limit)

    def _steps(self) -> tf.data.Dataset:
        counts = []
        for dataset, (cpu, fed) in zip(self.datasets, self.hosts, strict=True):
            with tf.device(cpu):  # where the dataset is
                cardinality = int(dataset.cardinality())
            if cardinality < 0:  # infinite or unknown
                return tf.data.Dataset.range(1).repeat()
            counts.append(cardinality // len(fed))
        return tf.data.Dataset.range(min(counts))

    def zeros(self) -> Any:
        """A global batch of zeros shaped as one step's elements joined, made on the
        client from the datasets' element spec: what builds the pipeline (and its metrics)
        before the first step."""
        return tf.nest.map_structure(
            lambda s: tf.zeros((self.global_batch, *s.shape[1:]), s.dtype),
            self.datasets[0].element_spec,
        )

    def batches(self, steps: Iterator[Any]) -> Iterator[list[Shard]]:
        """One epoch: each step's shards (replica order), every tensor on the CPU of the
        host that feeds its replica. New iterators of the datasets per epoch (as Keras's
        and TensorFlow's), made on their hosts."""
        iterators = []
        for dataset, (cpu, _) in zip(self.datasets, self.hosts, strict=True):
            with tf.device(cpu):
                iterators.append(iter(dataset))
        for _ in steps:
            parts: list[Shard | None] = [None] * self.replicas
            try:
                for iterator, (_, fed) in zip(iterators, self.hosts, strict=True):
                    for replica in fed:
                        element = keras_private.unpack_x_y_sample_weight(next(iterator))
                        xs, ys, ws = flat_batch(self.graph, *element)
                        parts[replica] = Shard(xs, ys, ws, None)
            except StopIteration:
                return  # a host's data ended: so does the epoch
            yield parts  # type: ignore[misc]


def steps_of(x: Any, y: Any, sample_weight: Any, method: str) -> tuple[Any, Any]:
    """``(x, None)``, or for a per-host dataset what Keras's loop iterates instead (one
    element per step) and the dataset.

    Raises:
      ValueError: a per-host dataset with ``y`` or ``sample_weight`` beside it.
    """
    if not isinstance(x, PerHostDataset):
        return x, None
    if y is not None or sample_weight is not None:
        raise ValueError(
            f"{method}: a per-host dataset yields its own labels and sample weights; do not "
            "pass y or sample_weight with it"
        )
    return x.steps(), x
