"""The documentation site builds in strict mode, and strict mode fails on a broken link.

``make docs`` (and ``.ci/run``) build it the same way; this test keeps the promise inside the
suite: a page that links to a missing page, or an API reference that no longer resolves,
fails here too. The builds need MkDocs and mkdocstrings (the ``docs`` extra) and no
TensorFlow: the API reference is read from the source by griffe.
"""

import os
import shutil
import subprocess
import sys

import pytest

import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MKDOCS = os.path.join(os.path.dirname(sys.executable), "mkdocs")

pytestmark = pytest.mark.skipif(
    not os.path.exists(MKDOCS), reason="mkdocs is not installed: pip install '.[docs]'"
)


def build(project: str, site: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [MKDOCS, "build", "--strict", "-f", os.path.join(project, "mkdocs.yml"), "-d", site],
        capture_output=True,
        text=True,
        timeout=300,
    )


def copy_of_the_project(tmp_path) -> str:
    """mkdocs.yml, docs/ and the package source, where a test may break them."""
    project = str(tmp_path / "project")
    os.makedirs(project)
    shutil.copy(os.path.join(ROOT, "mkdocs.yml"), project)
    shutil.copytree(os.path.join(ROOT, "docs"), os.path.join(project, "docs"))
    os.symlink(os.path.join(ROOT, "hybrid"), os.path.join(project, "hybrid"))
    return project


def test_the_site_builds_strictly(tmp_path):
    result = build(ROOT, str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "pipeline" / "index.html").exists()


def test_a_broken_link_or_reference_fails_the_build(tmp_path):
    project = copy_of_the_project(tmp_path)
    limits = os.path.join(project, "docs", "limits.md")
    with open(limits, "a", encoding="utf-8") as f:
        f.write("\nSee [a page that is not there](no_such_page.md).\n")
    result = build(project, str(tmp_path / "site"))
    assert result.returncode != 0 and "no_such_page.md" in result.stderr, result.stderr[-2000:]

    shutil.copy(os.path.join(ROOT, "docs", "limits.md"), limits)
    with open(os.path.join(project, "docs", "api", "models.md"), "a", encoding="utf-8") as f:
        f.write("\n::: hybrid.models.no_such_module\n")
    result = build(project, str(tmp_path / "site2"))
    assert result.returncode != 0 and "no_such_module" in result.stderr, result.stderr[-2000:]


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
