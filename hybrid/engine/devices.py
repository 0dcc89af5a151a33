"""The simulated CPU mesh: the host CPU split into logical devices that act like cores.

TensorFlow fixes its logical devices when the runtime starts, once per process. A test or a
launcher therefore decides its simulated device count before anything touches the runtime.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["host_cpu", "simulate_cpu_devices"]


def host_cpu(device: str) -> str:
    """The CPU of the host (task) that holds ``device`` (on a cluster: with the mesh, not
    with the client)."""
    return tf.DeviceSpec.from_string(device).replace(device_type="CPU", device_index=0).to_string()


def _logical_cpu_count() -> int:
    return len(tf.config.list_logical_devices("CPU"))


def simulate_cpu_devices(num_devices: int, inter_op_threads: int | None = None) -> list[str]:
    """Splits the host CPU into ``num_devices`` logical devices that each act like one core.

    Each logical device gets one intra-op thread (so one device runs one kernel at a time,
    like an accelerator); the inter-op pool gets ``inter_op_threads`` (default: one per
    device, at least 2) so the devices' programs can overlap.

    Must run before the TensorFlow runtime starts. Calling it again with the same count is a
    no-op.

    Returns:
      The logical CPU device names.

    Raises:
      ValueError: ``num_devices`` < 1.
      RuntimeError: the runtime already started with a different number of CPU devices.
    """
    if num_devices < 1:
        raise ValueError(f"simulate_cpu_devices needs at least 1 device, got {num_devices}")
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)]
        )
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(
            inter_op_threads or max(2, num_devices)
        )
    except RuntimeError as err:
        current = _logical_cpu_count()
        if current != num_devices:
            raise RuntimeError(
                f"simulate_cpu_devices({num_devices}) called after the TensorFlow runtime "
                f"started with {current} CPU device(s); logical devices are fixed once per "
                "process. Call hybrid.simulate_cpu_devices() first thing in the process (before "
                "any tensor is created), or run this configuration in its own process"
            ) from err
    return [d.name for d in tf.config.list_logical_devices("CPU")]
