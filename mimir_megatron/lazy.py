"""Package attributes imported on first use.

The CLI imports every command's package to register its arguments; a package whose
``__init__`` imported its submodules eagerly would pull in torch or an optional extra (httpx,
fastapi, ...) just to print ``mimir --help``. Such packages export through :func:`lazy_exports`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a submodule,
    relative like ``.runner``) when ``name`` is first asked for."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name], package), name)

    return __getattr__
