"""Timed steps: per-device clocks inside the step, the measured timeline they give, and
where each device's time went.

Every action of a timed step is bracketed by timestamps read on its own device, and so is
each device's gradient all-reduce, so the timeline shows when each device really ran what,
without serializing the devices; ``StepView`` splits each device's step into compute,
transfers, all-reduce and idle (the compute/communication view of ``--timeline_every``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from hybrid.core.schedule import Action, Op

__all__ = [
    "COMMUNICATION_WARNING",
    "DeviceClock",
    "DeviceTime",
    "Recorder",
    "StepView",
    "TimedAction",
    "reduce_events",
    "reduce_starts",
    "timeline",
]


class TimedAction(NamedTuple):
    """When one action ran on its pipeline device, in seconds from the step's start (action
    None: the device's gradient all-reduce)."""

    device: int
    action: Action | None
    start: float
    end: float


class DeviceClock:
    """Reads the wall clock on one device without ordering it against other devices.

    A bare ``tf.timestamp()`` is a stateful op with no resource, and a ``tf.function``'s
    automatic control dependencies chain all such ops in program order: timestamps on
    different devices would serialize the whole step. Reading a per-device token variable
    inside a small function ties each clock read to that device's resource instead; reads
    of one resource are not ordered against each other, so :class:`Recorder` orders a
    device's clock reads itself.
    """

    def __init__(self, device: str) -> None:
        with tf.device(device):
            self._token = tf.Variable(0, dtype=tf.int32, trainable=False, name="clock_token")

        def now() -> tf.Tensor:
            with tf.control_dependencies([self._token.read_value()]):
                return tf.timestamp()

        self.now = tf.function(now, autograph=False)


