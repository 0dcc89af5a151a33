"""The wheel holds the whole package and its entry points work from an installation.

The wheel is built from this checkout, installed (without dependencies: the test's own
environment has them) into an empty directory, and used from another empty directory, so
nothing can come from the checkout itself.
"""

import os
import subprocess
import sys
import zipfile

import pytest

import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str, expect: int = 0, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == expect, (result.stdout + result.stderr)[-3000:]
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    dist = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", str(dist), ROOT)  # fmt: skip
    (wheel,) = [os.path.join(dist, f) for f in os.listdir(dist) if f.endswith(".whl")]
    target = tmp_path_factory.mktemp("site")
    run(sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), wheel)
    return wheel, str(target)


def test_wheel_contains_every_module(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, _, files in os.walk(os.path.join(ROOT, "hybrid")):
        for name in files:
            if name.endswith(".py") or name == "py.typed":
                path = os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, "/")
                assert path in names, f"{path} is missing from {os.path.basename(wheel)}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "hybrid-train = hybrid.launch.train:run" in scripts
    assert "hybrid-worker = hybrid.launch.worker:run" in scripts


def test_installed_package_imports_and_its_commands_run(installed, tmp_path):
    _, target = installed
    env = {**os.environ, "PYTHONPATH": target, "TF_CPP_MIN_LOG_LEVEL": "2"}
    code = (
        "import hybrid, hybrid.models, hybrid.launch.train\n"
        "print(hybrid.__file__)\n"
        "print(hybrid.models.num_layers('mlp', 2), hybrid.schedule.names())\n"
    )
    shown = run(sys.executable, "-c", code, cwd=tmp_path, env=env).stdout.splitlines()
    assert shown[0].startswith(target), shown  # the installed copy, not the checkout
    assert shown[1] == "7 ['1f1b', 'gpipe', 'interleaved', 'zb-h1']"
    # absl prints --help and exits with status 1; the command's own flags must be listed.
    for command, flag in (("hybrid-train", "--micro_batches"), ("hybrid-worker", "--task_index")):
        shown = run(os.path.join(target, "bin", command), "--help", expect=1, cwd=tmp_path, env=env)
        assert flag in shown.stdout, shown.stdout[-3000:]


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
