"""The `mimir` console command: info, export, import, and clean errors."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MIMIR, TINY


def mimir(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    beside = Path(sys.executable).parent / "mimir"  # the venv running the tests
    exe = str(beside) if beside.exists() else shutil.which("mimir")
    assert exe, "the `mimir` console script is not installed (pip install -e .)"
    proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if check and proc.returncode != 0:
        raise AssertionError(f"mimir {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def test_info_reproduces_the_paper_counts():
    info = json.loads(mimir("info", "--config", str(MIMIR), "--json").stdout)
    assert info["total"] == 1_786_773_504
    assert info["embedding"] == 402_653_184
    assert info["head"] == 402_653_184
    assert info["non_embedding"] == 1_384_120_320
    assert info["stack_L"] + info["stack_H"] == 981_467_136
    assert info["schedule"] == "LLLHLLLH"


def test_info_table():
    out = mimir("info", "--config", str(TINY)).stdout
    assert "total" in out and "LLLHLLLH" in out


def test_export_then_import(tmp_path):
    mimir("export", "--config", str(TINY), "--seed", "3", "--output", str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "config.json").is_file()
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    mimir("import", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "w"))
    assert (tmp_path / "w" / "model.yaml").is_file()
    mimir("export", "--model", str(tmp_path / "w"), "--output", str(tmp_path / "hf2"))  # recognised as weights
    import torch

    from mimir_megatron.interop import read_safetensors_dir

    a, b = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(tmp_path / "hf2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "args,message",
    [
        (["info", "--config", "nope.yaml"], "config file not found: nope.yaml"),
        (["info", "--config", str(TINY), "h_cycles=0"], "model.h_cycles must be >= 1, got 0"),
        (["import", "--hf", "/nonexistent", "--output", "/tmp/x"], "model directory not found: /nonexistent"),
    ],
)
def test_user_errors_are_one_clear_message(args, message):
    proc = mimir(*args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
