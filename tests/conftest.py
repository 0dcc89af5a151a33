"""Every test process simulates 8 CPU devices, enough for the largest mesh tested (4×2, 2×4).

TensorFlow fixes its logical devices once per process, so this runs before any test module
touches TensorFlow.
"""

import gc
import os
import resource
import tempfile
import time

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
# The grid compiles the same small stage programs many times (per device, per mesh); XLA's
# persistent cache lets later compiles of an identical program load the executable instead.
os.environ.setdefault(
    "TF_XLA_FLAGS",
    "--tf_xla_persistent_cache_directory="
    + os.path.join(tempfile.gettempdir(), f"hybrid-xla-cache-{os.getuid()}"),
)

# Tests compile at XLA's lowest backend optimization level: compiling is most of a cold suite's
# time, and LLVM's level changes how fast the code runs, not what the tests compare (each is
# against a reference computed in the same process, under the same flags).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

# The planner's host calibration (hybrid.planning.host_calibration) is cached here, not in
# the user's home.
os.environ.setdefault(
    "HYBRID_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"hybrid-cache-{os.getuid()}")
)

import hybrid  # noqa: E402

NUM_DEVICES = 8
hybrid.simulate_cpu_devices(NUM_DEVICES)

import tensorflow as tf  # noqa: E402

# TensorFlow's graph optimizer (grappler) rewrites every new graph at its first run: a third
# of a cold graph-mode test's time here. Off in tests, like LLVM's level above: it changes how
# a graph runs, not what a test compares (each against a reference run in the same process).
tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
# What TensorFlow and Keras allocate at import lives to the end: kept out of the collector's
# full passes, which otherwise walk it again and again as tests build models.
gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``long`` (tens of seconds of processes and waits) run first: pytest-xdist
    hands each worker a contiguous share of the collection and balances by stealing from
    the ends of the queues, so a long test reached last would run alone at the end. Then
    Bazel test sharding: keep every TEST_TOTAL_SHARDS-th test, starting at this shard."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    if total <= 1:
        return
    index = int(os.environ["TEST_SHARD_INDEX"])
    status = os.environ.get("TEST_SHARD_STATUS_FILE")
    if status:
        open(status, "w").close()  # tells Bazel this runner understands sharding
    keep = [item for i, item in enumerate(items) if i % total == index]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


# HYBRID_TEST_CPU_LOG=<file>: every test appends one line to <file>, tab-separated: CPU
# seconds of the test process, CPU seconds of the subprocesses it waited for, wall seconds,
# test id (setup, call and teardown together). What a test costs a loaded machine is its CPU
# seconds, not its wall time beside other workers.
_CPU_LOG = os.environ.get("HYBRID_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_LOG:
        yield
        return

    def cpu(who):
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    began = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    yield
    ended = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    own, children, wall = (b - a for a, b in zip(began, ended, strict=True))
    with open(_CPU_LOG, "a") as log:
        log.write(f"{own:.2f}\t{children:.2f}\t{wall:.2f}\t{item.nodeid}\n")
