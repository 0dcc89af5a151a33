"""Gantt charts of pipeline timelines, simulated or measured, as PNG files.

One row per pipeline device, one box per action coloured by its kind (F, B, W) with the
micro-batch number inside (``stage:mb`` when a device holds several stages).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hybrid.core.schedule import Action, Costs, Op, Schedule, simulate

__all__ = ["bubble_fraction", "plot_timelines", "render_schedule"]

COLORS = {Op.F: "#4c72b0", Op.B: "#dd8452", Op.W: "#55a868"}

Timeline = Iterable[tuple[Action, Any, Any]]


def bubble_fraction(schedule: Schedule, timeline: Timeline) -> float:
    """Idle share of the devices between the first start and the last end."""
    items = list(timeline)
    start = min(float(s) for _, s, _ in items)
    end = max(float(e) for _, _, e in items)
    busy = sum(float(e) - float(s) for _, s, e in items)
    total = schedule.num_stages * (end - start)
    return 1.0 - busy / total if total > 0 else 0.0


def plot_timelines(panels: Sequence[tuple[str, Schedule, Timeline]], path: str) -> str:
    """Draws one Gantt panel per (title, schedule, timeline) into the PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(12, 1.2 + 0.6 * max(p[1].num_stages for p in panels) * len(panels)),
        squeeze=False,
    )
    for ax, (title, schedule, timeline) in zip(axes[:, 0], panels, strict=True):
        items = list(timeline)
        for action, start, end in items:
            d = schedule.device_of(action.stage)
            width = float(end) - float(start)
            ax.barh(
                d,
                width,
                left=float(start),
                height=0.8,
                color=COLORS[action.op],
                edgecolor="black",
                linewidth=0.4,
            )
            label = (
                f"{action.stage}:{action.microbatch}"
                if schedule.virtual_stages > 1
                else str(action.microbatch)
            )
            ax.text(
                float(start) + width / 2,
                d,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color="white",
                clip_on=True,
            )
        ax.set_yticks(range(schedule.num_stages))
        ax.set_yticklabels([f"device {d}" for d in range(schedule.num_stages)])
        ax.invert_yaxis()
        bubble = bubble_fraction(schedule, items)
        ax.set_title(f"{title} — bubble {bubble:.1%}", fontsize=10)
    axes[-1, 0].set_xlabel("time")
    handles = [Patch(color=c, label=op.value) for op, c in COLORS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_schedule(
    schedule: Schedule, path: str, costs: Costs | None = None, title: str = ""
) -> str:
    """Draws the simulated timeline of ``schedule`` as a PNG Gantt chart at ``path``."""
    result = simulate(schedule, costs)
    return plot_timelines(
        [(title or f"{schedule.name} simulated", schedule, result.timeline)], path
    )
