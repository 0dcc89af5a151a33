"""The memory wall: the largest model that trains under one fixed memory cap per device, on
1, 2, 4 and 8 capped devices.

Each device is a local worker process whose CPU allocator is capped at ``--cap``
(``hybrid-train --memory_per_device`` on ``--platform=cpu``: ``hybrid.platforms.local_workers``),
so "fits" is measured, not predicted. For a model family grown by depth (``--families``:
the reference Transformer at ``--width``, the reference ResNet) and each device count N,
every point is a real ``hybrid-train`` run of ``--train_steps`` steps that must end with exit
code 0 (a finite loss), in two modes:

    planner    --mesh=auto --simulated_devices=N: the planner's choice under the cap (mesh,
               M, schedule, remat, ZeRO-1, cut), then trained on the capped devices
    pipeline   --mesh=stage:N,replica:1 --remat=never --balance=params: pipelining alone

The depth doubles from the largest that trained on N/2 devices until a run fails, then
bisects (``--bisections``); the next depth up is shown to fail, with the run's one-line
error (``out of memory on pipeline device ...`` for a run that did not fit, or the planner's
"no configuration ... fits"). Where the planner refused it, that depth also runs under the
layout the planner chose one size down (its cut redone by ``--balance=memory``: mode
``planner-layout``), so the cap, not only the prediction, is seen to stop it. Each run
records the planner's predicted peak per device and each stage's allocator peak on its
capped device (the launcher's ``peak memory per stage`` line). Parameters are counted on
the model built here. ``ratio`` is a point's parameters over pipelining's on one device
(remat never: GPipe's "naive-1"), beside GPipe's (AmoebaNet-D, 82 M -> 1.8 B on 8
accelerators: 22x) and torchgpipe's (81.5 M -> 1.84 B).

    python benchmarks/memory_wall.py                                  # ~30 min on 2 cores
    python benchmarks/memory_wall.py --families=transformer --devices=1,2 --cap=96MiB
    python benchmarks/memory_wall.py --merge=results/a.json,results/b.json   # together

Writes ``results/memory_wall.json`` (``--output``; every run: depth, parameters, outcome,
the layout the run printed, its last error line) and ``results/memory_wall.png``
(parameters vs devices per mode and family, the papers' 22x beside).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any

from absl import app, flags

from hybrid.core.memory import parse_bytes

import common

MIB = 1 << 20

flags.DEFINE_list("families", ["transformer", "resnet"], "Model families: transformer, resnet.")
flags.DEFINE_list("devices", ["1", "2", "4", "8"], "Capped device counts.")
flags.DEFINE_list("modes", ["pipeline", "planner"], "pipeline (S = N alone), planner (auto).")
flags.DEFINE_string("cap", "128MiB", "Memory per device (the allocator's cap).")
flags.DEFINE_integer("width", 256, "Transformer d_model / ResNet channels.")
flags.DEFINE_integer("seq_len", 32, "Transformer context.")
flags.DEFINE_integer("batch", 8, "Global batch.")
flags.DEFINE_integer("train_steps", 2, "Steps each run trains.")
flags.DEFINE_integer("start_depth", 1, "The depth the first device count's search starts at.")
flags.DEFINE_integer("bisections", 2, "Bisection steps between the last fit and first failure.")
flags.DEFINE_integer("timeout_s", 900, "Seconds a run may take.")
flags.DEFINE_string("output", "memory_wall", "Result files' name under results/.")
flags.DEFINE_list("merge", [], "Result JSON files of earlier runs: shown and charted together.")
flags.DEFINE_string(
    "layout_checks",
    None,
    "A result JSON file of an earlier run: run its planner points' layout checks (the next "
    "depth under the planned layout) and write it under --output.",
)
FLAGS = flags.FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The papers' endpoints: parameters on 1 accelerator without pipelining, and on 8 with it.
PAPERS = {"GPipe (AmoebaNet-D)": (82e6, 1.8e9), "torchgpipe (AmoebaNet-D)": (81.5e6, 1.84e9)}


def parameters(family: str, depth: int) -> int:
    """The parameters of ``family`` at ``depth``, as the launcher builds it."""
    import keras

    from hybrid import models
    from hybrid.run.data_sources import VOCAB_SIZE

    if family == "transformer":
        layers = models.transformer(
            vocab_size=VOCAB_SIZE,
            seq_len=FLAGS.seq_len,
            d_model=FLAGS.width,
            num_heads=4,
            num_blocks=depth,
        )
        shape, dtype = (FLAGS.seq_len,), "int32"
    else:
        layers = models.resnet(10, FLAGS.width, depth)
        shape, dtype = (16, 16, 3), "float32"  # the launcher's synthetic images
    model = keras.Sequential([keras.Input(shape, dtype=dtype), *layers])
    return int(model.count_params())


def command(
    family: str, mode: str, devices: int, depth: int, layout: list[str] | None = None
) -> list[str]:
    """The ``hybrid-train`` run of one point (``layout``: these layout flags instead of the
    mode's)."""
    model = [f"--model={family}", f"--width={FLAGS.width}", f"--depth={depth}"]
    if family == "transformer":
        model += [f"--seq_len={FLAGS.seq_len}", "--num_heads=4"]
    else:
        model += ["--data=synthetic"]
    if layout is None and mode == "planner":
        layout = ["--mesh=auto", f"--simulated_devices={devices}"]
    elif layout is None:
        layout = [f"--mesh=stage:{devices},replica:1", "--remat=never", "--balance=params"]
        layout += [f"--micro_batches={min(devices, FLAGS.batch)}"]
    return [
        sys.executable, "-m", "hybrid.launch.train", *model, *layout,
        f"--memory_per_device={FLAGS.cap}", f"--global_batch_size={FLAGS.batch}",
        f"--train_steps={FLAGS.train_steps}", "--log_every=1",
    ]  # fmt: skip


def run(
    family: str, mode: str, devices: int, depth: int, layout: list[str] | None = None
) -> dict[str, Any]:
    """One point, run for real: whether it trained, and what it printed."""
    start = time.monotonic()
    try:
        done = subprocess.run(
            command(family, mode, devices, depth, layout),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=FLAGS.timeout_s,
            check=False,
        )
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired:
        code, out, err = None, "", f"did not finish in {FLAGS.timeout_s} s"
    layout = [line for line in out.splitlines() if line.startswith("mesh ")]
    errors = [line for line in err.strip().splitlines() if line.startswith("error:")]
    planned = re.search(r"^planned: (.*) \(predicted .*, ([\d.]+ [KMG]?i?B)/device\)$", out, re.M)
    peaks = re.search(r"^peak memory per stage \(replica 0\): (.*)$", out, re.M)
    measured = re.findall(r"stage \d+ ([\d.]+ [KMG]?i?B)", peaks.group(1)) if peaks else []
    row = {
        "family": family,
        "mode": mode,
        "devices": devices,
        "depth": depth,
        "parameters": parameters(family, depth),
        "trained": code == 0,
        "exit_code": code,
        # a device out of memory (the planner's refusal says "out of memory" of predictions)
        "out_of_memory": any(line.startswith("error: out of memory") for line in errors),
        "layout": layout[-1] if layout else "",
        "error": errors[-1] if errors else (err.strip().splitlines() or [""])[-1][:400],
        "seconds": time.monotonic() - start,
        # the planner's predicted peak per device (its fullest), and each stage's allocator
        # peak on replica 0 (chunks in use: a request served by a free chunk under twice its
        # size holds all of it, so near the cap this reads up to the cap)
        "planned_peak": parse_bytes(planned.group(2)) if planned else None,
        "planned_flags": planned.group(1).split() if planned else [],
        "measured_peaks": [parse_bytes(peak) for peak in measured],
    }
    outcome = "trained" if row["trained"] else f"failed: {row['error'][:160]}"
    if row["planned_peak"] and row["measured_peaks"]:
        most = max(row["measured_peaks"])
        outcome += (
            f" (planner {row['planned_peak'] / MIB:.1f} MiB/device, allocator peak "
            f"{most / MIB:.1f} MiB: {row['planned_peak'] / most - 1:+.0%})"
        )
    print(
        f"  {family:11s} {mode:8s} N={devices} depth {depth:4d} "
        f"({row['parameters'] / 1e6:7.2f} M params): {outcome} [{row['seconds']:.0f} s]",
        flush=True,
    )
    return row


def largest(family: str, mode: str, devices: int, start: int, rows: list) -> tuple[int, int]:
    """The largest depth that trains on ``devices`` (searching up from ``start``, which
    should train) and the smallest that failed above it."""
    good, bad = 0, None
    depth = max(1, start)
    while bad is None:
        row = run(family, mode, devices, depth)
        rows.append(row)
        if row["trained"]:
            good, depth = depth, depth * 2
        elif depth == 1 or good:
            bad = depth
        else:  # the start was too big already: halve
            depth //= 2
            if depth < 1:
                bad = 1
    for _ in range(FLAGS.bisections):
        if bad - good <= 1:
            break
        middle = (good + bad) // 2
        row = run(family, mode, devices, middle)
        rows.append(row)
        good, bad = (middle, bad) if row["trained"] else (good, middle)
    return good, bad


def _ran(rows: list[dict[str, Any]], key: tuple[str, str, int, int]) -> list[dict[str, Any]]:
    """The runs of (family, mode, devices, depth) ``key``, in order."""
    return [r for r in rows if (r["family"], r["mode"], r["devices"], r["depth"]) == key]


def under_planned_layout(
    family: str, devices: int, good: int, bad: int, rows: list
) -> dict[str, Any] | None:
    """The layout the planner chose for depth ``good`` run at depth ``bad``, which it
    refused (its cut redone by memory): whether the cap, not only the planner's prediction,
    stops the next size up. None without a planned layout to run."""
    planned = _ran(rows, (family, "planner", devices, good))
    if not planned or not planned[-1].get("planned_flags"):
        return None
    flags = planned[-1]["planned_flags"]
    layout = ["--balance=memory" if f.startswith("--balance=") else f for f in flags]
    row = run(family, "planner-layout", devices, bad, layout + [f"--simulated_devices={devices}"])
    rows.append(row)
    return row


def check_layout(p: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Where the planner refused point ``p``'s next depth, runs it under the layout planned
    for ``p`` (:func:`under_planned_layout`) and records the outcome in ``p``."""
    family, devices, good, bad = p["family"], p["devices"], p["depth"], p["next_depth"]
    refused = _ran(rows, (family, "planner", devices, bad))
    if refused and refused[-1]["error"].startswith("error: no configuration"):
        tried = under_planned_layout(family, devices, good, bad, rows)
        p["next_under_planned_layout"] = tried and (
            "trained" if tried["trained"] else tried["error"]
        )


def chart(points: list[dict[str, Any]]) -> str:
    """Parameters (relative to pipelining on one device) vs devices; the papers beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family in sorted({p["family"] for p in points}):
        for mode, style in (("pipeline", "o--"), ("planner", "s-")):
            line = [p for p in points if p["family"] == family and p["mode"] == mode]
            if line and all(p["ratio"] for p in line):
                devices = [p["devices"] for p in line]
                label = f"{family} (width {line[0]['width']}), {mode}"
                ax.plot(devices, [p["ratio"] for p in line], style, label=label)
    for name, (one, eight) in PAPERS.items():
        ax.plot([1, 8], [1, eight / one], ":", label=f"{name}: {eight / one:.0f}x")
    ax.plot([1, 8], [1, 8], color="grey", lw=0.8, label="linear")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("capped devices")
    ax.set_ylabel("largest model / pipelining's on 1 device (parameters)")
    caps = sorted({p["cap"] for p in points})
    ax.set_title(f"The memory wall under {' / '.join(caps)} per device")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return common.save_figure(fig, FLAGS.output)


def point(rows: list[dict[str, Any]], key: tuple[str, str, int], good: int, bad: int) -> dict:
    """The result of one (family, mode, devices) search: the largest depth that trained, its
    parameters and layout, and the next depth's error."""
    family, mode, devices = key
    ran = {r["depth"]: r for r in rows if (r["family"], r["mode"], r["devices"]) == key}
    return {
        "family": family,
        "mode": mode,
        "devices": devices,
        "depth": good,
        "parameters": ran[good]["parameters"] if good in ran else 0,
        "next_depth": bad,
        "next_error": ran[bad]["error"] if bad in ran else "",
        "layout": ran[good]["layout"] if good in ran else "",
        "cap": FLAGS.cap,
        "width": FLAGS.width,
        "planned_peak": ran[good].get("planned_peak") if good in ran else None,
        "measured_peaks": ran[good].get("measured_peaks", []) if good in ran else [],
    }


def with_ratios(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each point's parameters over pipelining's on one device of its family (its own
    mode's one-device point where pipelining did not run)."""
    for p in points:
        ones = {
            q["mode"]: q["parameters"]
            for q in points
            if (q["family"], q["devices"]) == (p["family"], 1)
        }
        base = ones.get("pipeline") or ones.get(p["mode"])
        p["ratio"] = p["parameters"] / base if base else None
    return points


def report(
    points: list[dict[str, Any]], rows: list[dict[str, Any]], env: dict, merged: Any = None
) -> None:
    """Prints the table and writes the JSON and the chart (``merged``: the merged runs'
    configurations, in place of this one's)."""
    print("\nlargest model that trains, per device count:")
    for p in points:
        ratio = f"{p['ratio']:.2f}x" if p["ratio"] else "-"
        print(
            f"  {p['family']:11s} {p['mode']:8s} N={p['devices']}: depth {p['depth']:4d}, "
            f"{p['parameters'] / 1e6:8.2f} M params ({ratio} of pipelining on 1 device); "
            f"depth {p['next_depth']}: {p['next_error'][:120]}"
        )
        if p.get("next_under_planned_layout"):
            print(
                f"    depth {p['next_depth']} under depth {p['depth']}'s planned layout: "
                f"{p['next_under_planned_layout'][:160]}"
            )
    config = merged or common.flag_values(
        "families", "devices", "modes", "cap", "width", "seq_len", "batch", "train_steps"
    )
    payload = {"env": env, "config": config, "points": points, "runs": rows, "papers": PAPERS}
    print("wrote", common.write_json(FLAGS.output, payload), chart(points))


def main(argv: list[str]) -> None:
    del argv
    env = common.environment()
    common.print_header("memory_wall", env)
    if FLAGS.merge:  # earlier runs' files, shown together
        files = [json.load(open(path)) for path in FLAGS.merge]
        rows = [r for f in files for r in f["runs"]]
        points = [
            {"cap": f["config"]["cap"], "width": f["config"]["width"], **p}
            for f in files
            for p in f["points"]
        ]
        report(with_ratios(points), rows, env, merged=[f["config"] for f in files])
        return
    if FLAGS.layout_checks:  # an earlier run's planner points, checked under their layouts
        earlier = json.load(open(FLAGS.layout_checks))
        for name in ("cap", "width", "seq_len", "batch", "train_steps"):  # run as it ran
            FLAGS[name].value = earlier["config"][name]
        rows, points = earlier["runs"], earlier["points"]
        for p in points:
            p.setdefault("cap", FLAGS.cap)
            p.setdefault("width", FLAGS.width)
            if p["mode"] == "planner" and "next_under_planned_layout" not in p:
                check_layout(p, rows)
        report(with_ratios(points), rows, env, merged=[earlier["config"]])
        return
    rows = []
    points = []
    for family in FLAGS.families:
        for mode in FLAGS.modes:
            start = FLAGS.start_depth
            for devices in map(int, FLAGS.devices):
                good, bad = largest(family, mode, devices, start, rows)
                start = max(good, 1)
                points.append(point(rows, (family, mode, devices), good, bad))
                if mode == "planner":
                    check_layout(points[-1], rows)
    report(with_ratios(points), rows, env)


if __name__ == "__main__":
    app.run(main)
