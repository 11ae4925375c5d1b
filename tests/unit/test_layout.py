"""The package layout keeps the architecture's layers: read from the source's import statements
(lazy imports inside functions included), so a new import across a layer fails here.

- each top-level folder holds the package of its import name (kernels/mimir_kernels, ...);
- mimir_megatron never imports mimir_data_prep (data preparation builds on the model side, and
  adds its `mimir` commands through an entry point);
- mimir_kernels imports neither project package;
- the model, checkpoints, data, inference, evaluation and audits import no trainer and no CLI
  entry point.
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
    assert ("mimir_data_prep.demo_data", "mimir_data_prep.prepare") in found  # `from .prepare import`
    # ... and so is a module named in a string for importlib (how the old CLI reached data_prep).
    assert ("mimir_data_prep.cli", "mimir_data_prep.entrypoints.synth") in imports("mimir_data_prep", names=True)


def test_data_preparation_commands_arrive_through_the_entry_point():
    from importlib.metadata import entry_points

    from mimir_megatron.cli import COMMAND_GROUP, build_parser

    assert [e.value for e in entry_points(group=COMMAND_GROUP)] == ["mimir_data_prep.cli:register"]
    (commands,) = [a for a in build_parser()._actions if a.dest == "command"]
    assert {"prepare", "data", "synth", "train", "serve"} <= set(commands.choices)
