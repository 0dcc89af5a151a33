"""Proof that a schedule can run, the global order the engine issues it in, and fusion.

:func:`validate` proves every micro-batch goes forward through all stages and back and that
no device waits on itself; :func:`execution_order` is the order the engine creates its ops
in; :func:`pairs_to_fuse` finds forwards whose backward follows at once (one program).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybrid.core.schedule.actions import Action, Op, Schedule, ScheduleError, dependencies

__all__ = ["execution_order", "pairs_to_fuse", "validate"]


def _check_contents(schedule: Schedule, ops: Sequence[Op]) -> None:
    """Every (stage, op, micro-batch) appears exactly once, on its own stage's device."""
    S, M, K = schedule.num_stages, schedule.num_microbatches, schedule.num_model_stages
    if len(schedule.actions) != S:
        raise ScheduleError(
            f"schedule has {len(schedule.actions)} device rows but num_stages={S}\n"
            + schedule.grid()
        )
    seen: set[Action] = set()
    for d, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            problem = None
            if not 0 <= a.stage < K:
                problem = f"stage {a.stage} is out of range [0, {K})"
            elif schedule.device_of(a.stage) != d:
                problem = f"action {a.long()} of stage {a.stage} is on device {d}"
            elif not 0 <= a.microbatch < M:
                problem = f"micro-batch {a.microbatch} is out of range [0, {M})"
            elif a.op not in ops:
                problem = f"op {a.op} is not allowed here; expected only {[str(o) for o in ops]}"
            elif a in seen:
                problem = f"{a} of stage {a.stage} appears twice"
            if problem:
                raise ScheduleError(f"{problem}:\n" + schedule.grid(mark=[(d, i)]))
            seen.add(a)
    for k in range(K):
        for op in ops:
            for m in range(M):
                if Action(k, op, m) not in seen:
                    raise ScheduleError(
                        f"stage {k} never runs {op}{m}; every micro-batch must run "
                        f"{'/'.join(str(o) for o in ops)} on every stage:\n" + schedule.grid()
                    )


def _ops_of(schedule: Schedule) -> tuple[Op, ...]:
    present = {a.op for row in schedule.actions for a in row}
    return tuple(op for op in Op if op in present or op is Op.F)


def execution_order(schedule: Schedule) -> list[Action]:
    """A global order of all actions that respects each device's order and every data edge.

    The engine creates its ops in this order; each device runs its own actions in the order
    the schedule gives. Conceptually: repeatedly let every device run its next action if the
    actions it depends on have run; if no device can move, the schedule deadlocks.

    Raises:
      ScheduleError: the schedule deadlocks; the grid marks each device's blocked action.
    """
    _check_contents(schedule, _ops_of(schedule))
    K = schedule.num_model_stages
    done: set[Action] = set()
    cursor = [0] * schedule.num_stages
    order: list[Action] = []
    total = schedule.num_actions
    while len(order) < total:
        progressed = False
        for d, row in enumerate(schedule.actions):
            while cursor[d] < len(row):
                action = row[cursor[d]]
                if not all(dep in done for dep in dependencies(action, K)):
                    break
                done.add(action)
                order.append(action)
                cursor[d] += 1
                progressed = True
        if not progressed:
            blocked = [
                (d, cursor[d])
                for d in range(schedule.num_stages)
                if cursor[d] < len(schedule.actions[d])
            ]
            waits = "; ".join(
                f"device {d} waits at {schedule.actions[d][i].long()} for "
                + ", ".join(
                    dep.long() for dep in dependencies(schedule.actions[d][i], K) if dep not in done
                )
                for d, i in blocked
            )
            raise ScheduleError(f"schedule deadlocks: {waits}\n" + schedule.grid(mark=blocked))
    return order


def validate(schedule: Schedule) -> Schedule:
    """Checks that ``schedule`` can train: returns it unchanged, or raises ScheduleError.

    Every micro-batch must run F then B (then W, if the schedule splits the backward) once on
    every stage, F in stage order and B in reverse; each device must be able to run its list
    in order without waiting on itself.
    """
    if not any(a.op is Op.B for row in schedule.actions for a in row):
        raise ScheduleError("a training schedule needs backward actions:\n" + schedule.grid())
    execution_order(schedule)
    return schedule


def pairs_to_fuse(schedule: Schedule) -> frozenset[Action]:
    """The last model stage's F actions whose whole backward follows them immediately.

    Such a pair needs no stored activations: the engine runs it as one forward+backward
    program (the loss gradient is known), e.g. GPipe's last micro-batch, or every
    micro-batch of the last stage in 1F1B. With a split backward the whole run F B W must
    be adjacent.
    """
    last = schedule.num_model_stages - 1
    row = schedule.actions[schedule.device_of(last)]
    tail = (Op.B, Op.W) if schedule.splits_backward else (Op.B,)
    fused = []
    for i, a in enumerate(row):
        following = row[i + 1 : i + 1 + len(tail)]
        if (
            a.stage == last
            and a.op is Op.F
            and following == tuple(Action(last, op, a.microbatch) for op in tail)
        ):
            fused.append(a)
    return frozenset(fused)
