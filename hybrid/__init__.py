"""hybrid: pipeline × data-parallel training of Keras models on a 2-D device mesh.

    import hybrid
    hybrid.simulate_cpu_devices(4)                       # before TensorFlow starts
    mesh = hybrid.DeviceMesh.create(stages=2, replicas=2)
    pipe = hybrid.Pipeline(model, mesh, micro_batches=4)  # the parallel layout
    pipe.compile(optimizer="adam", loss="mse")           # what keras.Model.compile takes
    pipe.fit(x, y, batch_size=32)

The names a user needs are here; every module stays importable by its path
(``hybrid.core.schedule``, ``hybrid.platforms.cluster``, ``hybrid.run.serving``, ...). Names
are loaded on first use (PEP 562): ``import hybrid`` is cheap, and the floors that need no
TensorFlow (``hybrid.core``, ``hybrid.DeviceMesh``) never load it. The floors, bottom up:
``core`` (no TensorFlow) < ``engine`` < ``planning`` < ``platforms`` < ``run`` (operating a
training run) < ``launch`` (the flags).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybrid.core.lazy import attributes
from hybrid.core.quiet import quiet_cpp_info

quiet_cpp_info()  # TensorFlow's C++ INFO banners, unless TF_CPP_MIN_LOG_LEVEL says otherwise

if TYPE_CHECKING:
    from hybrid.core.config import ConfigError, RunConfig, validate_run
    from hybrid.core.mesh import DeviceMesh, local_devices
    from hybrid.core.schedule import Schedule, ScheduleError
    from hybrid.engine.api.pipeline import Pipeline
    from hybrid.engine.devices import simulate_cpu_devices
    from hybrid.planning.search import plan
    from hybrid.run.checkpoint import Checkpointer, CheckpointError

# public name -> (module, attribute)
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "CheckpointError": ("hybrid.run.checkpoint", "CheckpointError"),
    "Checkpointer": ("hybrid.run.checkpoint", "Checkpointer"),
    "ConfigError": ("hybrid.core.config", "ConfigError"),
    "DeviceMesh": ("hybrid.core.mesh", "DeviceMesh"),
    "Pipeline": ("hybrid.engine.api.pipeline", "Pipeline"),
    "RunConfig": ("hybrid.core.config", "RunConfig"),
    "Schedule": ("hybrid.core.schedule", "Schedule"),
    "ScheduleError": ("hybrid.core.schedule", "ScheduleError"),
    "local_devices": ("hybrid.core.mesh", "local_devices"),
    "plan": ("hybrid.planning.search", "plan"),
    "simulate_cpu_devices": ("hybrid.engine.devices", "simulate_cpu_devices"),
    "validate_run": ("hybrid.core.config", "validate_run"),
}
# the floors, loaded on first use as attributes (``hybrid.core``, ``hybrid.run``, ...)
_SUBMODULES = ("core", "engine", "launch", "models", "planning", "platforms", "run")

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "ConfigError",
    "DeviceMesh",
    "Pipeline",
    "RunConfig",
    "Schedule",
    "ScheduleError",
    "local_devices",
    "plan",
    "simulate_cpu_devices",
    "validate_run",
]

__version__ = "0.1.0"


__getattr__, __dir__ = attributes(
    "hybrid", globals(), {**_EXPORTS, **{n: (f"hybrid.{n}", None) for n in _SUBMODULES}}
)
