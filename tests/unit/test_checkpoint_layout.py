"""Which checkpoint a path stands for, and which are pruned, on hand-made checkpoint directories
(a ``step_N`` directory with its ``trainer_state.json``; no tensors): the ``latest`` pointer, the
newest *written* checkpoint without one, a dangling pointer, unreadable or undated states; and the
trainer state's own round trip, an older writer's state included."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import REPO

from mimir_megatron.checkpoint import latest_checkpoint, prune_checkpoints, resolve
from mimir_megatron.checkpoint.layout import STATE_FILE, complete_checkpoints
from mimir_megatron.checkpoint.trainer_state import (
    BaseModel,
    DatasetLineage,
    TrainerState,
    read_trainer_state,
    write_trainer_state,
)
from mimir_megatron.errors import UserError


def make_checkpoint(checkpoint_dir: Path, step: int, written_at: float) -> Path:
    path = checkpoint_dir / f"step_{step:07d}"
    path.mkdir(parents=True)
    write_trainer_state(path, TrainerState(step=step, written_at=written_at))
    return path


def names(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def test_without_latest_the_newest_written_checkpoint_is_resumed(tmp_path, caplog):
    """A kill between a checkpoint's rename and the pointer update leaves no ``latest``: the run
    goes on from the newest written, not the oldest, and not the highest step (step 9 is from a
    timeline rolled back to step 5)."""
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.resume import resume_path

    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    for step, written_at in [(3, 1.0), (9, 2.0), (5, 3.0), (7, 4.0), (6, 5.0)]:
        make_checkpoint(ckpts, step, written_at)
    newest = ckpts / "step_0000006"
    with caplog.at_level(logging.WARNING, logger="mimir_megatron.checkpoint.layout"):
        assert latest_checkpoint(ckpts) == newest
    assert "has no `latest`; taking the newest written checkpoint, step_0000006" in caplog.text
    assert resolve(ckpts) == resolve(run_dir) == newest  # `mimir export/eval --checkpoint RUN`
    cfg = load_train_config(REPO / "configs" / "train" / "demo.yaml",
                            [f"run.dir={run_dir}", f"data.mixture={REPO / 'configs' / 'data' / 'demo.yaml'}"])
    assert cfg.checkpoint.resume == "auto" and resume_path(cfg) == newest  # `mimir train` again
    (ckpts / "latest").write_text("step_0000005\n")  # the pointer, where there is one, decides
    assert latest_checkpoint(ckpts) == resolve(run_dir) == ckpts / "step_0000005"


def test_undated_and_unreadable_states_sort_oldest(tmp_path):
    """Fallbacks of the written order: states from before ``written_at`` was recorded (0.0) order
    by step, below every dated one; an unreadable state counts as oldest (pruned first, never
    taken as the newest)."""
    undated, damaged = tmp_path / "undated", tmp_path / "damaged"
    for step, written_at in [(4, 0.0), (2, 0.0), (8, 1.0), (1, 2.0)]:
        make_checkpoint(undated, step, written_at)
    assert names(complete_checkpoints(undated)) == ["step_0000002", "step_0000004", "step_0000008", "step_0000001"]
    for step, written_at in [(2, 1.0), (5, 2.0), (9, 3.0)]:
        make_checkpoint(damaged, step, written_at)
    (damaged / "step_0000009" / STATE_FILE).write_text("{not json")
    assert names(complete_checkpoints(damaged)) == ["step_0000009", "step_0000002", "step_0000005"]
    assert latest_checkpoint(damaged) == damaged / "step_0000005"
    prune_checkpoints(damaged, keep=1)
    assert names(list(damaged.glob("step_*"))) == ["step_0000005"]


def test_pruning_keeps_the_newest_written_and_the_one_latest_names(tmp_path):
    # The issue's case: 9 and 12 from an abandoned timeline, then 5, 7, 8 written.
    for step, written_at in [(9, 1.0), (12, 2.0), (5, 3.0), (7, 4.0), (8, 5.0)]:
        make_checkpoint(tmp_path, step, written_at)
    (tmp_path / "latest").write_text("step_0000008\n")
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_0000007", "step_0000008"]
    (tmp_path / "latest").write_text("step_0000007\n")
    make_checkpoint(tmp_path, 10, 6.0)
    prune_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_0000007", "step_0000010"]


def test_a_dangling_latest_is_an_error_not_a_fresh_start(tmp_path):
    assert latest_checkpoint(tmp_path) is None  # no checkpoint at all: a fresh start
    make_checkpoint(tmp_path, 3, 1.0)
    (tmp_path / "latest").write_text("step_0000005\n")
    with pytest.raises(UserError, match=r"latest names step_0000005, which is not a complete checkpoint; "
                                         r"refusing to start again from step 0 \(complete checkpoints "
                                         r"here: step_0000003\)"):
        latest_checkpoint(tmp_path)
    (tmp_path / "latest").unlink()  # killed between the rename and the pointer update
    assert latest_checkpoint(tmp_path) == tmp_path / "step_0000003"


def test_the_trainer_state_reads_back_as_written(tmp_path):
    """Every field, the nested lineage and the chain of base models (dataclasses inside tuples)
    included; the reader is the one resume, export and the audits use."""
    lineage = (
        DatasetLineage("a", "/data/a", "A", "en", "g", {"status": "declared", "license": "cc-by-4.0"},
                       "ab" * 32, documents=3, tokens=40, response_tokens=12),
        DatasetLineage("b", "/data/b", "B", "da", "g", {"status": "unknown"}, None),
    )
    base = BaseModel("/runs/v1/checkpoints/step_0000100", 100, "run-v1", lineage, BaseModel("/weights/imported"))
    state = TrainerState(
        step=7, consumed_samples=56, window_k=3, optimizer_group_steps={"L": 7, "H": 7},
        data_fingerprint="f" * 64, model={"hidden_size": 64}, padded_vocab_size=256, has_ema=True,
        mlflow_run_id="run-v15", config={"optim": {"ema_decay": 0.99}}, lineage=lineage[:1],
        base_model=base, data_policy={"allowed_licenses": ["cc-by-4.0"]}, format=1, written_at=12.5,
    )
    write_trainer_state(tmp_path, state)
    assert read_trainer_state(tmp_path) == state


def test_an_older_writers_state_takes_defaults_and_a_newer_ones_extra_fields_are_ignored(tmp_path):
    (tmp_path / STATE_FILE).write_text(
        '{"step": 4, "config": {"optim": {"ema_decay": 0.99}}, "field_from_a_newer_writer": 1}')
    state = read_trainer_state(tmp_path)
    assert (state.step, state.has_ema, state.lineage, state.base_model, state.written_at) == (4, True, (), None, 0.0)
    (tmp_path / STATE_FILE).write_text('{"step": 4, "config": {"optim": {"ema_decay": 0.0}}}')
    assert read_trainer_state(tmp_path).has_ema is False
    (tmp_path / STATE_FILE).write_text('{"consumed_samples": 4}')
    with pytest.raises(UserError, match="trainer state lacks step"):
        read_trainer_state(tmp_path)
