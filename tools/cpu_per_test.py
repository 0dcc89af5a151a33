"""Where the test suite's CPU goes: a pytest plugin that records each test's wall time and
the CPU seconds of its own process and of the processes it waited for (launchers, workers),
then a report by file and by test.

The suite saturates two cores, so CPU seconds, not wall time, say what a change costs.
Run the suite with the plugin (``-p cpu_per_test``, this folder on ``PYTHONPATH``), then report;
an empty XLA cache directory measures what CI pays (its cache starts cold)::

    TF_XLA_FLAGS=--tf_xla_persistent_cache_directory=$(mktemp -d) PYTHONPATH=tools \\
      .venv/bin/python -m pytest -q -n 2 -p no:cacheprovider -p cpu_per_test tests
    python tools/cpu_per_test.py [--top 40]

Each pytest process writes ``cpu_per_test-<pid>.json`` (rows ``[test id, wall s, own CPU s,
children's CPU s]``) into ``$CPU_PER_TEST_DIR`` (default: the system's temporary directory).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import resource
import tempfile
import time
from typing import Any

import pytest

_ROWS: list[tuple[str, float, float, float]] = []


def _directory() -> str:
    return os.environ.get("CPU_PER_TEST_DIR") or tempfile.gettempdir()


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
    own, children = _cpu()
    start = time.time()
    yield
    own_after, children_after = _cpu()
    _ROWS.append((item.nodeid, time.time() - start, own_after - own, children_after - children))


def pytest_sessionfinish(session: Any) -> None:
    if _ROWS:
        os.makedirs(_directory(), exist_ok=True)
        with open(os.path.join(_directory(), f"cpu_per_test-{os.getpid()}.json"), "w") as f:
            json.dump(_ROWS, f)


def report(top: int) -> None:
    rows = []
    for path in glob.glob(os.path.join(_directory(), "cpu_per_test-*.json")):
        with open(path) as f:
            rows += json.load(f)
    own, children = sum(r[2] for r in rows), sum(r[3] for r in rows)
    print(f"{len(rows)} tests: {own:.0f} CPU s in pytest, {children:.0f} in child processes")
    by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for name, wall, mine, theirs in rows:
        entry = by_file[name.split("::")[0]]
        entry[0] += mine + theirs
        entry[1] += mine
        entry[2] += theirs
        entry[3] += wall
    print(f"\n{'CPU s':>7} {'own':>6} {'children':>8} {'wall s':>7}  file")
    for name, (cpu, mine, theirs, wall) in sorted(by_file.items(), key=lambda kv: -kv[1][0]):
        print(f"{cpu:7.0f} {mine:6.0f} {theirs:8.0f} {wall:7.0f}  {name}")
    print(f"\n{'CPU s':>7} {'wall s':>7}  test (the {top} costliest)")
    for name, wall, mine, theirs in sorted(rows, key=lambda r: -(r[2] + r[3]))[:top]:
        print(f"{mine + theirs:7.1f} {wall:7.1f}  {name}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=40, help="tests listed one by one")
    report(parser.parse_args().top)
