"""Cloud TPU: connect to a node, and supervise a training run through preemptions.

    system = resolve(tpu, zone, project)                 # at the start of every attempt
    node = client(tpu, zone, project)                    # reads the node's state and health
    supervise(attempt, node, SupervisorConfig(...), log=print)

The parts live in :mod:`hybrid.platforms.cloud_tpu.node` (``resolve``, ``client``, ``NodeStatus``:
finding, connecting to and reading a node) and :mod:`hybrid.platforms.cloud_tpu.supervisor` (the
restart policy: ``supervise``, ``wait_until_healthy``, ``classify``, ``SupervisorConfig``,
``TPURecoveryError``); this module re-exports their public names.

Errors speak in the library's terms: the node as ``tpu=..., zone=..., project=...`` and the
settings as ``SupervisorConfig`` fields; a launcher may reword them as its flags.
"""

from __future__ import annotations

from hybrid.platforms.cloud_tpu.node import (
    NodeStatus,
    TPUConnectionError,
    TPUNodeClient,
    TPUSystem,
    client,
    read_status,
    resolve,
)
from hybrid.platforms.cloud_tpu.supervisor import (
    GIVE_UP_STATES,
    RUNTIME_ERRORS,
    SupervisorConfig,
    TPURecoveryError,
    classify,
    supervise,
    wait_until_healthy,
)

__all__ = [
    "GIVE_UP_STATES",
    "RUNTIME_ERRORS",
    "NodeStatus",
    "SupervisorConfig",
    "TPUConnectionError",
    "TPUNodeClient",
    "TPURecoveryError",
    "TPUSystem",
    "classify",
    "client",
    "read_status",
    "resolve",
    "supervise",
    "wait_until_healthy",
]
