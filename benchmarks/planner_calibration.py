"""Planner calibration: predicted vs measured step time on this machine, and projections.

1. The sweep (``mesh_scaling.py``; run here when its JSON is missing or ``--run_sweep``)
   measured every configuration of N = 2 simulated devices: 1×1, 1×2 and 2×1 in every
   schedule.
2. A child process with 2 simulated devices profiles the same model layer by layer
   (``hybrid.planning.profile.measure_layers`` at every micro-batch size the sweep ran) and measures
   the links: the all-reduce between the two devices and a cross-device hand-over.
3. Machine constants, each fitted on its own rows; the other pipelined rows are held out:
     action_overhead           the profile's identity program (launching one program)
     compute_scale κ,          least squares on the 1×1 rows (a step there is a sum of
     tensor_overhead o_t       actions: linear in both; o_t: accumulating one weight
                               array's gradient, a TF op outside XLA, per micro-batch)
     host_cores C,             grid search on the 1×2 rows: the cores the two simulated
     replica latency           devices really get (below 2: two busy cores each run slower
                               than one alone) and the all-reduce's hand-over latency
     pipeline latency, C       grid search on the 2×1 rows of one schedule (1F1B), C
                               again (it ends as what the pipelined rows say)
   Every row is then predicted with ``hybrid.planning.evaluate`` at the balance it ran with;
   the 2×1 rows of GPipe, interleaved and ZB-H1 are the held-out check.
4. Projections from the cost model alone (no profiling, stated hardware): the GPipe
   Transformer scaling (K = 2, 4, 8 partitions, M = 32; published 1.8 / 3.4 / 6.3), and
   ranked plans for 64 and 2048 accelerators.

    python benchmarks/planner_calibration.py [--run_sweep]

Writes benchmarks/results/planner_calibration.{csv,json,png} and planner_projection.csv.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import Any

from absl import app, flags

import common  # first: it sets TensorFlow's environment and puts the source tree on sys.path

# isort: split
from hybrid import planning as planner
from hybrid.planning import Config, CostProfile, Hardware, LayerCost, Link

flags.DEFINE_string("sweep", "mesh_scaling", "Name of the sweep's results (benchmarks/results).")
flags.DEFINE_bool("run_sweep", False, "Run mesh_scaling.py first even if its JSON exists.")
flags.DEFINE_list("profile_batches", [], "Micro-batch sizes to profile (default: the sweep's).")
flags.DEFINE_integer("profile_repeats", 9, "Timing rounds of the profile.")
flags.DEFINE_bool(
    "reuse_profile", False, "Reuse the profile in <name>.json when it is of the same model."
)
flags.DEFINE_string("name", "planner_calibration", "Results go to benchmarks/results/<name>.*")
flags.DEFINE_string("child", None, "Internal: profile this model (JSON) in this process.")
FLAGS = flags.FLAGS

GiB = float(1 << 30)
MiB = float(1 << 20)


# ---------------------------------------------------------------------------
# 1-2. Sweep and profile
# ---------------------------------------------------------------------------


def load_sweep() -> dict:
    path = os.path.join(common.RESULTS, f"{FLAGS.sweep}.json")
    if FLAGS.run_sweep or not os.path.exists(path):
        here = os.path.dirname(os.path.abspath(__file__))
        import subprocess

        subprocess.run(
            [sys.executable, os.path.join(here, "mesh_scaling.py"), f"--name={FLAGS.sweep}"],
            check=True,
        )
    with open(path) as f:
        return json.load(f)


def profile_child(spec: dict) -> None:
    """In this process (2 simulated devices): the model's per-layer profile and the links."""
    import hybrid

    hybrid.simulate_cpu_devices(2)
    import keras
    import tensorflow as tf

    from hybrid.planning import profile
    from hybrid.planning.model_calls import model_calls

    tf.get_logger().setLevel("ERROR")
    data = common.reference_model(**spec["model"])
    optimizer = (
        (lambda: keras.optimizers.Adam(1e-4))
        if spec["optimizer"] == "adam"
        else (lambda: keras.optimizers.SGD(1e-3))
    )
    start = time.perf_counter()
    measurement = profile.measure_layers(
        model_calls(data["layers"], data["input_shape"], data["input_dtype"]),
        spec["batches"],
        "/device:CPU:0",
        loss=data["loss"],
        optimizer=optimizer,
        repeats=spec["repeats"],
    )
    seconds = time.perf_counter() - start
    cost = CostProfile.from_measurement(
        measurement, input_is_float=tf.as_dtype(data["input_dtype"]).is_floating
    )
    result = {
        "profile": cost.to_dict(),
        "launch_overhead_s": measurement.launch_overhead,
        "profile_seconds": seconds,
        "links": measure_links(spec["repeats"]),
        "environment": common.environment(),
    }
    print("RESULT " + json.dumps(result))


