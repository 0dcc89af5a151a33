"""Pipeline schedules as plain data: the one namespace for the IR, generators, validation
and simulation (``hybrid.core.schedule``).

    from hybrid.core import schedule
    s = schedule.get("1f1b", num_stages=2, num_microbatches=4)   # generators.py
    schedule.validate(s)                                         # ordering.py
    schedule.simulate(s).bubble_fraction                         # simulation.py
    str(s)  # "0: F0 F1 B0 F2 B1 F3 B2 B3 | 1: F0 B0 F1 B1 ..."   # actions.py

Nothing here knows about TensorFlow. The engine interprets a schedule by issuing each
device's actions in order, in the global order :func:`execution_order` returns. Timeline
pictures of a simulated schedule: ``hybrid.run.timeline.render_schedule``.
"""

from hybrid.core.schedule import actions, generators, ordering, simulation
from hybrid.core.schedule.actions import *  # noqa: F403  (the namespace re-exports its parts)
from hybrid.core.schedule.generators import *  # noqa: F403
from hybrid.core.schedule.ordering import *  # noqa: F403
from hybrid.core.schedule.simulation import *  # noqa: F403

__all__ = sorted([*actions.__all__, *generators.__all__, *ordering.__all__, *simulation.__all__])
