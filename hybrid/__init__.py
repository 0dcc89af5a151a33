"""hybrid: pipeline × data-parallel training of Keras models on a 2-D device mesh.

    import hybrid
    hybrid.simulate_cpu_devices(4)                       # before TensorFlow starts
    mesh = hybrid.DeviceMesh.create(stages=2, replicas=2)
    pipe = hybrid.Pipeline(layers, mesh=mesh, loss=..., optimizer=..., micro_batches=4)
    pipe.train_step(x, y)

Names are loaded on first use (PEP 562): ``import hybrid`` is cheap, and the floors that need
no TensorFlow (``hybrid.core``, ``hybrid.schedule``, ``hybrid.DeviceMesh``) never load it.
The floors, bottom up: ``core`` (no TensorFlow) < ``engine`` < ``planning`` < ``platforms``
< the operational modules (``checkpoint``, ``data``, ``trainer``, ``timeline``, ``models``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybrid.core.lazy import attributes
from hybrid.core.quiet import quiet_cpp_info

quiet_cpp_info()  # TensorFlow's C++ INFO banners, unless TF_CPP_MIN_LOG_LEVEL says otherwise

if TYPE_CHECKING:
    from hybrid.checkpoint import Checkpointer, CheckpointError
    from hybrid.core.config import REMAT_MODES, RunConfig, validate_run
    from hybrid.core.mesh import DeviceMesh, local_devices
    from hybrid.core.schedule import Action, Schedule, ScheduleError
    from hybrid.engine.devices import simulate_cpu_devices
    from hybrid.engine.pipeline import Pipeline, TimedAction
    from hybrid.engine.strategy_pipeline import StrategyPipeline
    from hybrid.planning.planner import plan

# public name -> (module, attribute); attribute None: the module itself.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "Action": ("hybrid.core.schedule", "Action"),
    "CheckpointError": ("hybrid.checkpoint", "CheckpointError"),
    "Checkpointer": ("hybrid.checkpoint", "Checkpointer"),
    "DeviceMesh": ("hybrid.core.mesh", "DeviceMesh"),
    "Pipeline": ("hybrid.engine.pipeline", "Pipeline"),
    "REMAT_MODES": ("hybrid.core.config", "REMAT_MODES"),
    "RunConfig": ("hybrid.core.config", "RunConfig"),
    "Schedule": ("hybrid.core.schedule", "Schedule"),
    "ScheduleError": ("hybrid.core.schedule", "ScheduleError"),
    "StrategyPipeline": ("hybrid.engine.strategy_pipeline", "StrategyPipeline"),
    "TimedAction": ("hybrid.engine.pipeline", "TimedAction"),
    "local_devices": ("hybrid.core.mesh", "local_devices"),
    "plan": ("hybrid.planning.planner", "plan"),
    "simulate_cpu_devices": ("hybrid.engine.devices", "simulate_cpu_devices"),
    "validate_run": ("hybrid.core.config", "validate_run"),
    # modules under short names
    "cluster": ("hybrid.platforms.cluster", None),
    "partition": ("hybrid.core.partition", None),
    "planner": ("hybrid.planning.planner", None),
    "schedule": ("hybrid.core.schedule", None),
    "tpu_mesh": ("hybrid.platforms.tpu_mesh", None),
    "tpu_offline": ("hybrid.platforms.tpu_offline", None),
}
_SUBMODULES = (
    "checkpoint",
    "core",
    "data",
    "engine",
    "models",
    "planning",
    "platforms",
    "serving",
    "timeline",
    "trainer",
)

__all__ = [
    "Action",
    "CheckpointError",
    "Checkpointer",
    "DeviceMesh",
    "Pipeline",
    "REMAT_MODES",
    "RunConfig",
    "Schedule",
    "ScheduleError",
    "StrategyPipeline",
    "TimedAction",
    "checkpoint",
    "cluster",
    "core",
    "data",
    "engine",
    "local_devices",
    "models",
    "partition",
    "plan",
    "planner",
    "planning",
    "platforms",
    "schedule",
    "serving",
    "simulate_cpu_devices",
    "timeline",
    "tpu_mesh",
    "tpu_offline",
    "trainer",
    "validate_run",
]

__version__ = "0.1.0"


__getattr__, __dir__ = attributes(
    "hybrid", globals(), {**_EXPORTS, **{n: (f"hybrid.{n}", None) for n in _SUBMODULES}}
)
