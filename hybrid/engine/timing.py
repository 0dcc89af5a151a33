"""Timed steps: per-device clocks inside the step, and the measured timeline they give.

Every action of a timed step is bracketed by timestamps read on its own device, so the
timeline shows when each device really ran what, without serializing the devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from hybrid.core.schedule import Action

__all__ = ["DeviceClock", "Recorder", "TimedAction", "timeline"]


class TimedAction(NamedTuple):
    """When one action ran on its pipeline device, in seconds from the step's start."""

    device: int
    action: Action
    start: float
    end: float


class DeviceClock:
    """Reads the wall clock on one device without ordering it against other devices.

    A bare ``tf.timestamp()`` is a stateful op with no resource, and a ``tf.function``'s
    automatic control dependencies chain all such ops in program order: timestamps on
    different devices would serialize the whole step. Reading a per-device token variable
    inside a small function ties each clock read to that device's resource instead.
    """

    def __init__(self, device: str) -> None:
        with tf.device(device):
            self._token = tf.Variable(0, dtype=tf.int32, trainable=False, name="clock_token")

        def now() -> tf.Tensor:
            with tf.control_dependencies([self._token.read_value()]):
                return tf.timestamp()

        self.now = tf.function(now, autograph=False)


class Recorder:
    """Brackets each action with timestamps from its device's clock (when clocks are given)."""

    def __init__(self, clocks: Sequence[DeviceClock] | None) -> None:
        self.clocks = clocks
        self.events: list[tuple[int, Action, tf.Tensor, tf.Tensor]] = []

    def start(self, device: int, waits: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        if self.clocks is None:
            return []
        with tf.control_dependencies(list(waits)):
            return [self.clocks[device].now()]

    def end(
        self, device: int, action: Action, start: list[tf.Tensor], outputs: list[tf.Tensor]
    ) -> None:
        if self.clocks is not None:
            with tf.control_dependencies(outputs):
                self.events.append((device, action, start[0], self.clocks[device].now()))


def timeline(
    keys: Sequence[tuple[int, Action]], stamps: Sequence[Any], num_devices: int
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
