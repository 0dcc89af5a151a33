"""Stage programs: one traced forward-and-backward computation cut into two programs, the
gradients they take, and the deferral of weight gradients with the proof that it is exact.

The one entry of the subsystem; the engine imports only the names below::

    split(joint, args, ...)  -> SplitPrograms     a forward program and its backward program
                                                  (``split_programs.py``; values in
                                                  ``shape_values.py``)
    gradients(...)                                a stage's gradients (``gradients.py``)
    Kept, Saved                                   what a forward leaves for its backward
                                                  (``residuals.py``)
    deferred_backward(stage, saved, dys, sums)    a B whose W is deferred: W once per step
                                                  over all micro-batches' rows, when
                                                  ``row_sums.py`` proves it a sum over rows
                                                  (``deferral.py``, ``row_ops.py``)
"""

from hybrid.engine.programs.deferral import backward as deferred_backward
from hybrid.engine.programs.differentiation import Grads, differentiable, gradients, weight_penalty
from hybrid.engine.programs.residuals import Kept, Labels, Saved
from hybrid.engine.programs.split_programs import SplitPrograms, flatten, signature, split

__all__ = [
    "Grads",
    "Kept",
    "Labels",
    "Saved",
    "SplitPrograms",
    "deferred_backward",
    "differentiable",
    "flatten",
    "gradients",
    "signature",
    "split",
    "weight_penalty",
]