class Recorder:
    """Brackets each action with timestamps from its device's clock (when clocks are given).

    The brackets hold for XLA-compiled stage programs: a compiled program starts once its
    control inputs have run. A program that is not compiled is inlined into the step by
    TensorFlow, and its ops then wait only for their data, so they may run before the
    action's start is read or after its end (measured: actions of 1–8 µs, zero-width ones);
    ``compiled=False`` warns so.
    """

    def __init__(self, clocks: Sequence[DeviceClock] | None, compiled: bool = True) -> None:
        self.clocks = clocks
        self.events: list[tuple[int, Action, tf.Tensor, tf.Tensor]] = []
        if clocks is not None and not compiled:
            warnings.warn(
                "timed step of stage programs that are not XLA-compiled (jit_compile=False): "
                "TensorFlow inlines them into the step, so each action's start and end need "
                "not bracket its work and the timeline's widths are unreliable; time steps "
                "with jit_compile=True (the default)",
                stacklevel=3,
            )

    def start(self, device: int, waits: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        if self.clocks is None:
            return []
        with tf.control_dependencies(list(waits)):
            return [self.clocks[device].now()]

    def end(
        self, device: int, action: Action, start: list[tf.Tensor], outputs: list[tf.Tensor]
    ) -> list[tf.Tensor]:
        """The clock read after ``start`` once ``outputs`` are ready, recorded, and returned
        for the device's next action to wait on ([] when not recording).

        Clock reads only read their token, and TensorFlow does not order reads of one
        resource against each other: without these waits an action's end could be read
        before its start (an action with no outputs of its own) or after the device's next
        action had run (the timeline would show that one taking no time)."""
        if self.clocks is None:
            return []
        with tf.control_dependencies(start + outputs):
            end = self.clocks[device].now()
        self.events.append((device, action, start[0], end))
        return [end]


def timeline(
    keys: Sequence[tuple[int, Action | None]], stamps: Sequence[Any], num_devices: int
) -> list[TimedAction]:
    """The measured actions in start order, in seconds from the step's first start.

    Args:
      keys: (device, action) of each timestamp pair, in the order the step recorded them.
      stamps: (start, end) timestamps read on each action's device.
      num_devices: pipeline devices.
    """
    origin = min(float(start) for start, _ in stamps)
    found, device_free = [], [0.0] * num_devices
    for (device, action), (start, end) in zip(keys, stamps, strict=True):
        # A device runs one action at a time: an action whose inputs were ready early
        # still began only when the device's previous action had ended.
        begin = max(float(start) - origin, device_free[device])
        finish = max(float(end) - origin, begin)
        device_free[device] = finish
        found.append(TimedAction(device, action, begin, finish))
    return sorted(found, key=lambda e: e.start)


def reduce_starts(clocks: Sequence[DeviceClock], tails: list[list[tf.Tensor]]) -> list[tf.Tensor]:
    """Each pipeline device's clock read once its last action has ended (``tails[d]``),
    appended to ``tails[d]``: the all-reduce, which waits for the tails, starts after it."""
    starts = []
    for d, clock in enumerate(clocks):
        with tf.control_dependencies(list(tails[d])):
            starts.append(clock.now())
        tails[d] = list(tails[d]) + [starts[-1]]
    return starts


def reduce_events(
    clocks: Sequence[DeviceClock],
    starts: Sequence[tf.Tensor],
    device_of_stage: Sequence[int],
    grads: Sequence[Sequence[tf.Tensor]],
) -> list[tuple[int, None, tf.Tensor, tf.Tensor]]:
    """Each pipeline device's all-reduce bracketed by its clock: from ``starts[d]``
    (:func:`reduce_starts`) to its stages' reduced gradients (``grads[k]`` of the stages k
    on it)."""
    events = []
    for d, clock in enumerate(clocks):
        reduced = [g for k, row in enumerate(device_of_stage) if row == d for g in grads[k]]
        with tf.control_dependencies(reduced):
            events.append((d, None, starts[d], clock.now()))
    return events


class DeviceTime(NamedTuple):
    """Where one pipeline device's time went in a timed step, in seconds.

    compute: its actions (F, B, W programs and what runs with them);
    transfer: waiting for an input another device had already produced (the activation or
      gradient crossing from the neighbouring stage, and the dispatch of the receive);
    all_reduce: from its last action to its stages' gradients summed over the replica
      group (the collective, and waiting for the group's slowest member);
    idle: the rest of the step (the pipeline bubble).
    """

    device: int
    compute: float
    transfer: float
    all_reduce: float
    idle: float

    @property
    def step(self) -> float:
        return self.compute + self.transfer + self.all_reduce + self.idle

    @property
    def communication_share(self) -> float:
        return (self.transfer + self.all_reduce) / self.step if self.step > 0 else 0.0


COMMUNICATION_WARNING = 0.30


class StepView(NamedTuple):
    """A timed step seen per device: its actions, its all-reduce spans, the breakdown."""

    actions: list[TimedAction]
    reduces: list[TimedAction]  # action None: the device's all-reduce
    devices: list[DeviceTime]

    @classmethod
    def of(cls, events: Sequence[TimedAction]) -> StepView:
        """The breakdown of a measured timeline (``timeline``'s events, all-reduces with
        action None)."""
        actions = [e for e in events if e.action is not None]
        reduces = [e for e in events if e.action is None]
        end = max((e.end for e in events), default=0.0)
        by_action = {e.action: e for e in actions if e.action is not None}
        devices = []
        for d in sorted({e.device for e in events}):
            mine = [a for a in actions if a.device == d]
            compute = sum(e.end - e.start for e in mine)
            transfer = sum(end - start for start, end in _waits(mine, by_action))
            reduce = sum(e.end - e.start for e in reduces if e.device == d)
            idle = max(0.0, end - compute - transfer - reduce)
            devices.append(DeviceTime(d, compute, transfer, reduce, idle))
        return cls(actions, reduces, devices)

    @property
    def idle_fraction(self) -> float:
        """The devices' mean idle share of the step (each device's ``idle / step``, the
        log line's and TensorBoard's ``idle_fraction``, averaged): the measured bubble."""
        shares = [d.idle / d.step for d in self.devices if d.step > 0]
        return sum(shares) / len(shares) if shares else 0.0

    def transfers(self) -> list[tuple[int, float, float]]:
        """(device, start, end) of every wait counted as a transfer in ``devices``."""
        by_action = {e.action: e for e in self.actions if e.action is not None}
        return [
            (d.device, start, end)
            for d in self.devices
            for start, end in _waits([a for a in self.actions if a.device == d.device], by_action)
        ]

    @property
    def communication_share(self) -> float:
        """The largest share of the step any device spent communicating."""
        return max((d.communication_share for d in self.devices), default=0.0)

    def warning(self) -> str | None:
        """What to do when communication takes over 30 % of a device's step; else None."""
        worst = max(self.devices, key=lambda d: d.communication_share, default=None)
        if worst is None or worst.communication_share <= COMMUNICATION_WARNING:
            return None
        return (
            f"communication takes {worst.communication_share:.0%} of the step on pipeline "
            f"device {worst.device} (transfers {worst.transfer * 1e3:.1f} ms, all-reduce "
            f"{worst.all_reduce * 1e3:.1f} ms of {worst.step * 1e3:.1f} ms): give each "
            "transfer more work to hide behind (more examples per micro-batch: a larger "
            "batch or fewer micro-batches; fewer stages), keep replica groups inside a host "
            "(--mesh_order), or compress the stage boundaries (boundary_dtype='bfloat16')"
        )


def _waits(
    mine: Sequence[TimedAction], by_action: dict[Action, TimedAction]
) -> list[tuple[float, float]]:
    """The transfer waits of one device's actions: from the end of the neighbouring stage's
    action that produced an input, when that came after the device was free, to the start
    of the action reading it."""
    waits = []
    free = 0.0  # when the device's previous action ended
    for e in sorted(mine, key=lambda a: a.start):
        producer = _producer(e.action, by_action) if e.action is not None else None
        if producer is not None and producer.device != e.device and producer.end >= free:
            if e.start > producer.end:
                waits.append((producer.end, e.start))
        free = e.end
    return waits


def _producer(action: Action, by_action: dict[Action, TimedAction]) -> TimedAction | None:
    """The action whose output ``action`` waits for from a neighbouring stage: F(k, m) the
    forward of k-1; B(k, m) the backward of k+1 (the fused forward of the last stage)."""
    k, m = action.stage, action.microbatch
    if action.op is Op.F:
        return by_action.get(Action(k - 1, Op.F, m)) if k > 0 else None
    if action.op is Op.B:
        return by_action.get(Action(k + 1, Op.B, m)) or by_action.get(Action(k + 1, Op.F, m))
    return None
