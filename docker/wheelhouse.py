"""Fill the wheelhouse docker/Dockerfile installs from, for the base image's own Python.

docker/build.sh runs this inside a container of the base image (with network, the host's CA
bundle and a pip cache mounted), so every wheel matches the interpreter, platform and
pre-installed packages of the image being built; the build itself then runs without network.

    python3 wheelhouse.py fill DIR       fill DIR/torch and DIR/deps
    python3 wheelhouse.py current DIR    exit 0 when both are up to date for these inputs

Writes two folders, so that a change of the dependencies does not reinstall torch in the image:
``torch/`` holds torch's own closure (empty when the base has torch, like the NVIDIA image),
``deps/`` the rest (the pinned runtime dependencies and the project's build requirements).
Each holds ``PYTHON`` (the interpreter tag, e.g. ``cp313``, which the Dockerfile checks) and
``STAMP`` (the digest of its inputs: a fill keeps an up-to-date torch/, and docker/build.sh
skips the fill when both are up to date).
Standard library and pip only: the base has nothing else.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# What each folder is made from: torch/ is refilled only when its pins change.
INPUTS = {"torch": ("requirements-torch.txt",),
          "deps": ("requirements.txt", "requirements-torch.txt", "wheelhouse.py")}
BUILD_REQUIREMENTS = ("setuptools>=77", "wheel")  # pyproject.toml's [build-system] requires


def python_tag() -> str:
    return f"cp{sys.version_info[0]}{sys.version_info[1]}"


def stamp(part: str) -> str:
    digest = hashlib.sha256(python_tag().encode())
    for name in INPUTS[part]:
        digest.update((HERE / name).read_bytes())
    return digest.hexdigest()


def current(folder: Path) -> bool:
    stamp_file = folder / "STAMP"
    return stamp_file.is_file() and stamp_file.read_text().strip() == stamp(folder.name)


def empty(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        old.unlink()


def finish(folder: Path) -> None:
    (folder / "PYTHON").write_text(python_tag() + "\n")
    (folder / "STAMP").write_text(stamp(folder.name) + "\n")


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def has_torch() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
    return probe.returncode == 0


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_names(folder: Path) -> set[str]:
    """The canonical project names of the wheels in ``folder``."""
    return {canonical(path.name.split("-", 1)[0]) for path in folder.glob("*.whl")}


def fill(out: Path) -> None:
    torch_dir, deps_dir = out / "torch", out / "deps"
    requirements = ["-r", str(HERE / "requirements.txt")]
    if has_torch():
        print("wheelhouse: torch comes from the base image", flush=True)
        empty(torch_dir)
        finish(torch_dir)
    else:
        requirements += ["-r", str(HERE / "requirements-torch.txt")]
        if current(torch_dir):
            print("wheelhouse: torch's wheels are up to date", flush=True)
        else:
            print("wheelhouse: torch and its CUDA libraries (about 3 GB on first download)", flush=True)
            empty(torch_dir)
            pip("wheel", "--wheel-dir", str(torch_dir), "-r", str(HERE / "requirements-torch.txt"))
            finish(torch_dir)
    empty(deps_dir)
    # What installing the requirements on this base would add: packages the base has (the
    # NVIDIA image's torch stack) are not in the report, torch's closure is taken from torch/.
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--quiet", "--report", str(report), "--find-links", str(torch_dir),
            *requirements)
        planned = json.loads(report.read_text())["install"]
    in_torch = wheel_names(torch_dir)
    pins = [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in planned
            if canonical(item["metadata"]["name"]) not in in_torch]
    print(f"wheelhouse: {len(pins)} dependencies", flush=True)
    pip("wheel", "--no-deps", "--wheel-dir", str(deps_dir), *pins)
    pip("wheel", "--wheel-dir", str(deps_dir), *BUILD_REQUIREMENTS)
    finish(deps_dir)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "fill":
        fill(Path(argv[1]))
        return 0
    if len(argv) == 2 and argv[0] == "current":
        return 0 if all(current(Path(argv[1]) / part) for part in INPUTS) else 1
    print("usage: wheelhouse.py fill DIR | current DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
