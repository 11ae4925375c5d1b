"""Import megatron-core without importing torch's compiler stack.

megatron-core decorates about fifty fused helpers with ``torch.compile`` at import time (through
``megatron.core.jit.jit_fuser``). Calling ``torch.compile`` imports TorchDynamo and Inductor
(sympy included): about 2.7 s of CPU in every process that imports megatron-core, ~40 % of
importing our model, paid by every ``mimir`` command, torchrun rank and Slurm task. Our model
turns every one of those fusions off (``model/hrm.py``), so the helpers never run.

:func:`install` (called by ``mimir_megatron/__init__.py``; it imports nothing) adds an import
hook that fires once, when ``megatron.core`` is first imported: for the duration of that import,
``torch.compile`` applied to a plain function returns a wrapper that calls the real
``torch.compile`` on its first call. ``torch.compile`` compiles on first call anyway, so a helper
that does run is compiled exactly as before; only the import of the compiler moves to that call.
``torch.compile`` itself is restored as soon as megatron-core's import returns, and nothing
happens when megatron-core was imported before this package.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

_TARGET = "megatron.core"


def install() -> None:
    """Add the import hook (idempotent; a no-op when megatron-core is already imported)."""
    if _TARGET in sys.modules or any(isinstance(f, _DeferCompileFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferCompileFinder())


def lazy_compile(real_compile: Callable[..., Any]) -> Callable[..., Any]:
    """A ``torch.compile`` that defers compiling a plain function to its first call."""

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(mode=...): a decorator
            return lambda fn: compile_later(fn, **options)
        if not inspect.isfunction(model):
            return real_compile(model, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **options)
            return compiled(*args, **kwargs)

        # What torch.compile's wrapper calls the eager function (backend.setup restores it).
        first_call_compiles._torchdynamo_orig_callable = model  # type: ignore[attr-defined]
        return first_call_compiles

    return compile_later


class _DeferCompileFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of ``megatron.core`` once, then steps aside."""

    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferCompileLoader(spec.loader)
        return spec


class _DeferCompileLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        import torch

        real_compile = torch.compile
        torch.compile = lazy_compile(real_compile)  # type: ignore[assignment]
        try:
            self._loader.exec_module(module)
        finally:
            torch.compile = real_compile  # type: ignore[assignment]
