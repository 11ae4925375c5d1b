"""The package layout keeps the architecture's layers: read from the source's import statements
(lazy imports inside functions included), so a new import across a layer fails here.

- each top-level folder holds the package of its import name (kernels/mimir_kernels, ...);
- mimir_megatron never imports mimir_data_prep (data preparation builds on the model side, and
  adds its `mimir` commands through an entry point);
- mimir_kernels imports neither project package;
- the model, checkpoints, data, inference, evaluation and audits import no trainer and no CLI
  entry point;
- no two modules import each other, directly or around a loop.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"mimir_megatron": REPO / "mimir_megatron", "mimir_kernels": REPO / "kernels" / "mimir_kernels",
            "mimir_data_prep": REPO / "data_prep" / "mimir_data_prep"}


def _module_name(package: str, path: Path) -> str:
    parts = [package, *path.relative_to(PACKAGES[package]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(package: str, under: str = "", names: bool = False) -> list[tuple[str, str]]:
    """(module, imported module) for every import statement in ``package`` (below ``under``),
    relative imports resolved; with ``names``, every string that starts with a project package's
    name counts too (a module handed to importlib, or run with ``python -m``)."""
    found = []
    for path in sorted((PACKAGES[package] / under).rglob("*.py")):
        module = _module_name(package, path)
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(module, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module] if node.module else base)
                found += [(module, target)] + [(module, f"{target}.{a.name}") for a in node.names]
            elif names and isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith(tuple(PACKAGES)):
                found.append((module, node.value.split(":")[0]))
    return found


def _violations(package: str, forbidden: tuple[str, ...], under: str = "",
                names: bool = False) -> list[tuple[str, str]]:
    return [(m, t) for m, t in imports(package, under, names)
            if any(t == f or t.startswith(f + ".") for f in forbidden)]


def test_each_folder_holds_the_package_of_its_import_name():
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for name, folder in PACKAGES.items():
        assert (folder / "__init__.py").is_file(), folder
        assert folder.name == name and str(folder.parent.relative_to(REPO)) in find["where"], folder


def test_the_model_side_never_imports_data_preparation():
    assert _violations("mimir_megatron", ("mimir_data_prep",), names=True) == []


def test_kernels_import_neither_project_package():
    assert _violations("mimir_kernels", ("mimir_megatron", "mimir_data_prep"), names=True) == []


@pytest.mark.parametrize("under", ["model", "checkpoint", "data", "inference", "evaluation", "audits"])
def test_model_checkpoint_data_inference_evaluation_audits_import_no_trainer_or_cli(under):
    forbidden = ("mimir_megatron.train", "mimir_megatron.cli", "mimir_megatron.entrypoints")
    assert _violations("mimir_megatron", forbidden, under) == []


def test_the_check_sees_lazy_imports():
    # A lazy, function-local import is found (the form the old cycle took), relative ones resolved.
    found = imports("mimir_data_prep")
    assert ("mimir_data_prep.pack_index", "mimir_megatron.data") in found  # inside build_packing_index
    assert ("mimir_data_prep.demo_build", "mimir_data_prep.prepare") in found  # `from .prepare import`
    # ... and so is a module named in a string for importlib (how the old CLI reached data_prep).
    assert ("mimir_data_prep.cli", "mimir_data_prep.entrypoints.synth") in imports("mimir_data_prep", names=True)


def test_data_preparation_commands_arrive_through_the_entry_point():
    from importlib.metadata import entry_points

    from mimir_megatron.cli import COMMAND_GROUP, build_parser

    assert [e.value for e in entry_points(group=COMMAND_GROUP)] == ["mimir_data_prep.cli:register"]
    (commands,) = [a for a in build_parser()._actions if a.dest == "command"]
    assert {"prepare", "data", "synth", "train", "serve"} <= set(commands.choices)


def _project_modules() -> set[str]:
    return {_module_name(package, path) for package, folder in PACKAGES.items() for path in folder.rglob("*.py")}


def import_cycles() -> list[list[str]]:
    """The project's modules that import each other, directly or around a loop (lazy imports
    included): the strongly connected components of the import graph with more than one module."""
    modules = _project_modules()
    edges: dict[str, set[str]] = {}
    for package in PACKAGES:
        for module, target in imports(package):
            parts = target.split(".")
            while parts and ".".join(parts) not in modules:  # `from pkg.mod import name` -> pkg.mod
                parts.pop()
            if parts and ".".join(parts) != module:
                edges.setdefault(module, set()).add(".".join(parts))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while (top := stack.pop()) != module:
                component.append(top)
            if component:
                cycles.append(sorted([module, *component]))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_one_that_imports_it_back():
    """No import cycles, lazy imports counted: a function-local import that closes a loop is a knot
    (two modules each needing the other), even when it does not fail at import time."""
    assert import_cycles() == []


def test_the_cycle_check_sees_a_loop(monkeypatch):
    real = imports

    def with_loop(package: str, under: str = "", names: bool = False) -> list[tuple[str, str]]:
        extra = [("mimir_data_prep.demo_data", "mimir_data_prep.demo_build")] if package == "mimir_data_prep" else []
        return real(package, under, names) + extra

    monkeypatch.setitem(globals(), "imports", with_loop)
    assert import_cycles() == [["mimir_data_prep.demo_build", "mimir_data_prep.demo_data",
                                "mimir_data_prep.demo_tokenizer"]]  # demo_build -> tokenizer -> data
