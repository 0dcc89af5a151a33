"""Every Bazel test target carries what its test file reads: a test that passes under
pytest from the source tree but misses a file in Bazel's sandbox fails only under
``bazel test``, which CI runs for a subset. These checks read the test files and the BUILD
files from the source tree (under Bazel, where the BUILD files are not data, they skip).

What a test file needs, by what its source says:

    import test_x / import user_model    the sibling file (data, or a library that has it)
    "compile_cache_child.py", ...        a sibling file it starts or puts on PYTHONPATH
    hybrid.launch                        //hybrid:launch (the launchers are not //hybrid)
    docs/, README.md, mkdocs.yml         //:docs, and //:mkdocs.yml where it builds the site
"""

import ast
import glob
import os
import re
import sys

import pytest

import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
BUILD = os.path.join(TESTS, "BUILD")
if not os.path.exists(BUILD):  # Bazel's runfiles: the BUILD files are not there
    pytest.skip("reads the source tree's BUILD files", allow_module_level=True)


def targets():
    """Each py_test's name -> its data labels (tests/BUILD's table)."""
    text = open(BUILD).read()
    table = text[text.index("for name, size, shards, data in [") :]
    found = {}
    for match in re.finditer(r'\("(test_\w+)", "\w+", \d+, \[(.*?)\]\)', table, re.S):
        found[match.group(1)] = set(re.findall(r'"([^"]+)"', match.group(2)))
    return found


def library_files():
    """The test files the py_librarys of tests/BUILD bring to every test."""
    text = open(BUILD).read()
    files = set()
    for block in re.findall(r"py_library\((.*?)\n\)", text, re.S):
        files |= set(re.findall(r'"(\w+\.py)"', block.split("srcs")[1].split("]")[0]))
    return files


def needs(path):
    """The labels a test file's source says it reads (docstrings and prose aside)."""
    source = open(path).read()
    tree = ast.parse(source)
    siblings = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(TESTS, "*.py"))}
    needed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            needed |= {f"{a.name}.py" for a in node.names if a.name in siblings}
            if any(a.name.startswith("hybrid.launch") for a in node.names):
                needed.add("//hybrid:launch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybrid.launch"):
            needed.add("//hybrid:launch")
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value
        ):
            # a file name or a module path given to a process (PYTHONPATH, -m, a script)
            needed |= {f for f in re.findall(r"\b(\w+\.py)\b", node.value) if f[:-3] in siblings}
            if node.value.startswith("hybrid.launch."):
                needed.add("//hybrid:launch")
    if re.search(r"""["'](docs|README\.md)""", source) or "mkdocs.yml" in source:
        needed.add("//:docs")
    if "mkdocs.yml" in source:
        needed.add("//:mkdocs.yml")
    return needed - {os.path.basename(path)}


# Test files without a Bazel target, and why.
UNTARGETED = {
    "test_packaging": "installs the wheel with pip from the package index: no network in Bazel",
    "test_bazel_data": "reads the source tree's BUILD files, which are not Bazel data",
}


def test_every_test_file_has_a_target():
    files = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(TESTS, "test_*.py"))}
    assert files - set(UNTARGETED) == set(targets()), files ^ set(targets()) ^ set(UNTARGETED)


@pytest.mark.parametrize("name", sorted(targets()))
def test_a_target_carries_what_its_test_reads(name):
    given = targets()[name] | library_files()
    missing = needs(os.path.join(TESTS, f"{name}.py")) - given
    if name != "test_equivalence":
        missing -= {"test_equivalence.py"}  # :equivalence_lib, a dependency of every target
    assert not missing, f"//tests:{name} reads {sorted(missing)}: add them to its data"


def test_the_docs_filegroup_holds_every_file_the_site_links():
    """``//:docs`` globs the pages and their pictures: every file under docs/ matches."""
    text = open(os.path.join(ROOT, "BUILD")).read()
    group = text[text.index('name = "docs"') :]
    patterns = re.findall(r'"(docs/\*\*/\*\.\w+)"', group[: group.index(")")])
    kinds = {p.rsplit(".", 1)[1] for p in patterns}
    files = [f for f in glob.glob(os.path.join(ROOT, "docs", "**", "*"), recursive=True)]
    loose = [f for f in files if os.path.isfile(f) and f.rsplit(".", 1)[-1] not in kinds]
    assert not loose, f"//:docs misses {loose}: add their kind to its glob"


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
