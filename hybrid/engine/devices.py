"""The simulated CPU mesh: the host CPU split into logical devices that act like cores.

TensorFlow fixes its logical devices when the runtime starts, once per process. A test or a
launcher therefore decides its simulated device count before anything touches the runtime.

A simulated device runs its XLA programs one operation after another, on the inter-op thread
that launched the program (:func:`run_xla_programs_in_order`), as an accelerator runs its
stream. XLA:CPU would otherwise hand a program's independent operations to the process's
intra-op pool, which all logical devices share and which has one thread here: the devices'
programs then queue for that one thread instead of overlapping (measured: MobileNetV2 at
2 stages x 2 replicas kept 1.4 of 2 cores busy, 527 ms a step; in order, 1.9 cores and
399 ms; one device alone is as fast either way).
"""

from __future__ import annotations

import tensorflow as tf

from hybrid.core import xla_flags
from hybrid.core.quiet import quiet_start

__all__ = ["XLA_IN_ORDER", "host_cpu", "run_xla_programs_in_order", "simulate_cpu_devices"]

XLA_IN_ORDER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def host_cpu(device: str) -> str:
    """The CPU of the host (task) that holds ``device`` (on a cluster: with the mesh, not
    with the client)."""
    return tf.DeviceSpec.from_string(device).replace(device_type="CPU", device_index=0).to_string()


def client_cpu() -> str:
    """This process's own CPU, fully named: where the user's Keras model lives (on a cluster,
    the client's host; an unnamed device there would be the first worker's)."""
    from tensorflow.python.eager import context

    return f"{context.context().host_address_space()}/device:CPU:0"


def _logical_cpu_count() -> int:
    with quiet_start():
        return len(tf.config.list_logical_devices("CPU"))


def run_xla_programs_in_order() -> None:
    """Makes XLA:CPU programs compiled from now on run their operations in order on the
    launching thread (``XLA_FLAGS`` gains :data:`XLA_IN_ORDER`, unless it already sets that
    flag: the user's choice stays). XLA reads ``XLA_FLAGS`` at the process's first compile."""
    name, _, setting = XLA_IN_ORDER.partition("=")
    if xla_flags.value("XLA_FLAGS", name) is None:
        xla_flags.add("XLA_FLAGS", name, setting)


def simulate_cpu_devices(num_devices: int, inter_op_threads: int | None = None) -> list[str]:
    """Splits the host CPU into ``num_devices`` logical devices that each act like one core.

    Each logical device gets one intra-op thread (so one device runs one kernel at a time,
    like an accelerator) and runs its XLA programs in order (:func:`run_xla_programs_in_order`);
    the inter-op pool gets ``inter_op_threads`` (default: one per device, at least 2) so the
    devices' programs can overlap.

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
    with quiet_start():  # the runtime's first look at its devices: no CUDA driver, ...
        cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)]
        )
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(
            inter_op_threads or max(2, num_devices)
        )
        run_xla_programs_in_order()
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
