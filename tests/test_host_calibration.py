"""The host's cost per step and per action: measured on a tiny model, cached per host, and
counted in every plan of a model profiled here (``hybrid.planning.host_calibration``)."""

import json
import os
import sys

import keras
import pytest

from hybrid import planning as planner
from hybrid.core.mesh import local_devices
from hybrid.planning import Hardware, Link, host_calibration

import runner


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_CACHE_DIR", str(tmp_path))
    return tmp_path / "host_calibration.json"


def test_the_fit_is_least_squares_and_never_negative():
    assert host_calibration._fit([4, 8, 16], [0.003 + 4e-5 * a for a in (4, 8, 16)]) == (
        pytest.approx(0.003),
        pytest.approx(4e-5),
    )
    assert host_calibration._fit([4, 8], [0.002, 0.001]) == (pytest.approx(0.0015), 0.0)
    assert host_calibration._fit([4, 4], [0.002, 0.004]) == (pytest.approx(0.003), 0.0)


def test_a_calibration_is_measured_once_then_read_from_the_cache(cache, monkeypatch):
    devices = list(local_devices())[:4]
    found = host_calibration.calibrated(devices)
    meshes = [row[:3] for row in found.rows]
    assert meshes == [m for m in host_calibration.MESHES if m[0] * m[1] <= 4]
    # 1×1 M=1: F and B; 2×2 M=4: 2 replicas × 2 stages × 4 micro-batches × (F, B)
    assert [row[3] for row in found.rows][:2] == [2, 16] and found.rows[-1][3] == 32
    # the fit (noise may flatten it on a busy host, never below 0) predicts every row > 0
    assert found.fixed >= 0 and found.per_action >= 0
    assert all(found.fixed + found.per_action * row[3] > 0 for row in found.rows)
    assert all(row[4] > 0 for row in found.rows)
    stored = json.loads(cache.read_text())
    (key,) = stored
    assert f"CPU×{len(devices)}" in key and "xla=True" in key

    def measure_again(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(host_calibration, "measure_host", measure_again)
    assert host_calibration.calibrated(devices) == found
    bandwidth, latency = found.replica  # the all-reduce of 2 devices, a line
    assert bandwidth > 0 and latency >= 0
    assert found.hardware() == Hardware(
        step_overhead=found.fixed,
        dispatch_overhead=found.per_action,
        replica=Link(bandwidth, latency),
    )
    one = host_calibration.HostOverheads(1e-3, 1e-5, ())  # one device: no all-reduce timed
    assert one.replica is None and one.hardware().replica == Link()


def test_the_all_reduce_line_is_the_ring_formulas_for_two_devices(monkeypatch):
    from hybrid.planning import link_timing
    from hybrid.planning.hardware import all_reduce_time

    sizes = host_calibration.ALL_REDUCE_BYTES
    monkeypatch.setattr(
        link_timing, "measure_all_reduce", lambda devices, nbytes: [2e-4 + n / 1e9 for n in nbytes]
    )
    bandwidth, latency = host_calibration._replica_link(["/device:CPU:0", "/device:CPU:1"])
    for n in sizes:  # the ring formula with R = 2 gives back what was measured
        assert all_reduce_time(n, 2, Link(bandwidth, latency)) == pytest.approx(2e-4 + n / 1e9)
    assert host_calibration._replica_link(["/device:CPU:0"]) is None


def test_a_plan_of_a_model_profiled_here_counts_the_host(cache):
    """With a calibration of 1 ms per step and 0.1 ms per action in the cache, every
    candidate's step is at least 1 ms + its actions × 0.1 ms; a CostProfile or a given
    Hardware is planned as given."""
    devices = list(local_devices())[:2]
    key = host_calibration._key(devices, True)
    cache.write_text(json.dumps({key: {"fixed": 1e-3, "per_action": 1e-4, "rows": []}}))
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(10)]
    plan = planner.plan(
        layers,
        devices=2,
        global_batch=8,
        input_shape=(8,),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        schedules=["1f1b"],
        remats=["never"],
        micro_batches=[1, 4],
        deferrals=[False],
        verbose=0,
    )
    assert plan.hardware.step_overhead == 1e-3 and plan.hardware.dispatch_overhead == 1e-4
    assert plan.hardware.host_cores == len(os.sched_getaffinity(0))  # simulated devices
    for p in plan.ranked:
        c = p.config
        actions = c.replicas * c.stages * c.micro_batches * 2  # F and B
        assert p.step_time >= 1e-3 + actions * 1e-4 - 1e-12, (c, p.step_time)
    profile = planner.uniform_profile(2, 1e-4, 2e-4)
    assert planner.plan(profile, devices=2, global_batch=8, verbose=0).hardware == Hardware()
    given = Hardware(step_overhead=0.5)
    assert planner.plan(profile, devices=2, global_batch=8, hardware=given, verbose=0).hardware == (
        given
    )


def test_hardware_refuses_a_negative_dispatch_overhead():
    with pytest.raises(ValueError, match="dispatch_overhead=-1"):
        Hardware(dispatch_overhead=-1)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
