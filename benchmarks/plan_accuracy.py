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
                   measured of the top candidates, minus 1 (0: it chose the fastest)

    python benchmarks/plan_accuracy.py [--models=mlp,gpt2] [--plan_meshes=1x1,2x1]

The models: the zoo's (``benchmarks/zoo.py``: Keras Applications CNNs at ``--image_size``,
KerasHub task models of 4 blocks of width 64 at ``--seq_len`` tokens), none of which the
planner was tuned on, and the reference ones as layer lists (``mlp``: 4 blocks of
Dense(256), LayerNorm, GELU; ``transformer``; ``resnet``); the global batch is ``--batch``.
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
    f"Reference models (mlp, transformer, resnet) or of the zoo {common.ZOO_MODELS}.",
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
    """Per mesh, the plan's first ``--top`` candidates: predicted and measured steps."""
    import keras

    import hybrid
    from hybrid.planning import host_hardware

    profile, profiled_s = _profile(name)
    rows = []
    for S, R in _meshes():
        plan = hybrid.plan(
            profile, devices=S * R, global_batch=FLAGS.batch, stages=[S],
            hardware=host_hardware(S * R), optimizer_slots=0, verbose=0,
        )  # fmt: skip
        steps = {}
        for rank, candidate in enumerate(plan.ranked[: FLAGS.top]):
            model, x, y, loss = _model(name)
            pipe = hybrid.Pipeline(model, hybrid.DeviceMesh.create(S, R), config=candidate.config)
            pipe.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
            steps[rank] = common.train_step(pipe, x, y)
        samples = common.time_alternating(steps, FLAGS.rounds, FLAGS.steps, warmup=2)
        timed = [
            (candidate, statistics.median(samples[rank]))
            for rank, candidate in enumerate(plan.ranked[: FLAGS.top])
        ]
        fastest = min(t for _, t in timed)
        for rank, (candidate, measured) in enumerate(timed):
            c = candidate.config
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
                    "predicted_ms": 1e3 * candidate.step_time,
                    "measured_ms": 1e3 * measured,
                    "error": candidate.step_time / measured - 1,
                    "best_gap": timed[0][1] / fastest - 1 if rank == 0 else None,
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
            gap = "" if row["best_gap"] is None else f"  chosen vs fastest {row['best_gap']:+.0%}"
            print(
                f"{name:12s} {row['mesh']:4s} #{row['rank']} {row['config']:58s} predicted "
                f"{row['predicted_ms']:8.2f} ms  measured {row['measured_ms']:8.2f} ms  "
                f"error {row['error']:+.0%}{gap}",
                flush=True,
            )
    errors = sorted(abs(r["error"]) for r in rows)
    gaps = [r["best_gap"] for r in rows if r["best_gap"] is not None]
    if errors:
        print(
            f"SUMMARY plan_accuracy median |error| {statistics.median(errors):.0%}, worst "
            f"{errors[-1]:.0%} over {len(errors)} candidates; the chosen candidate within "
            f"10 % of the fastest measured on {sum(g <= 0.10 for g in gaps)} of {len(gaps)} "
            f"meshes (worst {max(gaps):+.0%})"
        )
    common.write_json("plan_accuracy", {"environment": env, "rows": rows, "failed": failed})
    common.write_csv("plan_accuracy", rows)


if __name__ == "__main__":
    app.run(main)
