"""Prints the project's pip requirements without TensorFlow, one per line, for installing
hybrid beside a TensorFlow build pip cannot pick for itself (tensorflow-tpu on a Cloud TPU
VM): ``pip install --no-deps -e .`` then ``pip install TF_BUILD $(python tools/requirements.py
test,plot)``.

    python tools/requirements.py [EXTRA,EXTRA,...]   # the dependencies + those extras'
"""

from __future__ import annotations

import os
import sys

import tomllib  # Python >= 3.11 (the virtualenvs make builds)

PYPROJECT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml"
)


def requirements(extras: list[str]) -> list[str]:
    """pyproject.toml's dependencies and ``extras``' requirements, TensorFlow's left out."""
    with open(PYPROJECT, "rb") as f:
        project = tomllib.load(f)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [name for name in extras if name not in optional]
    if unknown:
        raise SystemExit(f"unknown extras {unknown}; pyproject.toml has {sorted(optional)}")
    wanted = list(project["dependencies"]) + [r for name in extras for r in optional[name]]
    return [r for r in wanted if not r.replace(" ", "").startswith("tensorflow")]


if __name__ == "__main__":
    print("\n".join(requirements([e for e in "".join(sys.argv[1:]).split(",") if e])))
