"""Nothing damaged is loaded silently: checkpoint digests, the fallback of resume, non-finite
weights, a full disk, and one trainer per run directory.

Each test injects one fault into a copy of the session's 6-step reference run (checkpoints at
steps 3 and 6, its MLflow run in ``mlflow.db``) and asserts what the user sees. Every kind of file
a checkpoint records is damaged once (a data shard, torch_dist's and megatron's metadata, the RNG
state, the trainer state): a reader that skipped any kind would load it silently.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_faults import remount_read_only, small_tmpfs
from checkpoint_states import assert_same_state
from conftest import REPO, train_overrides

from mimir_megatron.checkpoint import CheckpointWriteError, read_trainer_state
from mimir_megatron.checkpoint.digests import CheckpointDamaged
from mimir_megatron.cli import main
from mimir_megatron.errors import UserError
from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.loop import train
from mimir_megatron.train.step import StepHooks
from mimir_megatron.train.tracking import metric_name

DEMO = REPO / "configs" / "train" / "demo.yaml"


def run(demo_data, run_dir, *extra, stop_at_step=None, hooks=None):
    cfg = load_train_config(DEMO, train_overrides(demo_data, run_dir, *extra))
    return train(cfg, stop_at_step=stop_at_step, hooks=hooks)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:07d}"


def latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def loss_history(run_dir: Path, run_id: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    history = MlflowClient(f"sqlite:///{run_dir}/mlflow.db").get_metric_history(run_id, metric_name("loss"))
    return sorted((m.step, m.value) for m in history)


@pytest.fixture
def copied(reference_run, tmp_path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run[0], run_dir)
    return run_dir


# -- the faults ------------------------------------------------------------------------------------


def flip_in(file: Path) -> str:
    """Up to 64 bytes in the middle of ``file`` inverted (its size unchanged)."""
    size = file.stat().st_size
    length = min(64, size)
    with open(file, "r+b") as f:
        f.seek((size - length) // 2)
        block = f.read(length)
        f.seek(-length, os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in block))
    return f"{file.name} differs from what was written"


def flip_bytes(path: Path) -> str:
    """The largest data file (a torch_dist shard) damaged."""
    return flip_in(max(path.glob("*.distcp"), key=lambda p: p.stat().st_size))


def flip_metadata(path: Path) -> str:
    """torch_dist's metadata (``.metadata``), which says where each tensor lies in the shards."""
    return flip_in(path / ".metadata")


def flip_megatron_metadata(path: Path) -> str:
    """megatron's ``metadata.json`` (the sharded backend and its version)."""
    return flip_in(path / "metadata.json")


def flip_rng(path: Path) -> str:
    """The RNG state of rank 0 (read only on resume: nothing else would notice)."""
    return flip_in(path / "rng_rank0.safetensors")


