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

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybrid.checkpoint import CheckpointError, Checkpointer
    from hybrid.core.config import RunConfig, validate_run
    from hybrid.core.mesh import DeviceMesh, local_devices
    from hybrid.core.schedule import Action, Schedule, ScheduleError
    from hybrid.engine.devices import simulate_cpu_devices
    from hybrid.engine.pipeline import REMAT_MODES, Pipeline, TimedAction
    from hybrid.planning.planner import plan

# public name -> (module, attribute); attribute None: the module itself.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "Action": ("hybrid.core.schedule", "Action"),
    "CheckpointError": ("hybrid.checkpoint", "CheckpointError"),
    "Checkpointer": ("hybrid.checkpoint", "Checkpointer"),
    "DeviceMesh": ("hybrid.core.mesh", "DeviceMesh"),
    "Pipeline": ("hybrid.engine.pipeline", "Pipeline"),
    "REMAT_MODES": ("hybrid.engine.pipeline", "REMAT_MODES"),
    "RunConfig": ("hybrid.core.config", "RunConfig"),
    "Schedule": ("hybrid.core.schedule", "Schedule"),
    "ScheduleError": ("hybrid.core.schedule", "ScheduleError"),
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
}
_SUBMODULES = (
    "checkpoint",
    "core",
    "data",
    "engine",
    "models",
    "planning",
    "platforms",
    "timeline",
    "trainer",
)

__all__ = sorted([*_EXPORTS, *_SUBMODULES])

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        loaded = importlib.import_module(module)
        value = loaded if attribute is None else getattr(loaded, attribute)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"hybrid.{name}")
    else:
        raise AttributeError(f"module 'hybrid' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
