"""The package's floors import downwards only, the core needs no TensorFlow, and the Layout
section of the design notes (docs/design.md) names every module there is.

Imports are read from the source (every ``import`` statement, at any depth), so a lazy import
inside a function counts as much as one at the top.
"""

import ast
import os
import re
import subprocess
import sys

import pytest

import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "hybrid")
# Bottom up; a module may import only from its own floor or lower ones. The engine's packages
# are floors of their own: its root modules (devices, the Keras adapter) < the model < the
# stage programs < the step on the mesh < the API the user holds.
FLOORS = [
    "hybrid.core",
    "hybrid.engine",
    "hybrid.engine.model",
    "hybrid.engine.programs",
    "hybrid.engine.step",
    "hybrid.engine.api",
    "hybrid.planning",
    "hybrid.platforms",
    "hybrid",  # the operational floor (hybrid.run), the reference models, the lazy facade
]
TOP_FLOOR = len(FLOORS)  # hybrid.launch: the entry points, above everything
# Subsystems with one entry: outside the package, only the package itself is imported.
ENTRIES = ["hybrid.core.schedule", "hybrid.engine.programs", "hybrid.platforms.cloud_tpu"]
# A soft bound: a file owns one concept, whatever its length; past this it most likely holds
# two (issue 29: the old 420-line cap cut concepts to fit, so it was raised).
MAX_LINES = 600


def modules() -> dict[str, str]:
    """Dotted module name -> path, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def floor(module: str) -> int:
    """The floor of ``module``: its longest prefix in FLOORS."""
    if module == "hybrid.launch" or module.startswith("hybrid.launch."):
        return TOP_FLOOR
    inside = [i for i, p in enumerate(FLOORS) if module == p or module.startswith(p + ".")]
    return max(inside, key=lambda i: len(FLOORS[i]))


def imported(path: str, module: str) -> set[str]:
    """Every ``hybrid...`` module the file imports (``from hybrid.x import y`` counts as
    ``hybrid.x.y`` when that is a module, else ``hybrid.x``)."""
    known = modules()
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in known else base)
    return {n for n in names if n == "hybrid" or n.startswith("hybrid.")}


MODULES = sorted(modules().items())


@pytest.mark.parametrize("module,path", MODULES, ids=[m for m, _ in MODULES])
def test_floors_import_downwards_only(module, path):
    if module == "hybrid":
        return  # the lazy facade names everything; it imports nothing at import time
    upward = [m for m in imported(path, module) if floor(m) > floor(module)]
    assert not upward, f"{module} (floor {floor(module)}) imports from higher floors: {upward}"


@pytest.mark.parametrize("module,path", MODULES, ids=[m for m, _ in MODULES])
def test_subsystems_are_entered_by_their_package(module, path):
    if module == "hybrid":
        return
    for entry in ENTRIES:
        if module == entry or module.startswith(entry + "."):
            continue
        inner = [m for m in imported(path, module) if m.startswith(entry + ".")]
        assert not inner, f"{module} imports {inner}; import from {entry} (its one entry)"


def test_no_two_modules_share_a_name():
    names: dict[str, list[str]] = {}
    for module, path in MODULES:
        if not path.endswith("__init__.py"):
            names.setdefault(module.rpartition(".")[2], []).append(module)
    shared = {name: found for name, found in names.items() if len(found) > 1}
    assert not shared, f"modules that share a name: {shared}"


def top_level_imports(path: str, module: str) -> set[str]:
    """The ``hybrid`` modules ``path`` imports when it is imported (not inside functions or
    ``if TYPE_CHECKING:``)."""
    tree = ast.parse(open(path).read())
    body = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    probe = ast.Module(body=body, type_ignores=[])
    scratch = os.path.join(ROOT, "tests", f"_cycle_probe_{os.getpid()}.py")
    with open(scratch, "w") as f:
        f.write(ast.unparse(probe))
    try:
        return imported(scratch, module if not path.endswith("__init__.py") else module + ".x")
    finally:
        os.remove(scratch)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle of ``graph`` (module -> the modules it imports), or None."""
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> list[str] | None:
        if module in trail:
            return [*trail[trail.index(module) :], module]
        if module in done or module not in graph:
            return None
        for child in sorted(graph[module]):
            # a package's own modules importing it back is how a package entry works
            found = None if module.startswith(child + ".") else visit(child, [*trail, module])
            if found:
                return found
        done.add(module)
        return None

    return next(filter(None, (visit(m, []) for m in sorted(graph))), None)


def test_no_import_cycles():
    graph = {m: top_level_imports(p, m) - {m} for m, p in MODULES if m != "hybrid"}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"p.m": {"p"}, "p": {"p.m"}}) is None  # a package and its own module


def test_the_check_can_fail():
    source = "from hybrid.engine.api import pipeline\nimport hybrid.platforms.cluster\n"
    path = os.path.join(ROOT, "tests", "_layout_probe.py")
    with open(path, "w") as f:
        f.write(source)
    try:
        found = imported(path, "hybrid.core.probe")
    finally:
        os.remove(path)
    assert found == {"hybrid.engine.api.pipeline", "hybrid.platforms.cluster"}
    assert floor("hybrid.engine.api.pipeline") > floor("hybrid.core.probe")


@pytest.mark.parametrize("module,path", [(m, p) for m, p in MODULES if m.startswith("hybrid.core")])
def test_core_has_no_tensorflow_at_import_time(module, path):
    tree = ast.parse(open(path).read())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
    heavy = {n for n in names if n.split(".")[0] in ("tensorflow", "keras")}
    assert not heavy, f"{module} imports {heavy} when imported"


def test_importing_the_core_loads_no_tensorflow():
    code = (
        "import sys, hybrid\n"
        "import hybrid.core, hybrid.core.config, hybrid.core.mesh, hybrid.core.partition\n"
        "import hybrid.core.schedule, hybrid.models.catalog, hybrid.run.data_sources\n"
        "hybrid.core.schedule.get('1f1b', 2, 4)\n"
        "hybrid.DeviceMesh.from_devices(['a', 'b'], 2, 1)\n"
        "hybrid.validate_run(hybrid.RunConfig(2, 2, 4))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_public_names_resolve():
    import hybrid

    for name in hybrid.__all__:
        assert getattr(hybrid, name) is not None, name
    with pytest.raises(AttributeError, match="has no attribute 'pipelin'"):
        hybrid.pipelin  # noqa: B018


@pytest.mark.parametrize("module,path", MODULES, ids=[m for m, _ in MODULES])
def test_modules_are_small(module, path):
    with open(path) as f:
        lines = sum(1 for _ in f)
    assert lines <= MAX_LINES, f"{module} has {lines} lines; split it by concept"


def test_readme_layout_names_every_module():
    text = open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8").read()
    layout = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    missing = [
        os.path.relpath(path, ROOT)
        for _, path in MODULES
        if not path.endswith("__init__.py")
        and not re.search(rf"\b{re.escape(os.path.basename(path))}\b", layout)
    ]
    assert not missing, f"docs/design.md's Layout section does not mention {missing}"


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
