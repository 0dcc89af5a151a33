"""Schedule generators: pure functions ``(S, M[, v]) -> Schedule``, and their registry."""

from __future__ import annotations

from collections.abc import Callable

from hybrid.core.schedule.actions import Action, Op, Schedule, dependencies

__all__ = [
    "VIRTUAL_SCHEDULES",
    "forward_only",
    "get",
    "gpipe",
    "interleaved",
    "interleaved_problem",
    "names",
    "one_f_one_b",
    "zero_bubble_h1",
]


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"a schedule needs at least one stage and one micro-batch; got "
            f"num_stages={num_stages}, num_microbatches={num_microbatches}"
        )


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: all forwards, then all backwards in reverse micro-batch order, on every stage.

    With S = 2 stages and M = 4 micro-batches, uniform costs F = B = 1 give::

        s0: F0 F1 F2 F3 .  .  B3 B2 B1 B0
        s1: .  F0 F1 F2 F3 B3 B2 B1 B0 .

    makespan (M + S - 1)(F + B), bubble fraction (S - 1) / (M + S - 1), and every stage
    holds all M micro-batches' activations at its peak. The backward starts with the last
    micro-batch, whose activations the last stage has just made: that is the micro-batch
    remat="except_last" does not recompute.
    """
    _check_sizes(num_stages, num_microbatches)
    M = num_microbatches
    rows = tuple(
        tuple(Action(s, Op.F, m) for m in range(M))
        + tuple(Action(s, Op.B, m) for m in reversed(range(M)))
        for s in range(num_stages)
    )
    return Schedule(num_stages, M, rows, name="gpipe")


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm up with S - s - 1 forwards, then alternate F and B.

    S = 3, M = 4, uniform costs::

        s0: F0 F1 F2 .  .  .  B0 F3 .  B1 .  B2 .  B3
        s1: .  F0 F1 .  .  B0 F2 .  B1 F3 .  B2 B3 .
        s2: .  .  F0 B0 .  F1 B1 .  F2 B2 F3 B3 .  .      (shape, not exact times)

    Same bubble as GPipe, (S - 1) / (M + S - 1), but stage s never holds more than S - s
    micro-batches' activations (GPipe: M).
    """
    _check_sizes(num_stages, num_microbatches)
    M = num_microbatches
    rows = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, M)
        row = [Action(s, Op.F, m) for m in range(warmup)]
        for i in range(M - warmup):
            row += [Action(s, Op.F, warmup + i), Action(s, Op.B, i)]
        row += [Action(s, Op.B, m) for m in range(M - warmup, M)]
        rows.append(tuple(row))
    return Schedule(num_stages, M, tuple(rows), name="1f1b")


def interleaved_problem(num_stages: int, num_microbatches: int) -> str | None:
    """Why the interleaved schedule cannot run S stages with M micro-batches, or None.

    It issues micro-batches in groups of S, so M must be a multiple of S.
    """
    S, M = num_stages, num_microbatches
    if M % S:
        return (
            f"the interleaved schedule needs micro_batches to be a multiple of the pipeline "
            f"stages: M={M}, S={S}; use M={-(-M // S) * S} or another schedule"
        )
    return None


