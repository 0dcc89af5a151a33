"""What deferring the weight gradient would save: one device, by hand, side by side.

A stage that splits its batch into M micro-batches computes each weight gradient M times,
as a GEMM over b = B / M rows, and adds it into a running sum. Zero-bubble schedules (and
any engine that stores each layer's input and output gradient until the end of the step)
can instead compute it once, as one GEMM over all B rows. This measures the three on
--depth × Dense(--width) + ReLU, batch --batch, M = --micro_batches, all XLA, one device
(one intra-op thread), timed in alternation:

    whole_batch      forward + backward of the whole batch, one program (no micro-batches)
    accumulated      per micro-batch: a forward program, then a backward program that
                     returns the input gradient and adds dW to the running sums
    deferred         per micro-batch: a forward program, then a backward program that
                     returns the input gradient and each layer's output gradient; then
                     one program: dW = concat(inputs)ᵀ · concat(output gradients)

and checks that all three compute the same weight gradients.

    python benchmarks/weight_gradients.py [--batch=256 --micro_batches=8]

Writes benchmarks/results/weight_gradients.{json,png}; ends with one SUMMARY line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from absl import app, flags

import common

common.define_timing_flags(rounds=7, steps_per_round=3)
common.define_model_flags(depth=4, batch=256)
flags.DEFINE_integer("micro_batches", 8, "M.")
FLAGS = flags.FLAGS


def programs(weights: list[Any]) -> dict[str, Callable[[Any, Any], list[Any]]]:
    """The three ways to the weight gradients of Σ (output · dy) for inputs x and output
    gradient dy (a fixed upstream gradient: the loss does not matter here)."""
    import tensorflow as tf

    depth, micro = len(weights), FLAGS.micro_batches

    def forward(x: Any, ws: list[Any]) -> list[Any]:
        acts = [x]
        for w in ws:
            acts.append(tf.nn.relu(acts[-1] @ w))
        return acts

    def backward(acts: list[Any], dy: Any, ws: list[Any]) -> tuple[list[Any], list[Any]]:
        """Each layer's output gradient (after the ReLU) and its weight gradient."""
        g, gs, dws = dy, [None] * depth, [None] * depth
        for layer in reversed(range(depth)):
            g = g * tf.cast(acts[layer + 1] > 0, g.dtype)
            gs[layer] = g
            dws[layer] = tf.transpose(acts[layer]) @ g
            g = g @ tf.transpose(ws[layer])
        return gs, dws

    xla = tf.function(jit_compile=True)

    @xla
    def whole(x: Any, dy: Any, ws: list[Any]) -> list[Any]:
        return backward(forward(x, ws), dy, ws)[1]

    f_program = xla(forward)

    @xla
    def accumulate(acts: list[Any], dy: Any, ws: list[Any], sums: list[Any]) -> list[Any]:
        _, dws = backward(acts, dy, ws)
        return [s + d for s, d in zip(sums, dws, strict=True)]

    @xla
    def output_gradients(acts: list[Any], dy: Any, ws: list[Any]) -> list[Any]:
        return backward(acts, dy, ws)[0]  # XLA drops the unused dW GEMMs

    @xla
    def weight_gradients(inputs: list[list[Any]], grads: list[list[Any]]) -> list[Any]:
        return [
            tf.transpose(tf.concat(inputs[i], 0)) @ tf.concat(grads[i], 0) for i in range(depth)
        ]

    @tf.function
    def whole_batch(x: Any, dy: Any) -> list[Any]:
        return whole(x, dy, [w.read_value() for w in weights])

    @tf.function
    def accumulated(x: Any, dy: Any) -> list[Any]:
        ws = [w.read_value() for w in weights]
        sums = [tf.zeros_like(w) for w in ws]
        for xm, dym in zip(tf.split(x, micro), tf.split(dy, micro), strict=True):
            sums = accumulate(f_program(xm, ws), dym, ws, sums)
        return sums

    @tf.function
    def deferred(x: Any, dy: Any) -> list[Any]:
        ws = [w.read_value() for w in weights]
        inputs: list[list[Any]] = [[] for _ in range(depth)]
        grads: list[list[Any]] = [[] for _ in range(depth)]
        for xm, dym in zip(tf.split(x, micro), tf.split(dy, micro), strict=True):
            acts = f_program(xm, ws)
            for i, g in enumerate(output_gradients(acts, dym, ws)):
                inputs[i].append(acts[i])
                grads[i].append(g)
        return weight_gradients(inputs, grads)

    return {"whole_batch": whole_batch, "accumulated": accumulated, "deferred": deferred}


def main(argv: list[str]) -> None:
    del argv
    env = common.start("weight_gradients", devices=1)
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    width = FLAGS.width
    weights = [
        tf.Variable(rng.normal(0, width**-0.5, (width, width)).astype("float32"))
        for _ in range(FLAGS.depth)
    ]
    x = tf.constant(rng.normal(size=(FLAGS.batch, width)).astype("float32"))
    dy = tf.constant(rng.normal(size=(FLAGS.batch, width)).astype("float32"))
    ways = programs(weights)
    got = {name: [g.numpy() for g in f(x, dy)] for name, f in ways.items()}
    # deferred vs accumulated: the same micro-batch forwards, so the same ReLU masks; the
    # whole batch's GEMMs block differently, and a ReLU input that rounds to the other
    # side of 0 moves a row of its layer's gradient
    for name, ref, tolerance in (
        ("deferred", "accumulated", 1e-5),
        ("accumulated", "whole_batch", 1e-3),
    ):
        for i, (a, b) in enumerate(zip(got[name], got[ref], strict=True)):
            error = float(np.linalg.norm(a - b) / np.linalg.norm(b))
            assert error < tolerance, f"{name} vs {ref}: weight {i} differs by {error:.1e}"
    print("  the weight gradients agree (relative norm of the difference: deferred vs")
    print("  accumulated < 1e-5, accumulated vs whole batch < 1e-3)")
    candidates = {name: (lambda f=f: [g.numpy() for g in f(x, dy)][:0]) for name, f in ways.items()}
    samples, ms = common.time_steps(candidates, warmup=2)
    common.print_ms(ms, width=12)
    ratios = {
        "accumulated_vs_deferred": ms["accumulated"] / ms["deferred"],
        "deferred_vs_whole": ms["deferred"] / ms["whole_batch"],
    }
    for name, value in ratios.items():
        print(f"  {name:24s} {value:6.3f}")
    common.write_timed(
        "weight_gradients",
        env,
        common.flag_values(*common.TIMING_FLAGS, *common.MODEL_FLAGS, "micro_batches"),
        samples,
        ms,
        f"weight gradients of {FLAGS.depth} × Dense({width}), batch {FLAGS.batch}, "
        f"M = {FLAGS.micro_batches}: per micro-batch vs deferred vs whole batch",
        ratios=ratios,
    )
    print("SUMMARY weight_gradients " + " ".join(f"{k}={v:.3f}" for k, v in ratios.items()))


if __name__ == "__main__":
    app.run(main)
