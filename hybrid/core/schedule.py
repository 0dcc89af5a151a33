"""Pipeline schedules as plain data: the one namespace for the IR, generators, validation
and simulation (``hybrid.schedule``).

    from hybrid import schedule
    s = schedule.get("1f1b", num_stages=2, num_microbatches=4)   # generators.py
    schedule.validate(s)                                         # ordering.py
    schedule.simulate(s).bubble_fraction                         # simulation.py
    str(s)  # "0: F0 F1 B0 F2 B1 F3 B2 B3 | 1: F0 B0 F1 B1 ..."   # actions.py

Nothing here knows about TensorFlow. The engine interprets a schedule by issuing each
device's actions in order, in the global order :func:`execution_order` returns. Timeline
pictures of a simulated schedule: ``hybrid.timeline.render_schedule``.
"""

from hybrid.core.actions import Action, Op, Schedule, ScheduleError, dependencies, from_mapping
from hybrid.core.generators import (
    VIRTUAL_SCHEDULES,
    forward_only,
    get,
    gpipe,
    interleaved,
    interleaved_problem,
    names,
    one_f_one_b,
    zero_bubble_h1,
)
from hybrid.core.ordering import execution_order, pairs_to_fuse, validate
from hybrid.core.simulation import Costs, SimulationResult, bubble_formula, simulate

__all__ = [
    "VIRTUAL_SCHEDULES",
    "Action",
    "Costs",
    "Op",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "bubble_formula",
    "dependencies",
    "execution_order",
    "forward_only",
    "from_mapping",
    "get",
    "gpipe",
    "interleaved",
    "interleaved_problem",
    "names",
    "one_f_one_b",
    "pairs_to_fuse",
    "simulate",
    "validate",
    "zero_bubble_h1",
]
