"""Which mimir-megatron this is: its version and the git commit it was built from (`mimir --version`,
the MLflow tag `git_commit`).

Run from a source checkout (an editable install, or the tree itself), the commit is asked of git at
once, with whether tracked files have uncommitted changes. An installed wheel has no repository
beside it: building it writes that same answer into ``mimir_megatron/_build_commit.py`` (the build
steps below, named in pyproject.toml's ``[tool.setuptools.cmdclass]``); an sdist carries the file,
so a wheel built from the sdist keeps the commit of the checkout the sdist was made from. Without
either, the commit is unknown.

setuptools loads this file on its own to find the build steps, so it imports nothing from this
package, and setuptools only when a build asks for a step.
"""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DISTRIBUTION = "mimir-megatron"
BUILD_COMMIT_MODULE = "_build_commit.py"  # generated next to this file in builds; not in git


@dataclass(frozen=True)
class Commit:
    sha: str
    dirty: bool  # tracked files differed from the commit

    def __str__(self) -> str:
        return self.sha + (" with uncommitted changes" if self.dirty else "")


def version() -> str:
    """The installed distribution's version ("unknown" when run from a tree never installed)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def git_commit(root: Path) -> Commit | None:
    """HEAD of the checkout at ``root`` (which must hold ``.git`` itself: an unpacked sdist or a
    site-packages inside some other repository must not borrow that repository's commit)."""
    if not (root / ".git").exists():
        return None
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        changes = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return Commit(sha, bool(changes)) if sha else None


def commit(package: Path | None = None) -> Commit | None:
    """The commit this code (or the package at ``package``) was built from (see the module
    docstring), or None."""
    package = package or Path(__file__).resolve().parent
    found = git_commit(package.parent)
    if found is not None:
        return found
    recorded = package / BUILD_COMMIT_MODULE
    if recorded.is_file():
        values = {target.id: ast.literal_eval(node.value)  # two literals written by the build below
                  for node in ast.parse(recorded.read_text()).body if isinstance(node, ast.Assign)
                  for target in node.targets if isinstance(target, ast.Name)}
        if values.get("COMMIT"):
            return Commit(str(values["COMMIT"]), bool(values.get("DIRTY")))
    return None


def describe() -> str:
    """One line: ``mimir-megatron 0.1.0, commit <sha>[ with uncommitted changes]``."""
    return f"{DISTRIBUTION} {version()}, commit {commit() or 'unknown'}"


# -- build steps (setuptools) -------------------------------------------------------------------------


def _build_commit_source(found: Commit | None) -> str:
    return ("# Written when this package was built (mimir_megatron/version.py); not in git.\n"
            f"COMMIT = {found.sha if found else None!r}\n"
            f"DIRTY = {found.dirty if found else False!r}\n")


def _record(package_dir: Path, source_root: Path) -> None:
    """Write the checkout's commit into ``package_dir``; without a checkout, keep a file that an
    sdist brought (a wheel built from an sdist), else write an unknown commit."""
    target = package_dir / BUILD_COMMIT_MODULE
    found = git_commit(source_root)
    if found is None and target.is_file():
        return
    package_dir.mkdir(parents=True, exist_ok=True)
    target.write_text(_build_commit_source(found))


def __getattr__(name: str) -> Any:
    # The build steps subclass setuptools' commands; they are made only when setuptools asks for
    # them, so that importing this module never needs setuptools.
    if name == "BuildPy":
        from setuptools.command.build_py import build_py

        class BuildPy(build_py):
            """build_py that also writes ``_build_commit.py`` (not in editable installs: those
            run from the checkout and ask git)."""

            def run(self) -> None:
                super().run()
                if not getattr(self, "editable_mode", False):
                    _record(Path(self.build_lib) / "mimir_megatron", Path.cwd())

        return BuildPy
    if name == "Sdist":
        from setuptools.command.sdist import sdist

        class Sdist(sdist):
            """sdist whose tree carries ``_build_commit.py`` for the wheels built from it."""

            def make_release_tree(self, base_dir: str, files: list[str]) -> None:
                super().make_release_tree(base_dir, files)
                _record(Path(base_dir) / "mimir_megatron", Path.cwd())

        return Sdist
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
