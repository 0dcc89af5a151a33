"""Deferred weight gradients (``Pipeline(defer_weight_gradients=True)``): each stage's
weight gradients computed once per step, over all its micro-batches' rows at once.

With M micro-batches of b examples a stage computes each weight gradient M times, as a thin
GEMM over b rows added into a running sum: on a CPU (and any device whose GEMMs want many
rows) most of the cost of small micro-batches. Deferring keeps what the weight half of each
micro-batch's backward (W, ``split_programs``) reads, runs only its input-gradient half (B)
per micro-batch, and after the stage's last B runs W once, traced at M·b rows, on those
tensors concatenated: one GEMM over the step's rows, as one device does for the whole
batch. ``row_sums.plan`` proves that this is the same sum; where it cannot, the stage
computes W per micro-batch and warns, naming the op. Memory: every micro-batch's W inputs
(its layers' inputs and output gradients) stay until the end of the step's backward.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hybrid.engine.programs.residuals import Kept, Saved
from hybrid.engine.programs.row_sums import Plan, plan
from hybrid.engine.programs.split_programs import SplitPrograms

__all__ = ["backward", "run"]


def backward(
    stage: Any, saved: list[Saved], dys: list[list[tf.Tensor | None]], acc: list[Any]
) -> list[Any]:
    """``acc`` plus the weight gradients of every micro-batch in ``saved`` on ``stage`` (a
    ``StageReplica``; forwards kept with ``split``, each micro-batch's B run): once, over
    their rows joined, when the stage's W is a sum over rows (:func:`plan`), else one by
    one (with a warning saying why). The stage notes the plan or the reason."""
    kept = [s.kept for s in saved if s.kept is not None]
    assert len(kept) == len(saved), "deferral needs remat='never'"
    more = [[d for d in dy if d is not None] for dy in dys]
    full, found = _prove(stage, saved, kept, len(more[0]))
    stage.note_deferral(found)
    if isinstance(found, Plan):
        return stage.gradients_of(run(found, full, kept, more), acc, summed=False)
    warnings.warn(
        f"stage {stage.index} computes its weight gradients per micro-batch, not once for "
        f"the step (defer_weight_gradients): {found}",
        stacklevel=2,
    )
    for record, dy in zip(saved, dys, strict=True):
        _, acc = stage.backward(record, dy, need_dx=False, need_dw=True, acc=acc)
    return acc


def _prove(
    stage: Any, saved: list[Saved], kept: list[Kept], num_more: int
) -> tuple[SplitPrograms, Plan | str]:
    """The stage's programs traced at M times the micro-batch's rows, and whether their W
    run once is the sum of the micro-batches' W (:func:`plan`), or why not."""
    first, M = kept[0], len(saved)
    # The forward's last arguments: the copy's weights, then its other values (state).
    weights, local = stage.fixed_arguments(first.args)
    data = tf.nest.map_structure(
        lambda t: None if t is None else tf.TensorSpec([M * t.shape[0], *t.shape[1:]], t.dtype),
        (saved[0].inputs, saved[0].labels),
    )
    seed = saved[0].seed
    specs = [tf.TensorSpec.from_tensor(w) for w in weights]
    local_specs = [tf.TensorSpec.from_tensor(t) for t in local]
    whole = (*data, seed, specs, local_specs)
    full, _ = stage.kept_programs(whole, first.need_dx, True, accumulate=False)
    # The micro-batch's computation traced without running sums, to compare with ``full``.
    micro = (saved[0].inputs, saved[0].labels, seed, specs, local_specs)
    probe, _ = stage.kept_programs(micro, first.need_dx, True, accumulate=False)
    fixed = len(weights) + len(local)
    varying = [True] * (len(first.args) - fixed) + [False] * fixed
    per_row = [not stage.is_last] * num_more  # the last stage's: the loss's seed
    # A sparse gradient's (values, indices), W's last outputs, are rows: joined, not summed.
    rows = 2 * sum(stage.sparse)
    return full, plan(full, probe, M, varying, per_row, kept=first.programs, row_returns=rows)


def run(
    found: Plan, full: SplitPrograms, kept: Sequence[Kept], more: Sequence[Sequence[tf.Tensor]]
) -> list[tf.Tensor]:
    """``full``'s weight gradients, once, from every micro-batch's forward (``kept``) and
    backward arguments (``more``), joined as ``found`` says."""

    def join(values: list[tf.Tensor], concat: bool) -> tf.Tensor:
        return tf.concat(values, 0) if concat else values[0]

    def carried(k: Kept) -> list[tf.Tensor]:
        assert k.carried is not None, "W runs after every micro-batch's B"
        return k.carried

    args = [join([k.args[i] for k in kept], c) for i, c in enumerate(found.args)]
    residuals = [join([k.residuals[i] for k in kept], c) for i, c in found.residuals]
    grads = [join([m[i] for m in more], c) for i, c in enumerate(found.more)]
    if not full.cut_backward:
        return full.backward(args, residuals, grads)
    passed = [join([carried(k)[i] for k in kept], c) for i, c in found.carried]
    return full.weight_backward(args, residuals, grads, passed)
