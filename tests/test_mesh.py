"""DeviceMesh layout and spec strings; simulated devices."""

import os
import sys

import pytest

import hybrid
from hybrid.core.mesh import parse_spec
from hybrid.engine import devices

import runner
from conftest import NUM_DEVICES


def cpu(i):
    return f"/device:CPU:{i}"


def test_create_lays_out_stage_major():
    mesh = hybrid.DeviceMesh.create(stages=2, replicas=2)
    assert mesh.shape == (2, 2)
    assert mesh.num_stages == 2 and mesh.num_replicas == 2 and mesh.size == 4
    assert mesh.device(0, 0) == cpu(0) and mesh.device(0, 1) == cpu(1)
    assert mesh.device(1, 0) == cpu(2) and mesh.device(1, 1) == cpu(3)
    assert mesh.replica_group(1) == (cpu(2), cpu(3))
    assert mesh.pipeline(1) == (cpu(1), cpu(3))


def test_from_spec_equals_create():
    assert hybrid.DeviceMesh.from_spec("stage:2;replica:2") == hybrid.DeviceMesh.create(2, 2)
    assert hybrid.DeviceMesh.from_spec("replica:4; stage:2").shape == (2, 4)
    assert hybrid.DeviceMesh.from_spec("stage:4").shape == (4, 1)


def test_spec_comma_form():
    # The form to type unquoted in a shell (';' would end the command there).
    assert parse_spec("stage:2,replica:4") == (2, 4)
    assert parse_spec("replica:3, stage:2") == (2, 3)
    with pytest.raises(ValueError, match="separated by ',' or ';'"):
        parse_spec("stage:2 replica:2")
    assert hybrid.DeviceMesh.create(4, 2).spec == "stage:4;replica:2"


def test_mesh_is_immutable():
    mesh = hybrid.DeviceMesh.create(1, 2)
    with pytest.raises(AttributeError):
        mesh.devices = ()


@pytest.mark.parametrize(
    "spec,match",
    [
        ("stage=2", "each part must be 'stage:N' or 'replica:N'"),
        ("stage:2;model:2", "each part must be"),
        ("stage:two", "each part must be"),
        ("stage:2;stage:2", "axis 'stage' appears twice"),
        ("", "empty mesh spec"),
        ("stage:0", "stage must be a positive integer"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_spec(spec)


def test_mesh_larger_than_devices():
    with pytest.raises(ValueError) as err:
        hybrid.DeviceMesh.create(stages=4, replicas=4)
    message = str(err.value)
    assert f"needs 16 devices but only {NUM_DEVICES} are available" in message
    assert "simulate_cpu_devices(16)" in message


def test_out_of_range_device():
    with pytest.raises(IndexError, match=r"outside the mesh of shape \(2, 1\)"):
        hybrid.DeviceMesh.create(2, 1).device(2, 0)


def test_bad_axis_sizes():
    with pytest.raises(ValueError, match="replicas must be a positive integer, got 0"):
        hybrid.DeviceMesh.create(2, 0)


def test_explicit_devices_and_duplicates():
    mesh = hybrid.DeviceMesh.from_devices(["a", "b", "c", "d"], stages=2, replicas=2)
    assert mesh.devices == (("a", "b"), ("c", "d"))
    with pytest.raises(ValueError, match="appears twice"):
        hybrid.DeviceMesh((("a",), ("a",)))


def test_simulate_cpu_devices_same_count_is_noop():
    devices = hybrid.simulate_cpu_devices(NUM_DEVICES)
    assert len(devices) == NUM_DEVICES
    assert hybrid.local_devices("CPU") == tuple(devices)


def test_simulate_cpu_devices_after_start_with_other_count():
    hybrid.DeviceMesh.create(1, 1)  # the runtime has started
    with pytest.raises(
        RuntimeError, match=rf"simulate_cpu_devices\(3\) called after .* started with {NUM_DEVICES}"
    ):
        hybrid.simulate_cpu_devices(3)


def test_simulate_cpu_devices_rejects_zero():
    with pytest.raises(ValueError, match="at least 1 device"):
        hybrid.simulate_cpu_devices(0)


def test_simulated_devices_run_xla_programs_in_order():
    # conftest simulated the devices: XLA:CPU's scheduler for concurrent operations is off,
    # so a device's program never queues for the one intra-op thread all devices share.
    flag = devices.XLA_IN_ORDER.partition("=")[0]
    assert flag in os.environ.get("XLA_FLAGS", ""), os.environ.get("XLA_FLAGS")


def test_run_xla_programs_in_order_keeps_other_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/dump")
    devices.run_xla_programs_in_order()
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/dump {devices.XLA_IN_ORDER}"
    devices.run_xla_programs_in_order()  # once only
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/dump {devices.XLA_IN_ORDER}"


def test_run_xla_programs_in_order_keeps_the_users_choice(monkeypatch):
    mine = "--xla_cpu_enable_concurrency_optimized_scheduler=true --xla_dump_to=/tmp/dump"
    monkeypatch.setenv("XLA_FLAGS", mine)
    devices.run_xla_programs_in_order()
    assert os.environ["XLA_FLAGS"] == mine
    monkeypatch.delenv("XLA_FLAGS")
    devices.run_xla_programs_in_order()
    assert os.environ["XLA_FLAGS"] == devices.XLA_IN_ORDER


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