def truncate_data(path: Path) -> str:
    data_file = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = data_file.stat().st_size
    os.truncate(data_file, size // 2)
    return f"{data_file.name} is truncated ({size // 2:,} bytes, {size:,} written)"


def truncate_state(path: Path) -> str:
    state = path / "trainer_state.json"
    state.write_text(state.read_text()[:200])
    return f"{state}: damaged trainer state"


FAULTS = {"flipped bytes": flip_bytes, "truncated data file": truncate_data,
          "truncated trainer state": truncate_state, "flipped metadata": flip_metadata,
          "flipped megatron metadata": flip_megatron_metadata, "flipped RNG state": flip_rng}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_damaged_newest_checkpoint_is_refused_and_resume_falls_back(demo_data, reference_run, copied,
                                                                     fault, caplog, capsys):
    damaged = step_dir(copied, 6)
    expected = FAULTS[fault](damaged)
    # export and generate (serve, eval and audits load through the same load_model) refuse it.
    caplog.set_level(logging.WARNING)
    out = copied / "export"
    assert main(["export", "--checkpoint", str(copied), "--output", str(out)]) == 2
    prompts = copied / "prompts.jsonl"
    prompts.write_text('{"prompt": "1 + 1 ="}\n')
    assert main(["generate", "--checkpoint", str(damaged), "--input", str(prompts),
                 "--output", str(copied / "out.jsonl")]) == 2
    refusals = [r.getMessage() for r in caplog.records if r.name == "mimir" and r.levelno == logging.ERROR]
    assert len(refusals) == 2 and all(expected in line and "\n" not in line for line in refusals), refusals
    assert not out.exists() and not (copied / "out.jsonl").exists()

    # resume (auto) falls back to step 3, says so, and keeps the damaged checkpoint.
    caplog.clear()
    whole = fault == "flipped bytes"  # the others stop after one step: the fallback is the point
    resumed = run(demo_data, copied, stop_at_step=None if whole else 4)
    warnings = caplog.text
    assert expected in warnings and f"resuming from {step_dir(copied, 3)}, the newest checkpoint that verifies" \
        in warnings
    assert resumed.losses == reference_run[1].losses[3:None if whole else 4]
    kept = list((copied / "checkpoints" / "abandoned").glob("*/step_0000006"))
    assert len(kept) == 1 and (kept[0] / "trainer_state.json").exists()
    if whole:
        assert_same_state(step_dir(copied, 6), step_dir(reference_run[0], 6))
        # steps 4-6 were logged before the "kill"; replayed, they are not logged again.
        assert loss_history(copied, resumed.run_id) == list(enumerate(reference_run[1].losses, start=1))


def test_a_damaged_checkpoint_asked_for_by_name_is_refused(demo_data, copied):
    expected = flip_bytes(step_dir(copied, 3))
    with pytest.raises(CheckpointDamaged, match=expected):
        run(demo_data, copied, f"checkpoint.resume={step_dir(copied, 3)}")
    with pytest.raises(CheckpointDamaged, match=expected):  # init_from verifies too
        run(demo_data, copied.parent / "other", f"checkpoint.init_from={step_dir(copied, 3)}")
    assert latest(copied) == "step_0000006"
    # A trainer state edited in place (valid JSON, another number) is caught by its own digest.
    state = step_dir(copied, 6) / "trainer_state.json"
    state.write_text(state.read_text().replace('"consumed_samples": 24', '"consumed_samples": 25'))
    with pytest.raises(UserError, match=rf"^{state}: damaged trainer state \(its content does not match its "
                                        r"digest\)$"):
        read_trainer_state(step_dir(copied, 6))


# -- non-finite weights ----------------------------------------------------------------------------


def nan_head_at(step: int) -> StepHooks:
    """Weights turn NaN during ``step`` after its loss was computed (finite): an overflowed update."""
    import torch

    def after_reduction(at: int, loss, params) -> None:
        if at == step:
            with torch.no_grad():
                params[-1].fill_(float("nan"))

    return StepHooks(after_reduction=after_reduction)


def test_weights_that_are_not_finite_are_never_written(demo_data, copied, monkeypatch, caplog):
    resume = f"checkpoint.resume={step_dir(copied, 3)}"
    with pytest.raises(CheckpointWriteError, match=r"not writing checkpoint step_0000004: the weights are not "
                                                   r"finite \(.* holds NaN or Inf\); the previous checkpoint "
                                                   r"\(step_0000003\) and `latest` are intact"):
        run(demo_data, copied, resume, stop_at_step=4, hooks=nan_head_at(4))
    assert latest(copied) == "step_0000003" and not step_dir(copied, 4).exists()

    # A checkpoint holding NaN with valid digests (a writer without the check): the first step
    # after resuming from it is reported as such.
    from mimir_megatron.checkpoint.write import CheckpointWriter

    monkeypatch.setattr(CheckpointWriter, "_refuse_nonfinite", lambda *args: None)
    run(demo_data, copied, resume, stop_at_step=4, hooks=nan_head_at(4))
    monkeypatch.undo()
    caplog.set_level(logging.WARNING)
    with pytest.raises(CheckpointWriteError, match="not writing checkpoint step_0000006: the weights are not finite"):
        run(demo_data, copied)  # steps 5 and 6 are skipped (train.on_nonfinite=skip), then the save refused
    assert f"non-finite step 5: loss nan, gradient norm nan, the first step after resuming from " \
           f"{step_dir(copied, 4)} (its weights or optimizer state may not be finite)" in caplog.text
    assert latest(copied) == "step_0000004"


# -- a full disk ------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """1.5 checkpoints of the test model (3.6 MB each): the second save cannot fit."""
    with small_tmpfs(tmp_path / "small", "5600k") as mount:
        yield mount


def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(demo_data, tmp_path, small_disk):
    ckpts = small_disk / "checkpoints"
    with pytest.raises(CheckpointWriteError) as failure:
        run(demo_data, tmp_path, "train.steps=2", "checkpoint.interval=1", "checkpoint.keep=2",
            f"checkpoint.dir={ckpts}")
    message = str(failure.value)
    assert message.startswith(f"could not write checkpoint step_0000002 to {ckpts}: no space left on device: "
                              f"{ckpts}, "), message
    needed = int(message.split(", ")[1].split(" bytes needed")[0].replace(",", ""))
    assert needed >= sum(d.bytes for d in read_trainer_state(ckpts / "step_0000001").files.values()) // 2
    assert message.endswith("the previous checkpoint (step_0000001) and `latest` are intact")
    assert (ckpts / "latest").read_text().strip() == "step_0000001"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_0000001"]


def test_a_read_only_run_directory_is_one_line(demo_data, tmp_path, small_disk):
    remount_read_only(small_disk)
    with pytest.raises(UserError, match=rf"^run directory {small_disk / 'run'} is not writable \(Read-only file "
                                        r"system\); set run.dir to a writable directory$"):
        run(demo_data, small_disk / "run", f"checkpoint.dir={tmp_path / 'checkpoints'}")


# -- one trainer per run directory ----------------------------------------------------------------


def test_a_second_trainer_on_the_same_run_directory_refuses(demo_data, reference_run, tmp_path):
    """Trainer B starts (other learning rate) while trainer A runs its first step: B exits 2 with
    one line naming A; A's checkpoints and MLflow run are those of an undisturbed run."""
    run_dir, log_path = tmp_path / "run", tmp_path / "second.log"
    second: list[int] = []

    def start_second(step: int, loss, params) -> None:
        if step == 1:
            cmd = [sys.executable, "-m", "mimir_megatron.cli", "train", "--config", str(DEMO),
                   *train_overrides(demo_data, run_dir, "optim.lr=1e-3")]
            with open(log_path, "w") as log:
                second.append(subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode)

    first = run(demo_data, run_dir, hooks=StepHooks(after_reduction=start_second))
    lines = [line for line in log_path.read_text().splitlines() if "in use" in line]
    assert second == [2], log_path.read_text()[-3000:]
    assert len(lines) == 1 and f"run directory {run_dir} is in use by another trainer (host " in lines[0]
    assert f", pid {os.getpid()}, since " in lines[0]
    assert first.losses == reference_run[1].losses
    for step in (3, 6):
        assert_same_state(step_dir(run_dir, step), step_dir(reference_run[0], step))
    assert loss_history(run_dir, first.run_id) == list(enumerate(reference_run[1].losses, start=1))
