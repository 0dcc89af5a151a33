"""The schedule as data: actions and the per-device lists that order them.

A schedule says, for every pipeline device, the order in which it runs its actions. An
action is one op of one model stage on one micro-batch:

    F  forward
    B  backward: input and weight gradients, or only the input gradient when the schedule
       also has W actions
    W  weight gradient (zero-bubble schedules split the backward into B and W)

    "0: F0 F1 B1 B0 | 1: F0 F1 B1 B0"               GPipe, 2 devices, 2 micro-batches

With ``v`` virtual stages per device (interleaved schedules) the model is cut into S·v
stages and device d holds stages d, d + S, d + 2S, …; actions then print with their stage,
``"0F1"`` (stage 0, forward, micro-batch 1). No TensorFlow here.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable, Mapping

__all__ = ["Action", "Op", "Schedule", "ScheduleError", "dependencies", "from_mapping"]


class ScheduleError(ValueError):
    """A schedule that cannot run; the message shows the grid with the bad cell marked."""


class Op(str, enum.Enum):
    """What an action computes: ``F`` forward, ``B`` backward, ``W`` weight gradient."""

    F = "F"
    B = "B"
    W = "W"

    def __str__(self) -> str:
        return self.value


_ACTION_RE = re.compile(r"^(\d+)?([FBW])(\d+)$")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One unit of work: ``op`` of model stage ``stage`` on micro-batch ``microbatch``."""

    stage: int
    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}"

    def long(self) -> str:
        """The form that names the stage too: ``"3B1"``."""
        return f"{self.stage}{self.op}{self.microbatch}"

    @classmethod
    def parse(cls, text: str, stage: int) -> Action:
        """Parses ``"F0"`` (an action of ``stage``) or ``"3B1"`` (an action of stage 3)."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}; expected an op F, B or W followed by a "
                "micro-batch number, e.g. 'F0' or 'B3', optionally after a stage: '2F0'"
            )
        own = stage if match.group(1) is None else int(match.group(1))
        return cls(stage=own, op=Op(match.group(2)), microbatch=int(match.group(3)))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Ordered actions per pipeline device: ``actions[d]`` runs on device ``d``.

    Attributes:
      num_stages: S, the devices along the pipeline axis.
      num_microbatches: M, the micro-batches each step is split into.
      actions: for each device, the actions it runs, in order.
      name: the generator that produced it, for messages.
      virtual_stages: v, model stages per device; model stage k lives on device k % S.
    """

    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    name: str = "custom"
    virtual_stages: int = 1

    @property
    def num_model_stages(self) -> int:
        """S·v: how many pieces the model is cut into."""
        return self.num_stages * self.virtual_stages

    @property
    def num_actions(self) -> int:
        """How many actions the schedule runs, over all its devices."""
        return sum(len(row) for row in self.actions)

    @property
    def splits_backward(self) -> bool:
        """True when backward is split into B (input gradient) and W (weight gradient)."""
        return any(a.op is Op.W for row in self.actions for a in row)

    def device_of(self, stage: int) -> int:
        return stage % self.num_stages

    def _cell(self, action: Action) -> str:
        return action.long() if self.virtual_stages > 1 else str(action)

    def __str__(self) -> str:
        return " | ".join(
            f"{d}: " + " ".join(self._cell(a) for a in row) for d, row in enumerate(self.actions)
        )

    @classmethod
    def parse(
        cls, text: str, num_microbatches: int | None = None, virtual_stages: int = 1
    ) -> Schedule:
        """Parses the string form ``"0: F0 F1 B1 B0 | 1: F0 B0 F1 B1"``."""
        rows = [row.strip() for row in text.split("|")]
        actions = []
        for d, row in enumerate(rows):
            head, sep, body = row.partition(":")
            if not sep or head.strip() != str(d):
                raise ValueError(f"row {d} of {text!r} must start with '{d}:'")
            actions.append(tuple(Action.parse(tok, d) for tok in body.split()))
        if num_microbatches is None:
            num_microbatches = 1 + max((a.microbatch for row in actions for a in row), default=-1)
        return cls(len(actions), num_microbatches, tuple(actions), virtual_stages=virtual_stages)

    def grid(self, mark: Iterable[tuple[int, int]] = ()) -> str:
        """Renders the schedule as a steps × devices text grid.

        Args:
          mark: (device, position) cells to highlight as ``>F0<``.
        """
        marked = set(mark)
        length = max((len(row) for row in self.actions), default=0)
        width = 7 if self.virtual_stages > 1 else 6
        lines = ["step  " + " ".join(f"{'d' + str(d):>{width}}" for d in range(self.num_stages))]
        for i in range(length):
            cells = []
            for d, row in enumerate(self.actions):
                text = self._cell(row[i]) if i < len(row) else "."
                cells.append(f"{'>' + text + '<' if (d, i) in marked else text:>{width}}")
            lines.append(f"{i:>4}  " + " ".join(cells))
        return "\n".join(lines)


def from_mapping(
    rows: Mapping[int, str], num_microbatches: int, virtual_stages: int = 1
) -> Schedule:
    """Builds a schedule from ``{device: "F0 F1 B0 B1"}`` (handy for hand-made schedules)."""
    actions = tuple(
        tuple(Action.parse(tok, d) for tok in rows[d].split()) for d in range(len(rows))
    )
    return Schedule(len(actions), num_microbatches, actions, virtual_stages=virtual_stages)


def dependencies(action: Action, num_model_stages: int) -> tuple[Action, ...]:
    """The actions whose results ``action`` consumes.

    F(k, m) reads the activation of F(k-1, m); B(k, m) reads its own forward F(k, m) and the
    input gradient of B(k+1, m); W(k, m) reads what B(k, m) computed.
    """
    k, m = action.stage, action.microbatch
    if action.op is Op.F:
        return (Action(k - 1, Op.F, m),) if k > 0 else ()
    if action.op is Op.W:
        return (Action(k, Op.B, m),)
    deps = [Action(k, Op.F, m)]
    if k + 1 < num_model_stages:
        deps.append(Action(k + 1, Op.B, m))
    return tuple(deps)