def measure_links(repeats: int) -> dict[str, list]:
    """Seconds of the all-reduce between the two devices and of a hand-over from the first
    to the second, at a few sizes (bytes)."""
    from hybrid.planning import profile

    source, target = "/device:CPU:0", "/device:CPU:1"
    sizes = [4 << 10, 1 << 20, 4 << 20]
    return {
        "sizes": sizes,
        "all_reduce_s": profile.measure_all_reduce([source, target], sizes, repeats=repeats),
        "transfer_s": profile.measure_transfer(source, target, sizes, repeats=repeats),
    }


def previous_profile(spec: dict) -> dict | None:
    """The profile child's result saved by an earlier run, when it profiled ``spec``."""
    path = os.path.join(common.RESULTS, f"{FLAGS.name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        saved = json.load(f).get("profile_run")
    return saved if saved and saved.get("spec") == spec else None


# ---------------------------------------------------------------------------
# 3. Fit and predict
# ---------------------------------------------------------------------------


def config_of(row: dict) -> Config:
    return Config(
        row["stages"],
        row["replicas"],
        row["micro_batches"],
        row["schedule"],
        row["remat"],
        row["virtual_stages"],
        tuple(row["balance"]),
    )


def predict(profile: CostProfile, rows: list[dict], hw: Hardware, slots: int) -> list[float]:
    return [planner.evaluate(profile, config_of(r), r["batch"], hw, slots).step_time for r in rows]


def fit_linear(
    profile: CostProfile, rows: list[dict], hw: Hardware, slots: int, fields: dict[str, float]
) -> Hardware:
    """Least squares (on relative error) of the Hardware ``fields`` for rows whose predicted
    step is linear in each of them (single-device rows: a sum of actions):
    P(h) = P(h0) + Σ_f (h_f - h0_f) · ∂P/∂f, each derivative from one probe of size
    ``fields[f]``. A field whose best value would be negative stays at its start value and
    the others are fitted again (non-negative least squares)."""
    import numpy as np

    base = np.array(predict(profile, rows, hw, slots))
    measured = np.array([r["step_ms"] / 1e3 for r in rows])
    columns = {}
    for name, probe in fields.items():
        moved = dataclasses.replace(hw, **{name: getattr(hw, name) + probe})
        columns[name] = (np.array(predict(profile, rows, moved, slots)) - base) / probe
    free = list(fields)
    while free:
        a = np.stack([columns[name] for name in free], axis=1) / measured[:, None]
        deltas, *_ = np.linalg.lstsq(a, (measured - base) / measured, rcond=None)
        values = {name: getattr(hw, name) + float(d) for name, d in zip(free, deltas, strict=True)}
        lowest = min(values, key=lambda name: values[name])
        if values[lowest] > 0:
            return dataclasses.replace(hw, **values)
        free.remove(lowest)
    return hw


def fit_grid(
    profile: CostProfile,
    rows: list[dict],
    slots: int,
    candidates: list[Hardware],
) -> Hardware:
    """The candidate whose predictions of ``rows`` have the least squared relative error."""

    def error(hw: Hardware) -> float:
        predicted = predict(profile, rows, hw, slots)
        return sum(
            (p / (r["step_ms"] / 1e3) - 1) ** 2 for p, r in zip(predicted, rows, strict=True)
        )

    return min(candidates, key=error) if rows else candidates[0]


def _role(row: dict) -> str:
    if row["stages"] == 1:
        return "fit: 1×1" if row["replicas"] == 1 else "fit: replicas"
    return "fit: pipeline" if row["schedule"] == FIT_SCHEDULE else "held out"


# The one schedule whose pipelined rows calibrate the pipeline link; the others are held out.
FIT_SCHEDULE = "1f1b"


def calibrate(sweep: dict, child: dict) -> tuple[Hardware, list[dict], dict]:
    """The machine constants fitted to the sweep's rows (see the module's step 3), every row
    predicted with them beside its measurement, and the fitted constants as a dict."""
    profile = CostProfile.from_dict(child["profile"])
    rows = [dict(r, batch=sweep["config"]["batch"]) for r in sweep["rows"]]
    slots = 2 if sweep["config"]["optimizer"] == "adam" else 0
    links = child["links"]
    # On 2 devices a ring all-reduce sends nbytes/2 twice: t = 2·lat + nbytes / bandwidth.
    reduce_fit = Link.fit(links["sizes"], links["all_reduce_s"])
    replica = Link(reduce_fit.bandwidth, reduce_fit.latency / 2)
    pipeline = Link.fit(links["sizes"], links["transfer_s"])
    # Launching one program inside the step costs what the profile's identity layer cost.
    hw = Hardware(pipeline=pipeline, replica=replica, action_overhead=child["launch_overhead_s"])
    roles = [_role(r) for r in rows]
    by_role: dict[str, list[dict]] = {}
    for r, role in zip(rows, roles, strict=True):
        by_role.setdefault(role, []).append(r)
    cores = int(sweep["environment"].get("cores") or 2)
    hw = fit_hardware(profile, by_role, hw, slots, cores)
    table = [compare(profile, r, role, hw, slots) for r, role in zip(rows, roles, strict=True)]
    fitted = {
        "compute_scale": hw.compute_scale,
        "tensor_overhead_s": hw.tensor_overhead,
        "action_overhead_s": hw.action_overhead,
        "host_cores": hw.host_cores,
        "pipeline_link": dataclasses.asdict(hw.pipeline),
        "replica_link": dataclasses.asdict(hw.replica),
        "measured_pipeline_link": dataclasses.asdict(pipeline),
        "measured_replica_link": dataclasses.asdict(replica),
        "optimizer_slots": slots,
    }
    return hw, table, fitted


def fit_hardware(
    profile: CostProfile, having: dict[str, list[dict]], hw: Hardware, slots: int, cores: int
) -> Hardware:
    """``hw`` with its constants fitted in turn, each on the rows of its role (``having``):
    the single-device overheads, the replicas' cores and latency, the pipeline latency (the
    grids start from the links in ``hw``, the measured ones)."""
    hw = fit_linear(
        profile,
        having.get("fit: 1×1", []),
        hw,
        slots,
        {"compute_scale": 1.0, "tensor_overhead": 1e-5},
    )
    # Replicas: the cores the simulated devices really get, and the cross-device latency of
    # the all-reduce (on a loaded host, waking the other device's thread).
    replica = hw.replica
    hw = fit_grid(
        profile,
        having.get("fit: replicas", []),
        slots,
        [
            dataclasses.replace(
                hw,
                host_cores=1.0 + (cores - 1.0) * i / 20,
                replica=Link(replica.bandwidth, replica.latency + 5e-5 * j),
            )
            for i in range(21)
            for j in range(41)
        ],
    )
    # Pipelines: the latency of handing an activation or a gradient to the next device, and
    # the cores two busy pipeline devices get (fitted again: a pipeline's devices are busy
    # at the same time only outside its bubble, its replicas always).
    pipeline = hw.pipeline
    return fit_grid(
        profile,
        having.get("fit: pipeline", []),
        slots,
        [
            dataclasses.replace(
                hw,
                host_cores=1.0 + (cores - 1.0) * i / 20,
                pipeline=Link(pipeline.bandwidth, pipeline.latency + 5e-5 * j),
            )
            for i in range(21)
            for j in range(61)
        ],
    )


def compare(profile: CostProfile, r: dict, role: str, hw: Hardware, slots: int) -> dict:
    """One sweep row's measurements beside the planner's predictions for it."""
    p = planner.evaluate(profile, config_of(r), r["batch"], hw, slots)
    measured = r["step_ms"] / 1e3
    return {
        "mesh": f"{r['stages']}x{r['replicas']}",
        "micro_batches": r["micro_batches"],
        "schedule": r["schedule"],
        "virtual_stages": r["virtual_stages"],
        "remat": r["remat"],
        "balance": r["balance"],
        "role": role,
        "measured_ms": 1e3 * measured,
        "predicted_ms": 1e3 * p.step_time,
        "error": p.step_time / measured - 1,
        "measured_bubble": r["measured_bubble"],
        "predicted_bubble": p.bubble,
        "measured_mib_total": r["peak_mib_total"],
        "predicted_mib_total": p.total_memory / MiB,
    }


def scatter(name: str, table: list[dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.5))
    for role, marker in (("fit", "s"), ("held out", "o")):
        mine = [t for t in table if t["role"].startswith(role)]
        ax.scatter(
            [t["measured_ms"] for t in mine],
            [t["predicted_ms"] for t in mine],
            marker=marker,
            label=role,
        )
    top = max(max(t["measured_ms"], t["predicted_ms"]) for t in table) * 1.1
    ax.plot([0, top], [0, top], "k-", lw=0.8)
    ax.plot([0, top], [0, 1.15 * top], "k:", lw=0.6)
    ax.plot([0, top], [0, 0.85 * top], "k:", lw=0.6, label="±15 %")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured ms / step")
    ax.set_ylabel("predicted ms / step")
    ax.legend(fontsize=8)
    ax.set_title("planner vs sweep (2 simulated CPU devices)", fontsize=10)
    fig.tight_layout()
    path = os.path.join(common.RESULTS, f"{name}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------
# 4. Projections from the cost model alone
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """An accelerator for analytic profiles.

    Attributes:
      flops: sustained FLOP/s on a Transformer's matrix multiplies.
      kernel: seconds of fixed cost per kernel (launch, pipeline fill), so small
        micro-batches use the device less well.
    """

    flops: float
    kernel: float


def _layer(
    name: str,
    acc: Accelerator,
    flops: float,
    kernels: int,
    params: float,
    stored: float,
    output: float,
) -> LayerCost:
    """A layer from its forward FLOPs, kernel count and bytes per example: forward =
    kernels·kernel + b·flops/rate; backward twice that (input and weight gradients), half
    of it for the input gradient alone. Given at b = 1 and b = 1024 so the fixed part stays."""
    sizes = (1, 1024)

    def per(fixed: float, each: float) -> tuple[float, ...]:
        return tuple(fixed + b * each for b in sizes)

    f = flops / acc.flops
    return LayerCost(
        name=name,
        forward=per(kernels * acc.kernel, f),
        backward=per(2 * kernels * acc.kernel, 2 * f),
        recompute_backward=per(2 * kernels * acc.kernel, 2 * f),
        input_backward=per(kernels * acc.kernel, f),
        stored_bytes=per(0, stored),
        working_bytes=per(0, stored),
        output_bytes=per(0, output),
        param_bytes=params,
    )


def transformer_profile(
    blocks: int, d: int, seq: int, vocab: int, acc: Accelerator, heads: int = 16
) -> CostProfile:
    """A decoder Transformer (embedding, ``blocks`` blocks with d_ff = 4d, a vocabulary
    head) in bf16 activations and fp32 weights. Per example and block: forward
    2·12·d²·seq + 4·seq²·d FLOPs, ~14 kernels; stored activations 34·seq·d + 5·heads·seq²
    bytes (the usual estimate for 16-bit training); a head of 2·d·vocab·seq FLOPs."""
    act = 2.0 * seq * d  # one bf16 hidden state per example
    layers = [_layer("embedding", acc, 0.0, 2, 4.0 * vocab * d, act, act)]
    block_flops = 2 * 12 * d * d * seq + 4 * seq * seq * d
    block_stored = 34.0 * seq * d + 5.0 * heads * seq * seq
    for i in range(blocks):
        layers.append(
            _layer(f"block_{i}", acc, block_flops, 14, 4.0 * 12 * d * d, block_stored, act)
        )
    logits = 6.0 * seq * vocab  # bf16 logits and their fp32 softmax
    layers.append(_layer("head", acc, 2.0 * d * vocab * seq, 4, 4.0 * d * vocab, logits, logits))
    return CostProfile(tuple(layers), (1, 1024), 4.0 * seq, input_is_float=False, source="analytic")


def _hardware(memory_gib: float, pipeline: Link, replica: Link, action_overhead: float) -> Hardware:
    """Stated hardware: memory per device (GiB), the stage and replica links, the fixed cost
    of one scheduled action (seconds)."""
    return Hardware(
        memory_per_device=memory_gib * GiB,
        pipeline=pipeline,
        replica=replica,
        action_overhead=action_overhead,
    )


# TPU v3-like core: 123 TFLOP/s bf16 per chip / 2 cores at ~50 % utilisation; ~5 µs per
# kernel; chip-to-chip links ~70 GB/s.
TPU_V3 = Accelerator(flops=30e12, kernel=5e-6)
TPU_V3_LINKS = _hardware(16, Link(70e9, 5e-6), Link(70e9, 5e-6), action_overhead=10e-6)
# GPipe (Huang et al. 2019), Table 3, Transformer on TPU: T(K, M) / T(2, 1). The M = 32 row
# is the target; the M = 1 and M = 4 rows changed the batch per configuration to fit memory.
PUBLISHED_GPIPE = {
    (2, 1): 1.0,
    (4, 1): 1.07,
    (8, 1): 1.3,
    (2, 4): 1.7,
    (4, 4): 3.2,
    (8, 4): 4.8,
    (2, 32): 1.8,
    (4, 32): 3.4,
    (8, 32): 6.3,
}


def gpipe_reproduction() -> tuple[list[dict], dict]:
    """Normalized throughput T(K, M) / T(2, 1) of 24 Transformer blocks under GPipe.

    The global batch stays 128 sequences, so M = 32 runs micro-batches of 4 and the fixed
    per-kernel cost weighs more; the 24 blocks are the layers partitioned (embedding and
    softmax left out). Remat "never": GPipe recomputes every forward once more, which costs
    every configuration the same share and cancels in the ratio, while this engine's fused
    last stage would exempt part of the model from it and tilt the comparison.
    """
    blocks = transformer_profile(24, 1024, 512, 8192, TPU_V3)
    profile = dataclasses.replace(blocks, layers=blocks.layers[1:-1])
    batch = 128
    hw = dataclasses.replace(TPU_V3_LINKS, memory_per_device=None)

    def throughput(K: int, M: int) -> float:
        config = Config(K, 1, M, "gpipe", "never")
        return planner.evaluate(profile, config, batch, hw).throughput

    base = throughput(2, 1)
    rows = []
    for M in (1, 4, 32):
        for K in (2, 4, 8):
            rows.append(
                {
                    "K": K,
                    "M": M,
                    "normalized_throughput": throughput(K, M) / base,
                    "published": PUBLISHED_GPIPE.get((K, M)),
                    "bubble_formula_bound": K * M / (M + K - 1),
                }
            )
    setup = {
        "model": "24 Transformer blocks, d_model 1024, d_ff 4096, seq 512",
        "global_batch": batch,
        "schedule": "gpipe, remat never (recomputation cancels in the ratio)",
        "accelerator": dataclasses.asdict(TPU_V3),
        "hardware": {k: str(v) for k, v in dataclasses.asdict(hw).items()},
    }
    return rows, setup


# GPU node (8 × H100-class, NVLink inside a node, 400 Gb/s between nodes): ~400 TFLOP/s
# sustained bf16, ~4 µs per kernel.
GPU = Accelerator(flops=400e12, kernel=4e-6)
GPU_CLUSTER = _hardware(
    80,
    pipeline=Link(50e9, 10e-6),  # between nodes
    replica=Link(200e9, 5e-6),  # NVLink ring inside a node
    action_overhead=20e-6,
)
# TPU v4-class pod: ~200 TFLOP/s sustained bf16 per chip, 32 GiB HBM, ~45 GB/s per ICI link.
TPU_V4 = Accelerator(flops=200e12, kernel=5e-6)
TPU_POD = _hardware(32, Link(45e9, 5e-6), Link(45e9, 5e-6), action_overhead=10e-6)


def large_mesh_plans() -> tuple[list[dict], list[str]]:
    """Ranked plans for 64 GPUs (a 48-block d=4096 model) and 2048 TPU chips (96 blocks)."""
    cases = [
        (
            "64 GPUs",
            64,
            transformer_profile(48, 4096, 2048, 32768, GPU, heads=32),
            512,
            GPU_CLUSTER,
        ),
        (
            "2048 TPU chips",
            2048,
            transformer_profile(96, 4096, 2048, 32768, TPU_V4, heads=32),
            4096,
            TPU_POD,
        ),
    ]
    out, tables = [], []
    for title, devices, profile, batch, hw in cases:
        start = time.perf_counter()
        result = planner.plan(
            profile,
            devices=devices,
            global_batch=batch,
            hardware=hw,
            micro_batches=[1, 4, 8, 16, 32, 64],
            schedules=["gpipe", "1f1b", "interleaved", "zb-h1"],
            remats=["never", "always"],
        )
        seconds = time.perf_counter() - start
        params = profile.param_bytes / 4
        tables.append(
            f"{title}: {profile.num_layers} layers, {params / 1e9:.1f} B parameters, global batch "
            f"{batch} ({seconds:.0f} s to plan)\n" + result.table(top=8, rejected=3)
        )
        out += [plan_row(title, rank, p) for rank, p in enumerate(result.ranked[:8], 1)]
    return out, tables


def plan_row(case: str, rank: int, p: Any) -> dict:
    """One ranked plan of a case as a row of planner_projection.csv."""
    c = p.config
    return {
        "case": case,
        "rank": rank,
        "mesh": f"{c.stages}x{c.replicas}",
        "micro_batches": c.micro_batches,
        "schedule": c.schedule,
        "virtual_stages": c.virtual_stages,
        "remat": c.remat,
        "step_s": p.step_time,
        "examples_per_s": p.throughput,
        "bubble": p.bubble,
        "memory_gib": p.peak_memory / GiB,
    }


# ---------------------------------------------------------------------------


def sweep_and_profile() -> tuple[dict, dict]:
    """The sweep's results, and the profile child's (run now, or reused with
    --reuse_profile), with the ``spec`` it profiled."""
    sweep = load_sweep()
    config = sweep["config"]
    batches = sorted({int(b) for b in FLAGS.profile_batches}) or sorted(
        {r["micro_batch_size"] for r in sweep["rows"]}
    )
    spec = {
        "model": {k: config[k] for k in common.REFERENCE_MODEL_FLAGS},
        "optimizer": config["optimizer"],
        "batches": batches,
        "repeats": FLAGS.profile_repeats,
    }
    child = previous_profile(spec) if FLAGS.reuse_profile else None
    if child is None:
        (child,) = common.run_child(
            [os.path.abspath(__file__), f"--child={json.dumps(spec)}"],
            env={"TF_CPU_ALLOCATOR_USE_BFC": "true"},
        )
        child["spec"] = spec
    return sweep, child


def print_calibration(fitted: dict, table: list[dict]) -> tuple[list[float], list[float], int]:
    """Prints the fitted constants and every row, predicted beside measured; returns the
    absolute relative errors, those of the held-out rows, and how many are within 15 %."""
    print(
        f"  action_overhead {1e3 * fitted['action_overhead_s']:.3f} ms (profiled); fitted on "
        f"the single-stage rows: compute_scale {fitted['compute_scale']:.3f}, "
        f"tensor_overhead {1e6 * fitted['tensor_overhead_s']:.1f} µs, host_cores "
        f"{fitted['host_cores']}"
    )
    print(f"  links: pipeline {fitted['pipeline_link']}, replica (ring) {fitted['replica_link']}")
    print(
        f"  {'mesh':>5} {'M':>3} {'schedule':<16} {'role':<14} {'measured':>9} {'predicted':>9} "
        f"{'error':>7} {'bubble m/p':>11} {'MiB m/p':>13}"
    )
    for t in table:
        sched = t["schedule"] + (f"(v={t['virtual_stages']})" if t["virtual_stages"] > 1 else "")
        print(
            f"  {t['mesh']:>5} {t['micro_batches']:>3} {sched:<16} {t['role']:<14} "
            f"{t['measured_ms']:>8.2f}m {t['predicted_ms']:>8.2f}m {t['error']:>+7.1%} "
            f"{t['measured_bubble']:>5.2f}/{t['predicted_bubble']:<5.2f} "
            f"{t['measured_mib_total']:>6.1f}/{t['predicted_mib_total']:<6.1f}"
        )
    errors = [abs(t["error"]) for t in table]
    held = [abs(t["error"]) for t in table if t["role"] == "held out"]
    within = sum(e <= 0.15 for e in errors)
    print(
        f"  |error|: median {statistics.median(errors):.1%}, max {max(errors):.1%}; held out: "
        f"median {statistics.median(held) if held else math.nan:.1%}, max "
        f"{max(held) if held else math.nan:.1%}; {within}/{len(errors)} within 15 %"
    )
    return errors, held, within


def print_projections(gpipe: list[dict], setup: dict, tables: list[str]) -> None:
    print(f"  GPipe projection ({setup['model']}, batch {setup['global_batch']}):")
    print(f"    {'M':>3} {'K':>2} {'predicted':>9} {'published':>9} {'K·M/(M+K-1)':>12}")
    for g in gpipe:
        pub = f"{g['published']:.1f}" if g["published"] else "-"
        print(
            f"    {g['M']:>3} {g['K']:>2} {g['normalized_throughput']:>9.2f} {pub:>9} "
            f"{g['bubble_formula_bound']:>12.2f}"
        )
    for text in tables:
        print("  " + text.replace("\n", "\n  "))


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.child:
        profile_child(json.loads(FLAGS.child))
        return
    started = time.perf_counter()
    sweep, child = sweep_and_profile()
    spec = child["spec"]
    common.print_header(FLAGS.name, child["environment"])
    print(
        f"  sweep: {FLAGS.sweep}.json ({sweep['environment'].get('date')}), model {spec['model']}"
    )
    print(f"  profile: batches {spec['batches']}, {child['profile_seconds']:.0f} s")
    hw, table, fitted = calibrate(sweep, child)
    errors, held, within = print_calibration(fitted, table)
    gpipe, gpipe_setup = gpipe_reproduction()
    large, tables = large_mesh_plans()
    print_projections(gpipe, gpipe_setup, tables)
    path = common.write_json(
        FLAGS.name,
        {
            "environment": child["environment"],
            "sweep": {
                "name": FLAGS.sweep,
                "environment": sweep["environment"],
                "config": sweep["config"],
            },
            "profile_run": child,
            "fitted": fitted,
            "predicted_vs_measured": table,
            "gpipe_projection": {"setup": gpipe_setup, "rows": gpipe},
            "large_meshes": large,
        },
    )
    csv_path = common.write_csv(FLAGS.name, table)
    common.write_csv("planner_projection", gpipe + large)
    png = scatter(FLAGS.name, table)
    print(f"  wrote {path}, {csv_path}, {png} in {time.perf_counter() - started:.0f} s")
    k = {g["K"]: g["normalized_throughput"] for g in gpipe if g["M"] == 32}
    print(
        f"SUMMARY {FLAGS.name} rows={len(table)} within_15pct={within} "
        f"median_abs_error={statistics.median(errors):.3f} max_abs_error={max(errors):.3f} "
        f"heldout_max_abs_error={max(held) if held else math.nan:.3f} "
        f"gpipe_k2={k[2]:.2f} gpipe_k4={k[4]:.2f} gpipe_k8={k[8]:.2f}"
    )


if __name__ == "__main__":
    app.run(main)
