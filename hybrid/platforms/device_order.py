"""The order of a cluster's devices in an S × R mesh (no TensorFlow: names in, rows out).

Pipeline traffic is one activation per micro-batch per stage boundary, data-parallel traffic
is a stage's whole gradient every step, so by default each replica group (the R copies of one
stage) stays inside one task (host) and the pipeline crosses tasks
(``order="replica_groups_in_host"``); ``order="pipelines_in_host"`` keeps each replica's S
stages inside one task instead.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ORDERS", "check_mesh_shape", "check_order", "order_devices"]

ORDERS = ("replica_groups_in_host", "pipelines_in_host")


def check_order(order: str) -> None:
    """Raises ValueError unless ``order`` is one of :data:`ORDERS`."""
    if order not in ORDERS:
        raise ValueError(f"unknown device order {order!r}; choose one of {list(ORDERS)}")


def check_mesh_shape(stages: int, replicas: int) -> None:
    """Raises ValueError unless ``stages`` and ``replicas`` are positive integers."""
    for name, value in (("stages", stages), ("replicas", replicas)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


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

    Args:
      per_task: per task, its device names in device-index order.
      stages, replicas: S and R.
      order: one of :data:`ORDERS`.

    Raises:
      ValueError: unknown order, or the mesh does not fit the tasks' devices that way.
    """
    check_order(order)
    check_mesh_shape(stages, replicas)
    if order == "replica_groups_in_host":
        rows = _groups(per_task, replicas, stages, "replica groups")
        return tuple(tuple(row) for row in rows)
    pipes = _groups(per_task, stages, replicas, "pipelines")
    return tuple(tuple(pipes[r][s] for r in range(replicas)) for s in range(stages))


def _groups(per_task: Sequence[Sequence[str]], size: int, count: int, what: str) -> list[list[str]]:
    """``count`` groups of ``size`` devices, each inside one task where ``size`` fits.

    Tasks are filled in order, each with as many whole groups as it holds (a task smaller
    than a group holds none), so neighbouring groups share a task. A group larger than every
    task spans whole tasks (all tasks must then have the same number of devices, dividing
    ``size``).
    """
    counts = [len(devs) for devs in per_task]
    if any(size <= n for n in counts):
        return _groups_inside_tasks(per_task, size, count, what)
    return _groups_across_tasks(per_task, size, count, what)


def _groups_inside_tasks(
    per_task: Sequence[Sequence[str]], size: int, count: int, what: str
) -> list[list[str]]:
    """The first ``count`` groups of ``size`` consecutive devices of one task, task 0 first."""
    counts = [len(devs) for devs in per_task]
    groups = [
        list(devs[i : i + size]) for devs in per_task for i in range(0, len(devs) - size + 1, size)
    ]
    if len(groups) >= count:
        return groups[:count]
    raise ValueError(
        f"the mesh needs {count} {what} of {size} devices, each inside one task, but the "
        f"tasks' devices {counts} hold only {len(groups)}; add workers or devices per worker "
        "(start_server(..., simulated_devices=N) on CPU), shrink the mesh, or use the other order"
    )


def _groups_across_tasks(
    per_task: Sequence[Sequence[str]], size: int, count: int, what: str
) -> list[list[str]]:
    """``count`` groups of ``size`` devices, each made of whole tasks in task order."""
    counts = [len(devs) for devs in per_task]
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
