"""The planner's predicted step time against the step measured, per model and mesh.

Per model, one process with 4 simulated CPU devices (1 intra-op thread each): the model is
profiled once (``hybrid.planning.costs.profile_model``: every layer call the Pipeline cuts,
at the micro-batch sizes the plans of all ``--plan_meshes`` run, thinned as ``hybrid.plan``
thins them; the profile's seconds are reported), then for each mesh S×R ``hybrid.plan`` on
that mesh alone (devices S·R, stages [S], this host's calibrated cost per step and per
action, ``hybrid.planning.host_calibration``) ranks the candidates; the top ``--top`` are
built with ``Pipeline(model, mesh, config=candidate.config)`` and timed side by side in
alternation (``--rounds`` rounds of ``--steps`` steps each, after two warm-up steps; the
median round), so the host's noise hits them alike:

    predicted_ms   the plan's step time for the candidate
    measured_ms    the step measured
    error          predicted / measured - 1
    best_gap       the planner's first candidate's measured step over the fastest
                   measured on the mesh, minus 1 (0: it chose the fastest)

Beside them, timed in the same alternation, the default layout: ``Pipeline(model, mesh)``
with no layout keyword (rank -1; its prediction is the cost model's for the layout it
built), with its gap to the fastest and both speedups over the 1×1 step (issue 42 item 6).

    python benchmarks/plan_accuracy.py [--models=mlp,gpt2] [--plan_meshes=1x1,2x1]

The models: the zoo's (``benchmarks/zoo.py``: Keras Applications CNNs at ``--image_size``,
KerasHub task models of 4 blocks of width 64 at ``--seq_len`` tokens), none of which the
planner was tuned on, and the reference ones as layer lists (``mlp``: 4 blocks of
Dense(256), LayerNorm, GELU; ``transformer``; ``resnet``; ``dense1024``: 4 × Dense(1024) +
Dense(10), issue 42's layout model, meant for ``--batch=256``); the global batch is ``--batch``.
Results: plan_accuracy.json, plan_accuracy.csv.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

from absl import app, flags

import common

flags.DEFINE_list(
    "models",
    ["mlp", "mobilenetv2", "resnet50", "efficientnetb0", "gpt2", "bert", "llama"],
    f"Reference models (mlp, transformer, resnet, dense1024) or of the zoo {common.ZOO_MODELS}.",
)
flags.DEFINE_integer("batch", 16, "Global batch.")
flags.DEFINE_integer("seq_len", 32, "Transformer tokens per example.")
flags.DEFINE_integer("image_size", 32, "CNN image height and width.")
flags.DEFINE_integer("steps", 5, "Steps per timing round of each candidate.")
flags.DEFINE_integer("rounds", 7, "Timing rounds (the candidates alternate; the median).")
flags.DEFINE_list("plan_meshes", ["1x1", "2x1", "1x2", "2x2"], "Meshes SxR to plan and time.")
flags.DEFINE_integer("top", 2, "Candidates timed per mesh, the planner's first ones.")
flags.DEFINE_string("plan_child", None, "Internal: measure this model in this process.")
FLAGS = flags.FLAGS

DEFAULT = -1  # the rank of the default layout's row


def _model(name: str) -> tuple[Any, Any, Any, Any]:
    """(model, x, y, loss) of a reference model (as layers) or a zoo model, seeded: the
    same weights every call."""
    import keras
    import numpy as np

    from hybrid.models import mlp, resnet, transformer

    if name in common.ZOO_MODELS:
        model, x, y = common.zoo_model(name, FLAGS.batch, FLAGS.image_size, FLAGS.seq_len)
        logits = common.zoo_logits(name)
        return model, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=logits)
    rng, n = np.random.default_rng(0), FLAGS.batch
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "transformer":
        seq = FLAGS.seq_len
        layers = transformer(seq_len=seq, d_model=64, num_blocks=4)
        x = rng.integers(0, 256, size=(n, seq)).astype("int32")
        return layers, x, rng.integers(0, 256, size=(n, seq)).astype("int32"), loss
    if name == "resnet":
        size = FLAGS.image_size
        layers = resnet(width=16, num_blocks=4)
        x = rng.normal(size=(n, size, size, 3)).astype("float32")
        return layers, x, rng.integers(0, 10, size=(n,)), loss
    if name == "dense1024":  # issue 42's layout model: 4 x Dense(1024) + Dense(10)
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(1024, activation="relu") for _ in range(4)]
        x = rng.normal(size=(n, 1024)).astype("float32")
        return layers + [keras.layers.Dense(10)], x, rng.integers(0, 10, size=(n,)), loss
    layers = mlp(width=256, depth=4)
    x = rng.normal(size=(n, 256)).astype("float32")
    return layers, x, rng.integers(0, 10, size=(n,)).astype("int32"), loss


def _meshes() -> list[tuple[int, int]]:
    """``--plan_meshes`` as (S, R) pairs."""
    pairs = [spec.split("x") for spec in FLAGS.plan_meshes]
    return [(int(s), int(r)) for s, r in pairs]


def _profile(name: str) -> Any:
    """The model's cost profile, measured once at every micro-batch size the plans of all
    ``--plan_meshes`` run (thinned as ``hybrid.plan`` thins them), and its seconds."""
    import time

    import keras

    from hybrid.planning import costs, search
    from hybrid.planning.model_calls import model_calls

    model, x, y, loss = _model(name)
    calls = model_calls(model, x=x)
    sizes: set[int] = set()
    for S, R in _meshes():
        sizes.update(search._profile_batches(S * R, FLAGS.batch, None, 32, [S]))
    keep = search.sizes_kept(len(calls.calls))
    began = time.perf_counter()
    found = costs.profile_model(
        calls, None, "float32", search._thinned(sorted(sizes), keep), loss=loss,
        target_shape=tuple(y.shape[1:]), optimizer=lambda: keras.optimizers.SGD(0.01),
    )  # fmt: skip
    return found, time.perf_counter() - began


def measure(name: str) -> list[dict[str, Any]]:
    """Per mesh, the plan's first ``--top`` candidates and the default layout (``Pipeline(model,
    mesh)`` with no layout keyword): predicted and measured steps."""
    import dataclasses

    import keras

    import hybrid
    from hybrid.planning import cost_model, host_hardware

    profile, profiled_s = _profile(name)
    rows = []
    for S, R in _meshes():
        hardware = host_hardware(S * R)
        plan = hybrid.plan(
            profile, devices=S * R, global_batch=FLAGS.batch, stages=[S],
            hardware=hardware, optimizer_slots=0, verbose=0,
        )  # fmt: skip
        configs = {rank: c.config for rank, c in enumerate(plan.ranked[: FLAGS.top])}
        configs[DEFAULT] = None  # the Pipeline's own defaults
        steps, pipes = {}, {}
        for rank, config in configs.items():
            model, x, y, loss = _model(name)
            pipe = hybrid.Pipeline(model, hybrid.DeviceMesh.create(S, R), config=config)
            pipe.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
            steps[rank], pipes[rank] = common.train_step(pipe, x, y), pipe
        samples = common.time_alternating(steps, FLAGS.rounds, FLAGS.steps, warmup=2)
        measured = {rank: statistics.median(samples[rank]) for rank in configs}
        fastest = min(measured.values())
        for rank in configs:
            if rank == DEFAULT:  # what the planner predicts for the layout the default built
                built = pipes[rank]
                c = dataclasses.replace(built.config, balance=tuple(built.balance))
                predicted = cost_model.evaluate(profile, c, FLAGS.batch, hardware, 0).step_time
            else:
                c, predicted = configs[rank], plan.ranked[rank].step_time
            rows.append(
                {
                    "model": name,
                    "mesh": f"{S}x{R}",
                    "rank": rank,
                    "layer_calls": profile.num_layers,
                    "profile_s": profiled_s,
                    "config": f"M={c.micro_batches} {c.schedule} remat={c.remat} "
                    f"v={c.virtual_stages} defer={c.defer_weight_gradients} "
                    f"balance={list(c.balance)}",
                    "predicted_ms": 1e3 * predicted,
                    "measured_ms": 1e3 * measured[rank],
                    "error": predicted / measured[rank] - 1,
                    # the planner's first candidate's, and the default's, measured step over
                    # the fastest measured on the mesh, minus 1
                    "best_gap": measured[rank] / fastest - 1 if rank in (0, DEFAULT) else None,
                }
            )
    return rows


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.plan_child:
        common.start("plan_accuracy", 4)
        print("RESULT " + json.dumps(measure(FLAGS.plan_child)))
        return
    env = common.start("plan_accuracy", devices=1)
    rows: list[dict[str, Any]] = []
    failed = {}
    for name in FLAGS.models:
        try:
            (got,) = common.run_child(
                [os.path.abspath(__file__), f"--plan_child={name}"]
                + common.flag_args(
                    "plan_meshes", "top", "batch", "image_size", "seq_len", "steps", "rounds"
                )
            )
        except RuntimeError as err:  # one model's failure is reported, the others still run
            failed[name] = str(err).strip().splitlines()[-1]
            print(f"{name:12s} failed: {failed[name]}", flush=True)
            continue
        for row in got:
            rows.append(row)
            who = "default" if row["rank"] == DEFAULT else f"#{row['rank']}"
            gap = "" if row["best_gap"] is None else f"  vs fastest {row['best_gap']:+.0%}"
            print(
                f"{name:12s} {row['mesh']:4s} {who:7s} {row['config']:58s} predicted "
                f"{row['predicted_ms']:8.2f} ms  measured {row['measured_ms']:8.2f} ms  "
                f"error {row['error']:+.0%}{gap}",
                flush=True,
            )
    planned = [r for r in rows if r["rank"] != DEFAULT]
    errors = sorted(abs(r["error"]) for r in planned)
    gaps = [r["best_gap"] for r in planned if r["best_gap"] is not None]
    if errors:
        print(
            f"SUMMARY plan_accuracy median |error| {statistics.median(errors):.0%}, worst "
            f"{errors[-1]:.0%} over {len(errors)} candidates; the chosen candidate within "
            f"10 % of the fastest measured on {sum(g <= 0.10 for g in gaps)} of {len(gaps)} "
            f"meshes (worst {max(gaps):+.0%})"
        )
    _print_defaults(rows)
    common.write_json("plan_accuracy", {"environment": env, "rows": rows, "failed": failed})
    common.write_csv("plan_accuracy", rows)


def _print_defaults(rows: list[dict[str, Any]]) -> None:
    """Per model and mesh: the default layout's measured step against the fastest measured
    on the mesh, and the speedups of both over the fastest 1×1 step."""
    single = {}
    for r in rows:
        if r["mesh"] == "1x1":
            single[r["model"]] = min(single.get(r["model"], r["measured_ms"]), r["measured_ms"])
    defaults = [r for r in rows if r["rank"] == DEFAULT]
    if not defaults:
        return
    print("default layout vs the fastest measured (ms per step; speedup over the 1x1 step):")
    for r in defaults:
        fastest = r["measured_ms"] / (1 + r["best_gap"])
        one = single.get(r["model"])
        speed = "" if one is None else (
            f"  speedup default {one / r['measured_ms']:.2f}x, fastest {one / fastest:.2f}x"
        )  # fmt: skip
        print(
            f"  {r['model']:12s} {r['mesh']:4s} default {r['measured_ms']:8.2f}  fastest "
            f"{fastest:8.2f}  default {r['best_gap']:+.0%}{speed}"
        )
    within = sum(r["best_gap"] <= 0.15 for r in defaults)
    print(f"SUMMARY defaults within 15 % of the fastest measured on {within} of {len(defaults)}")


if __name__ == "__main__":
    app.run(main)