def interleaved(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: each device holds v model stages (d, d + S, …).

    Forward work unit k on every device runs micro-batch ``(k // (S·v))·S + k % S`` of its
    chunk ``(k // S) % v`` (backward: chunks in reverse). Device d warms up with
    ``2(S - d - 1) + (v - 1)S`` forwards, then alternates one forward and one backward.
    Bubble ≈ (S - 1) / (v·M + S - 1) with uniform costs per model stage.

    Raises:
      ValueError: M is not a multiple of S (the micro-batch groups of S would not fill).
    """
    _check_sizes(num_stages, num_microbatches)
    S, M, v = num_stages, num_microbatches, virtual_stages
    if v < 1:
        raise ValueError(f"virtual_stages must be at least 1, got {v}")
    problem = interleaved_problem(S, M)
    if problem:
        raise ValueError(problem)
    total = M * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // S) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (k // (S * v)) * S + k % S

    rows = []
    for d in range(S):
        warmup = min(2 * (S - d - 1) + (v - 1) * S, total)

        def fwd(k: int, d: int = d) -> Action:
            chunk, m = unit(k, backward=False)
            return Action(chunk * S + d, Op.F, m)

        def bwd(k: int, d: int = d) -> Action:
            chunk, m = unit(k, backward=True)
            return Action(chunk * S + d, Op.B, m)

        row = [fwd(k) for k in range(warmup)]
        for i in range(total - warmup):
            row += [fwd(warmup + i), bwd(i)]
        row += [bwd(k) for k in range(total - warmup, total)]
        rows.append(tuple(row))
    return Schedule(S, M, tuple(rows), name="interleaved", virtual_stages=v)


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into B and a deferred W.

    B computes only the input gradient, so the backward wave reaches stage 0 sooner; W (the
    weight gradient) waits and fills the time a device would otherwise idle. Built by list
    scheduling with unit costs (F = B = W): whenever a device is free it runs, in order of
    preference, a ready B, a ready F, or its oldest pending W. Stage s never has more than
    S - s micro-batches between their F and their W, so it holds no more activations than
    1F1B; the bubble is smaller whenever W costs anything.
    """
    _check_sizes(num_stages, num_microbatches)
    S, M = num_stages, num_microbatches
    finish: dict[Action, int] = {}
    free = [0] * S
    next_f = [0] * S
    next_b = [0] * S  # B runs in micro-batch order on each stage
    pending_w: list[list[int]] = [[] for _ in range(S)]
    rows: list[list[Action]] = [[] for _ in range(S)]

    def ready_at(action: Action) -> int | None:
        deps = dependencies(action, S)
        if not all(dep in finish for dep in deps):
            return None
        return max((finish[dep] for dep in deps), default=0)

    def candidates(s: int) -> list[tuple[int, int, Action]]:
        """(ready time, preference, action) for each action stage s could run next."""
        out = []
        if next_b[s] < M:
            b = Action(s, Op.B, next_b[s])
            t = ready_at(b)
            if t is not None:
                out.append((t, 0, b))
        in_flight = next_f[s] - (len(rows[s]) - next_f[s] - next_b[s])  # F done, W not done
        if next_f[s] < M and in_flight < S - s:
            f = Action(s, Op.F, next_f[s])
            t = ready_at(f)
            if t is not None:
                out.append((t, 1, f))
        if pending_w[s]:
            out.append((0, 2, Action(s, Op.W, pending_w[s][0])))
        return out

    total = 3 * S * M
    while sum(len(r) for r in rows) < total:
        best = None
        for s in range(S):
            for t, pref, action in candidates(s):
                start = max(t, free[s])
                key = (start, pref, s)
                if best is None or key < best[0]:
                    best = (key, action)
        assert best is not None, "zero_bubble_h1 stalled"  # unreachable: B0 is always ready
        (start, _, s), action = best
        finish[action] = start + 1
        free[s] = start + 1
        rows[s].append(action)
        if action.op is Op.F:
            next_f[s] += 1
        elif action.op is Op.B:
            next_b[s] += 1
            pending_w[s].append(action.microbatch)
        else:
            pending_w[s].pop(0)
    return Schedule(S, M, tuple(tuple(r) for r in rows), name="zb-h1")


def forward_only(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Every model stage runs F0 … F(M-1), device by device: the inference pipeline."""
    _check_sizes(num_stages, num_microbatches)
    S, M, v = num_stages, num_microbatches, virtual_stages
    rows = tuple(
        tuple(Action(c * S + d, Op.F, m) for c in range(v) for m in range(M)) for d in range(S)
    )
    return Schedule(S, M, rows, name="forward", virtual_stages=v)


_GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zero_bubble_h1,
}
VIRTUAL_SCHEDULES = frozenset({"interleaved"})  # the schedules with virtual stages


def names() -> list[str]:
    """The registered training schedule names, sorted."""
    return sorted(_GENERATORS)


def get(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Builds the registered schedule ``name`` for S devices and M micro-batches.

    Raises:
      ValueError: an unknown name, or virtual stages for a schedule that has none.
    """
    if name not in _GENERATORS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {names()}")
    if name in VIRTUAL_SCHEDULES:
        return _GENERATORS[name](num_stages, num_microbatches, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} runs one stage per device; virtual_stages={virtual_stages} "
            f"needs one of {sorted(VIRTUAL_SCHEDULES)}"
        )
    return _GENERATORS[name](num_stages, num_microbatches)
