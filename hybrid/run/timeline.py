"""Gantt charts of pipeline timelines, simulated or measured, as PNG files; a measured step
also as a Chrome trace (JSON: Perfetto, ``chrome://tracing``).

One row per pipeline device, one box per action coloured by its kind — F, B, W, and the last
stage's fused F+B (one program: a measured F whose B the step did not run on its own) — with
the micro-batch number inside (``stage:mb`` when a device holds several stages). A measured
step (:func:`plot_step`) adds each device's gradient all-reduce and the waits for an
activation or gradient from the neighbouring stage (transfers), draws time in milliseconds,
and titles the panel with the idle share the log line and TensorBoard report
(``StepView.idle_fraction``). Simulated timelines are in the schedule's cost units.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from hybrid.core.schedule import Action, Costs, Op, Schedule, simulate

if TYPE_CHECKING:  # no TensorFlow to draw a simulated schedule
    from hybrid.engine.step.clocks import StepView

__all__ = ["bubble_fraction", "chrome_trace", "plot_step", "plot_timelines", "render_schedule"]

FUSED = "F+B"
ALL_REDUCE = "all-reduce"
TRANSFER = "transfer"
COLORS = {
    "F": "#4c72b0",
    "B": "#dd8452",
    "W": "#55a868",
    FUSED: "#8172b3",
    ALL_REDUCE: "#7f7f7f",
    TRANSFER: "#c44e52",
}

Timeline = Iterable[tuple[Action, Any, Any]]
# (device, kind, start, end): a span that is not an action (ALL_REDUCE, TRANSFER)
Span = tuple[int, str, float, float]


def bubble_fraction(schedule: Schedule, timeline: Timeline) -> float:
    """Idle share of the devices between the first start and the last end."""
    items = list(timeline)
    start = min(float(s) for _, s, _ in items)
    end = max(float(e) for _, _, e in items)
    busy = sum(float(e) - float(s) for _, s, e in items)
    total = schedule.num_stages * (end - start)
    return 1.0 - busy / total if total > 0 else 0.0


def kind(action: Action, schedule: Schedule, present: set[Action]) -> str:
    """The action's kind as drawn: F, B, W, or F+B for a last-stage forward whose backward
    ran fused with it (absent from ``present``, the actions the timeline holds)."""
    last = schedule.num_model_stages - 1
    backward = Action(action.stage, Op.B, action.microbatch)
    if action.op is Op.F and action.stage == last and backward not in present:
        return FUSED
    return action.op.value


def _draw(
    ax: Any, schedule: Schedule, items: list[tuple[Action, Any, Any]], spans: Sequence[Span],
    scale: float,
) -> None:  # fmt: skip
    """One panel's boxes: actions (labelled with the micro-batch where the box is wide
    enough to hold it), then ``spans``."""
    present = {a for a, _, _ in items}
    span = max((float(e) for _, _, e in items), default=1.0) - min(
        (float(s) for _, s, _ in items), default=0.0
    )
    for action, start, end in items:
        d = schedule.device_of(action.stage)
        left, width = float(start) * scale, (float(end) - float(start)) * scale
        color = COLORS[kind(action, schedule, present)]
        ax.barh(d, width, left=left, height=0.8, color=color, edgecolor="black", linewidth=0.4)
        label = (
            f"{action.stage}:{action.microbatch}"
            if schedule.virtual_stages > 1
            else str(action.microbatch)
        )
        if width >= span * scale * 0.012 * len(label):  # a 12-inch axis: ~1.2 % a character
            ax.text(left + width / 2, d, label, ha="center", va="center", fontsize=7,
                    color="white", clip_on=True)  # fmt: skip
    for d, what, start, end in spans:
        height = 0.8 if what == ALL_REDUCE else 0.3
        ax.barh(d, (end - start) * scale, left=start * scale, height=height,
                color=COLORS[what], hatch="//" if what == ALL_REDUCE else None,
                edgecolor="black", linewidth=0.4)  # fmt: skip
    ax.set_yticks(range(schedule.num_stages))
    ax.set_yticklabels([f"device {d}" for d in range(schedule.num_stages)])
    ax.invert_yaxis()


def _figure(
    panels: Sequence[tuple[str, Schedule, list[tuple[Action, Any, Any]], Sequence[Span]]],
    path: str,
    scale: float,
    xlabel: str,
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(12, 1.6 + 0.6 * max(p[1].num_stages for p in panels) * len(panels)),
        squeeze=False,
    )
    shown: set[str] = set()
    for ax, (title, schedule, items, spans) in zip(axes[:, 0], panels, strict=True):
        _draw(ax, schedule, items, spans, scale)
        present = {a for a, _, _ in items}
        shown |= {kind(a, schedule, present) for a in present} | {s[1] for s in spans}
        ax.set_title(title, fontsize=10)
    axes[-1, 0].set_xlabel(xlabel)
    handles = [Patch(color=c, label=name) for name, c in COLORS.items() if name in shown]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # the legend below the time axis, clear of titles
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timelines(
    panels: Sequence[tuple[str, Schedule, Timeline]], path: str, seconds: bool = False
) -> str:
    """Draws one Gantt panel per (title, schedule, timeline) into the PNG at ``path``, each
    title followed by its :func:`bubble_fraction`; ``seconds``: the times are measured
    seconds, drawn in milliseconds (else the schedule's cost units)."""
    drawn = []
    for title, schedule, timeline in panels:
        # An action of no duration is not drawn (a simulated last-stage B whose cost the
        # measured fused F+B holds: its F is then drawn as the F+B it stands for).
        items = [(a, s, e) for a, s, e in timeline if float(e) > float(s)]
        drawn.append((f"{title} — bubble {bubble_fraction(schedule, items):.1%}", schedule,
                      items, ()))  # fmt: skip
    xlabel = "time (ms)" if seconds else "time (cost units of the schedule)"
    return _figure(drawn, path, 1e3 if seconds else 1.0, xlabel)


def plot_step(view: StepView, schedule: Schedule, title: str, path: str) -> str:
    """A measured step as a PNG Gantt chart in milliseconds: the actions (F, B, W, fused
    F+B), each device's all-reduce and its transfer waits, titled with the step's idle share
    and communication share as the log line defines them."""
    items = [(e.action, e.start, e.end) for e in view.actions if e.action is not None]
    spans = [(e.device, ALL_REDUCE, e.start, e.end) for e in view.reduces]
    spans += [(d, TRANSFER, start, end) for d, start, end in view.transfers()]
    heading = (
        f"{title}: idle {view.idle_fraction:.0%} (mean over devices), communication "
        f"{view.communication_share:.0%} (the busiest device)"
    )
    return _figure([(heading, schedule, items, spans)], path, 1e3, "time (ms)")


def chrome_trace(
    view: StepView, schedule: Schedule, path: str, devices: Sequence[str] | None = None
) -> str:
    """Writes a measured step as Chrome trace JSON (the Trace Event Format: open it in
    Perfetto or ``chrome://tracing``): one lane (thread) per pipeline device, one complete
    event per action (name ``F3``, ``B3``, ``W3``, ``F+B3``; category its kind), per
    all-reduce and per transfer wait, in microseconds from the step's start."""
    present = {e.action for e in view.actions if e.action is not None}
    events: list[dict[str, Any]] = []
    for d in range(schedule.num_stages):
        name = f"device {d}" + (f" ({devices[d]})" if devices else "")
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": d,
                       "args": {"name": name}})  # fmt: skip

    def complete(d: int, label: str, category: str, start: float, end: float) -> None:
        events.append({"ph": "X", "name": label, "cat": category, "pid": 0, "tid": d,
                       "ts": start * 1e6, "dur": (end - start) * 1e6})  # fmt: skip

    for e in view.actions:
        if e.action is not None:
            what = kind(e.action, schedule, present)
            stage = f"{e.action.stage}:" if schedule.virtual_stages > 1 else ""
            complete(e.device, f"{what}{stage}{e.action.microbatch}", what, e.start, e.end)
    for e in view.reduces:
        complete(e.device, ALL_REDUCE, ALL_REDUCE, e.start, e.end)
    for d, start, end in view.transfers():
        complete(d, TRANSFER, TRANSFER, start, end)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path


def render_schedule(
    schedule: Schedule, path: str, costs: Costs | None = None, title: str = ""
) -> str:
    """Draws the simulated timeline of ``schedule`` as a PNG Gantt chart at ``path``."""
    result = simulate(schedule, costs)
    return plot_timelines(
        [(title or f"{schedule.name} simulated", schedule, result.timeline)], path
    )
