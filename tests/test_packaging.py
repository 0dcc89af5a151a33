"""The wheel holds the whole package and its entry points work from an installation.

The wheel is built from this checkout, installed (without dependencies: the test's own
environment has them) into an empty directory, and used from another empty directory, so
nothing can come from the checkout itself. Its dependencies are checked against what pip
resolves for it (``network``: pip reads the index unless its cache holds it; ``make test``
and CI run it): every distribution a training run imports must be among them.
"""

import json
import os
import re
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
        "import hybrid, hybrid.core.schedule, hybrid.models, hybrid.launch.train\n"
        "print(hybrid.__file__)\n"
        "print(hybrid.models.num_layers('mlp', 2), hybrid.core.schedule.names())\n"
    )
    shown = run(sys.executable, "-c", code, cwd=tmp_path, env=env).stdout.splitlines()
    assert shown[0].startswith(target), shown  # the installed copy, not the checkout
    assert shown[1] == "7 ['1f1b', 'gpipe', 'interleaved', 'zb-h1']"
    # --help lists the command's own flags and exits 0.
    for command, flag in (("hybrid-train", "--micro_batches"), ("hybrid-worker", "--task_index")):
        shown = run(os.path.join(target, "bin", command), "--help", expect=0, cwd=tmp_path, env=env)
        assert flag in shown.stdout, shown.stdout[-3000:]


def test_without_tensorflow_a_feature_names_the_install_command(installed, tmp_path):
    _, target = installed
    env = {**os.environ, "PYTHONPATH": target}
    code = (
        "import sys\n"
        "sys.modules['tensorflow'] = sys.modules['keras'] = None  # as if not installed\n"
        "import hybrid, hybrid.core.schedule\n"
        "print(hybrid.core.schedule.names())  # the core needs neither\n"
        "try:\n"
        "    hybrid.Pipeline\n"
        "except ModuleNotFoundError as err:\n"
        "    print(err)\n"
        "sys.argv = ['hybrid-train', '--model=mlp', '--data=synthetic', '--train_steps=1']\n"
        "from hybrid.launch.train import run\n"
        "run()\n"
    )
    shown = run(sys.executable, "-c", code, expect=1, cwd=tmp_path, env=env)
    lines = shown.stdout.splitlines()
    assert lines[0] == "['1f1b', 'gpipe', 'interleaved', 'zb-h1']", shown.stdout
    assert lines[1].startswith("hybrid.Pipeline needs keras, which is not installed in "), lines
    assert "pip install hybrid brings TensorFlow" in lines[1]
    (error,) = shown.stderr.strip().splitlines()  # one line, no traceback
    assert error.startswith("error: hybrid-train needs tensorflow, which is not installed"), error


# Runs argv[2:] as hybrid-train where only the distributions named in argv[1] (JSON) can be
# imported, as in a fresh environment holding just them: a module whose file belongs to
# another installed distribution is not found (optional imports fall back, needed ones fail).
ONLY_RESOLVED = """
import importlib.abc, importlib.machinery, importlib.metadata, json, os, re, sys
allowed = set(json.loads(sys.argv.pop(1)))
normal = lambda name: re.sub(r"[-_.]+", "-", name).lower()
owner = {
    os.path.realpath(str(dist.locate_file(f))): normal(dist.metadata["Name"])
    for dist in importlib.metadata.distributions() for f in dist.files or ()
    if f.suffix in (".py", ".so")
}

class OnlyResolved(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        dist = owner.get(os.path.realpath(spec.origin)) if spec and spec.origin else None
        if dist is not None and dist not in allowed:
            message = f"No module named {name!r} ({dist} is not installed)"
            raise ModuleNotFoundError(message, name=name)
        return None

sys.meta_path.insert(0, OnlyResolved())
sys.argv[0] = "hybrid-train"
from hybrid.launch.train import run
run()
"""


@pytest.mark.network
@pytest.mark.long
def test_pip_install_brings_what_training_imports(installed, tmp_path):
    """``pip install hybrid-*.whl`` resolves (pip's own resolver, as a user's install does,
    without unpacking TensorFlow again) to distributions that train: two steps run from the
    installed wheel, outside the checkout, where only those distributions can be imported (a
    dependency missing from the wheel's metadata, present here through the test extras,
    fails)."""
    wheel, target = installed
    report = tmp_path / "report.json"
    run(sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
        "--report", str(report), wheel)  # fmt: skip
    items = json.loads(report.read_text())["install"]
    resolved = sorted({_normal(item["metadata"]["name"]) for item in items})
    assert {"hybrid", "tensorflow", "keras"} <= set(resolved), resolved
    work = tmp_path / "elsewhere"  # no checkout (nor its hybrid.egg-info) on any path
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": target, "TF_CPP_MIN_LOG_LEVEL": "2"}
    trained = run(
        sys.executable, "-c", ONLY_RESOLVED, json.dumps(resolved), "--model=mlp",
        "--data=synthetic", "--width=8", "--depth=1", "--mesh=stage:2,replica:1",
        "--micro_batches=2", "--global_batch_size=8", "--train_steps=2", "--log_every=1",
        "--jit_compile=false", f"--model_dir={work}/run", cwd=work, env=env,
    )  # fmt: skip
    assert "step      2/2  loss " in trained.stdout, trained.stdout[-3000:]
    assert f"  tensorboard --logdir {work}/run" in trained.stdout
    # The same run without one needed distribution fails, naming it.
    short = json.dumps([name for name in resolved if name != "absl-py"])
    failed = run(sys.executable, "-c", ONLY_RESOLVED, short, "--help", expect=1, cwd=work, env=env)
    assert "No module named 'absl' (absl-py is not installed)" in failed.stderr, failed.stderr


def _normal(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
