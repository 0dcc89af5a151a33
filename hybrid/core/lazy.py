"""Names a package loads on first use (PEP 562), so importing the package stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["attributes"]


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
        loaded = importlib.import_module(module)
        value = loaded if attribute is None else getattr(loaded, attribute)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *exports})

    return getattr_, dir_
