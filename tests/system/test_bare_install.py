"""`pip install .` without extras: the CLI answers `--help` for every command, a command whose
extra is missing stops with one line naming it, and `mimir --version` names the version and the
commit of the checkout the wheel was built from; the wheel carries the licence.

The throwaway venv borrows the distributions of the core dependencies (`project.dependencies`,
transitively) from the running environment, minus every distribution an extra names itself
(fastapi and uvicorn arrive through mlflow-skinny, yet a command must not count on them).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

packaging = pytest.importorskip("packaging.requirements")
from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# What the optional extras bring; none of it may be importable in the bare venv.
OPTIONAL_MODULES = ("fastapi", "uvicorn", "httpx", "openai", "inspect_ai", "transformers", "flask",
                    "infini_gram", "matplotlib", "sacrebleu", "datasets", "lm_eval")


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _closure(requirements: list[str]) -> dict[str, md.Distribution]:
    found: dict[str, md.Distribution] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in found or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            found[name] = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue  # e.g. a platform-only dependency
        todo += [Requirement(r) for r in found[name].requires or []]
    return found


def _link_distributions(dists: dict[str, md.Distribution], into: Path) -> None:
    """Symlink each distribution's top-level entries (packages, modules, its .dist-info)."""
    into.mkdir()
    for dist in dists.values():
        root = Path(dist.locate_file(""))
        for entry in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            target = into / entry
            if (root / entry).exists() and not target.exists() and not entry.endswith(".pth"):
                target.symlink_to(root / entry)


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    tmp = tmp_path_factory.mktemp("bare")
    project = _project()
    optional = {canonicalize_name(Requirement(r).name)
                for reqs in project["optional-dependencies"].values() for r in reqs}
    core = _closure(project["dependencies"])
    _link_distributions({n: d for n, d in core.items() if n not in optional}, tmp / "deps")
    _link_distributions(_closure(["setuptools", "wheel"]), tmp / "build")

    source = tmp / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "mlruns", "build", "__pycache__", "*.egg-info", "tests", "_build_commit.py"))
    # A git checkout of its own (the copy's commit, not this repository's): pip builds the wheel
    # from it, and the wheel must remember that commit once installed away from any checkout.
    git = ["git", "-C", str(source), "-c", "user.name=test", "-c", "user.email=test@localhost"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "bare install"]):
        subprocess.run(git + args, check=True, capture_output=True, timeout=120)
    (source / "built_from.txt").write_text(subprocess.run(
        git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip())
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
         "--no-deps", "--no-build-isolation", "--no-index", str(source)],
        env=dict(os.environ, PYTHONPATH=f"{tmp / 'deps'}:{tmp / 'build'}"), cwd=tmp,
        capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(tmp / "deps"), OMP_NUM_THREADS="1")
    return venv, env


def _run(bare, *args: str) -> subprocess.CompletedProcess:
    venv, env = bare
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], env=env, cwd=venv.parent,
                          capture_output=True, text=True, timeout=300)


def test_the_bare_venv_lacks_every_extra(bare):
    probe = f"import importlib.util; print([m for m in {OPTIONAL_MODULES!r} if importlib.util.find_spec(m)])"
    proc = _run(bare, "python", "-c", probe)
    assert proc.stdout.strip() == "[]", f"visible in the bare venv: {proc.stdout} {proc.stderr}"
    found = _run(bare, "python", "-c", "import mimir_megatron, sys; print(mimir_megatron.__file__)")
    assert "site-packages" in found.stdout, found.stdout + found.stderr  # the installed copy


def test_version_names_the_version_and_the_commit_the_wheel_was_built_from(bare):
    venv, _ = bare
    built_from = (venv.parent / "src" / "built_from.txt").read_text()
    proc = _run(bare, "mimir", "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"mimir-megatron {_project()['version']}, commit {built_from}", proc.stdout


def test_the_installed_distribution_carries_the_license(bare):
    probe = ("import importlib.metadata as md; d = md.distribution('mimir-megatron'); "
             "print(d.metadata['License-Expression']); "
             "print([str(f) for f in d.files if f.name == 'LICENSE'])")
    proc = _run(bare, "python", "-c", probe)
    assert proc.stdout.split("\n")[:2] == ["Apache-2.0", f"['mimir_megatron-{_project()['version']}.dist-info/licenses/LICENSE']"], (
        proc.stdout + proc.stderr)


def test_help_of_every_command(bare):
    top = _run(bare, "mimir", "--help")
    assert top.returncode == 0 and "train" in top.stdout and "eval" in top.stdout, top.stderr
    # Walk the parser in the bare venv: every command and subcommand answers --help.
    walk = r"""
import argparse, contextlib, io, sys
from mimir_megatron.cli import build_parser, main

def paths(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from paths(sub, (*prefix, name))

heavy = [m for m in ("torch", "numpy", "megatron", "omegaconf") if m in sys.modules]
assert not heavy, f"building the parser imported {heavy}"
done = 0
for path in paths(build_parser()):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*path, "--help"])
        except SystemExit as exit:
            assert exit.code == 0, (path, exit.code)
    assert "usage: mimir " + " ".join(path) in out.getvalue(), (path, out.getvalue())
    done += 1
print(done)
"""
    proc = _run(bare, "python", "-c", walk)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) >= 20


@pytest.mark.parametrize("args,extra", [
    (["serve", "--checkpoint", "nowhere"], "serve"),
    (["eval", "--suite", "configs/eval/demo.yaml", "--checkpoint", "nowhere"], "eval"),
    (["ui", "--run-dir", "nowhere"], "ui"),
    (["audit", "index", "--data", "nowhere", "--output", "x"], "audit"),
])
def test_a_missing_extra_is_one_line(bare, args, extra):
    proc = _run(bare, "mimir", *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and f"pip install 'mimir-megatron[{extra}]'" in lines[0], proc.stderr


def test_an_optional_import_a_command_reaches_is_one_line(monkeypatch, caplog):
    """A command that declares no extra but imports an optional package: the extra that names
    that package is found from the package metadata (here httpx: the eval extra)."""
    from mimir_megatron import cli
    from mimir_megatron.entrypoints import model_files as commands

    def needs_httpx(args):
        raise ModuleNotFoundError("No module named 'httpx'", name="httpx")

    monkeypatch.setattr(commands, "cmd_import", needs_httpx)
    assert cli.main(["import", "--hf", ".", "--output", "y"]) == 2
    assert caplog.messages == ["mimir import needs the Python package httpx, which is not installed: "
                               "pip install 'mimir-megatron[eval]'"]
