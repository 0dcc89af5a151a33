"""How much slower a device computes while another device of the same host computes beside
it: simulated CPU devices share the host's cores, caches and memory bandwidth, and how much
two of them slow each other depends on the model (convolutions over large images barely,
many small attention ops a lot), so the profile measures it on the model's own heaviest
program (:func:`measure_concurrency`)."""

from __future__ import annotations

import statistics

from hybrid.engine.model.layer_costs import block
from hybrid.engine.traced import traced
from hybrid.planning.layer_programs import Probe, with_repeats
from hybrid.planning.stopwatch import run_seconds

__all__ = ["measure_concurrency"]


def measure_concurrency(
    probe: Probe, twin: Probe, repeats: int, repetitions: int | None = None
) -> float:
    """Seconds of ``probe``'s fused forward+backward while ``twin`` (the same program on
    another device of the host) runs it at the same time, over its seconds alone: the
    medians of ``repeats`` runs of each, timed in turns, the ratio at least 1. Each run
    repeats the program ``repetitions`` times (None: as the probe's arguments say).

    Both run as one graph function's two calls on their two devices, as a training step
    launches the actions of different devices."""
    args, twin_args = probe.args, twin.args
    if repetitions is not None:
        args, twin_args = with_repeats(args, repetitions), with_repeats(twin_args, repetitions)
    block(twin.programs.fused(*twin_args))  # compiled before anything is timed

    def alone() -> list[object]:
        return probe.programs.fused(*args)

    def together() -> list[object]:
        return [*probe.programs.fused(*args), *twin.programs.fused(*twin_args)]

    one, both = traced(alone), traced(together)
    block(one())
    block(both())
    times: dict[str, list[float]] = {"one": [], "both": []}
    for _ in range(repeats):
        times["one"].append(run_seconds(one, ()))
        times["both"].append(run_seconds(both, ()))
    return max(1.0, statistics.median(times["both"]) / statistics.median(times["one"]))
