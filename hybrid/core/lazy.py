"""Names a package loads on first use (PEP 562), so importing the package stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["attributes", "missing_dependency", "missing_extra"]

# What hybrid's features need beyond its core, and how to get it (pyproject.toml's dependencies).
_NEEDED = ("tensorflow", "keras")


def missing_dependency(what: str, err: ModuleNotFoundError) -> ModuleNotFoundError | None:
    """The one-line error for ``what`` needing TensorFlow or Keras that ``err`` found missing
    (None when ``err`` is about another module)."""
    root = (err.name or "").split(".")[0]
    if root not in _NEEDED:
        return None
    return ModuleNotFoundError(
        f"{what} needs {root}, which is not installed in {_interpreter()}: pip install hybrid "
        "brings TensorFlow 2.21 and Keras 3 (or: pip install 'tensorflow>=2.20,<2.22'; on a "
        "Cloud TPU VM: pip install 'tensorflow-tpu==2.20.*')",
        name=err.name,
    )


# Optional modules -> the extra of pyproject.toml that brings them.
_EXTRAS = {"matplotlib": "plot"}


def missing_extra(module: str, what: str) -> str | None:
    """One line saying ``what`` needs the optional ``module`` and how to install it; None
    when it is installed (checked without importing it)."""
    import importlib.util
    import sys

    blocked = module in sys.modules and sys.modules[module] is None  # Python's "not there"
    if not blocked and importlib.util.find_spec(module) is not None:
        return None
    extra = _EXTRAS[module]
    return (
        f"{what} needs {module}, which is not installed in {_interpreter()}: "
        f"pip install 'hybrid[{extra}]' (or: pip install {module})"
    )


def _interpreter() -> str:
    import sys

    return sys.prefix


def attributes(
    package: str, namespace: dict[str, Any], exports: Mapping[str, tuple[str, str | None]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose names load on first use.

    Args:
      package: the package's name, for the error message.
      namespace: the package's ``globals()``; a loaded name is stored there, so the next
        lookup does not come back here.
      exports: public name -> (module, attribute); attribute None: the module itself.
    """

    def getattr_(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = exports[name]
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as err:
            missing = missing_dependency(f"{package}.{name}", err)
            if missing is None:
                raise
            raise missing from None
        value = loaded if attribute is None else getattr(loaded, attribute)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *exports})

    return getattr_, dir_
