"""hybrid: pipeline × data-parallel training of Keras models on a 2-D device mesh.

import hybrid
hybrid.simulate_cpu_devices(4)                       # before TensorFlow starts
mesh = hybrid.DeviceMesh.create(stages=2, replicas=2)
pipe = hybrid.Pipeline(layers, mesh=mesh, loss=..., optimizer=..., micro_batches=4)
pipe.train_step(x, y)
"""

from hybrid import cluster, models, partition, planner, schedule, timeline, tpu_mesh
from hybrid.checkpoint import Checkpointer, CheckpointError
from hybrid.devices import local_devices, simulate_cpu_devices
from hybrid.mesh import DeviceMesh
from hybrid.pipeline import REMAT_MODES, Pipeline, TimedAction
from hybrid.planner import plan
from hybrid.schedule import Action, Schedule, ScheduleError

__all__ = [
    "REMAT_MODES",
    "Action",
    "CheckpointError",
    "Checkpointer",
    "DeviceMesh",
    "Pipeline",
    "Schedule",
    "ScheduleError",
    "TimedAction",
    "cluster",
    "local_devices",
    "models",
    "partition",
    "plan",
    "planner",
    "schedule",
    "simulate_cpu_devices",
    "timeline",
    "tpu_mesh",
]

__version__ = "0.1.0"
