"""Planner: predict step time, bubble and memory of every mesh configuration, and rank them.

For N devices the question is which S × R mesh, how many micro-batches M, which schedule and
remat mode train fastest within the memory of one device. The planner answers it from a cost
model instead of trying every configuration::

    profile = per-layer costs (measured once on one device, or given)   ->  CostProfile
    for every S × R = N, M, schedule (and virtual stages), remat mode:
        validate_run(config)                                # else rejected with its kind
        b        = global_batch / (R · M)                  # examples per micro-batch
        balance  = balance_by_cost(layer time at b, S · v)  # contiguous, min-max optimal
        costs    = schedule.Costs of every action:           # from the balanced layer costs
                     F = overhead + Σ forward(b)
                     B = overhead + Σ backward(b)   (+ Σ forward(b) when recomputed)
                         + per-array gradient accumulation
                     transfer = boundary bytes(b) / pipeline bandwidth + latency
        run      = schedule.simulate(schedule, costs)       # makespan, bubble, in-flight
        step     = max over devices d of  end_d + all_reduce(stage bytes_d) + update_d
        memory_d = weights, gradients, optimizer slots + in-flight activations (by remat)
    rank the configurations that fit by step time; say why the others were rejected

This module is the facade; each job lives in its own module:

    hardware.py     Link, Hardware (and ALLOCATOR_HEADROOM), all_reduce_time
    costs.py        LayerCost, CostProfile, uniform_profile, profile_model
    stage_costs.py  a model stage's costs, every action's seconds, activation bytes
    cost_model.py   Prediction, evaluate (one configuration)
    search.py       candidates, plan, choose_mesh, host_hardware
    report.py       Rejection, Plan and its table

A configuration is a :class:`hybrid.core.config.RunConfig` (``Config`` here is the same
class), checked by :func:`hybrid.core.config.validate_run`, the one place the rules of a run
live: the planner never proposes what ``Pipeline`` refuses. Everything is arithmetic on
plain numbers (no TensorFlow) except :func:`profile_model`, which measures a Keras model with
:mod:`hybrid.planning.profile` when a plan is asked for a list of layers.

Conventions: times in seconds, sizes in bytes, bandwidths in bytes per second.
"""

from hybrid.core.config import REMAT_MODES, ConfigError, RunConfig
from hybrid.planning.cost_model import Prediction, evaluate
from hybrid.planning.costs import CostProfile, LayerCost, profile_model, uniform_profile
from hybrid.planning.hardware import ALLOCATOR_HEADROOM, Hardware, Link, all_reduce_time
from hybrid.planning.report import Plan, Rejection
from hybrid.planning.search import candidates, choose_mesh, host_hardware, plan

Config = RunConfig
"""The planner's name for a run configuration: :class:`hybrid.core.config.RunConfig`."""

__all__ = [
    "ALLOCATOR_HEADROOM",
    "REMAT_MODES",
    "Config",
    "ConfigError",
    "CostProfile",
    "Hardware",
    "LayerCost",
    "Link",
    "Plan",
    "Prediction",
    "Rejection",
    "RunConfig",
    "all_reduce_time",
    "candidates",
    "choose_mesh",
    "evaluate",
    "host_hardware",
    "plan",
    "profile_model",
    "uniform_profile",
]
