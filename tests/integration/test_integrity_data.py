"""Damaged prepared data never trains: the checks `mimir train` runs before step 1.

Faults go into a copy of the session's demo data (448 KB; every dataset holds one shard of 150
documents): an ``.idx`` swapped for another dataset's, a ``.bin`` 4 bytes short, a ``.bin`` cut
in half, a read-only data directory.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from checkpoint_faults import remount_read_only, small_tmpfs
from conftest import REPO, train_overrides

from mimir_megatron.errors import UserError
from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.loop import train

DEMO = REPO / "configs" / "train" / "demo.yaml"


def copy_data(demo_data: Path, target: Path) -> Path:
    shutil.copytree(demo_data, target, ignore=shutil.ignore_patterns("_index", "raw"), dirs_exist_ok=True)
    mixture = (demo_data / "mixture.yaml").read_text().replace(str(demo_data), str(target))
    (target / "mixture.yaml").write_text(mixture)
    return target


def train_on(data: Path, run_dir: Path, *extra: str):
    overrides = [*train_overrides(data, run_dir, *extra), "train.steps=1", "checkpoint.interval=1"]
    return train(load_train_config(DEMO, overrides))


def shard(data: Path, dataset: str, ext: str) -> Path:
    return data / dataset / "shards" / f"00000.{ext}"


def test_damaged_or_swapped_files_are_refused_before_step_1(demo_data, tmp_path, caplog):
    data = copy_data(demo_data, tmp_path / "data")
    shutil.copy(shard(data, "arith-en", "idx"), shard(data, "algo-en", "idx"))  # swapped
    short, half = shard(data, "arith-da", "bin"), shard(data, "text-en", "bin")
    size = short.stat().st_size
    os.truncate(short, size - 4)
    os.truncate(half, half.stat().st_size // 2)

    with pytest.raises(UserError) as refusal:
        train_on(data, tmp_path / "run")
    lines = str(refusal.value).splitlines()
    assert lines[0] == f"refusing to train on {data / 'mixture.yaml'}:"
    assert lines[1:] == [
        f"  - dataset algo-en: {shard(data, 'algo-en', 'idx')}: sha256 differs from the manifest's (damaged, "
        "or replaced since mimir prepare wrote it); prepare the dataset again",
        f"  - dataset arith-da: {shard(data, 'arith-da', 'bin')}: {size - 4:,} bytes, its index 00000.idx "
        f"covers {size:,} (truncated, or one of the two comes from elsewhere)",
        f"  - dataset text-en: {half}: {half.stat().st_size:,} bytes, its index 00000.idx covers "
        f"{2 * half.stat().st_size:,} (truncated, or one of the two comes from elsewhere)",
    ]
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "mlflow.db").exists()

    # Without the sha256 (trusted corpora): the structural checks still catch all three, and say
    # that the verification was skipped.
    caplog.set_level(logging.WARNING)
    with pytest.raises(UserError) as structural:
        train_on(data, tmp_path / "run", "data.verify=false")
    assert "sha256 not verified (data.verify=false" in caplog.text
    swapped = [line for line in str(structural.value).splitlines() if "algo-en" in line]
    assert len(swapped) == 1 and "its index 00000.idx covers" in swapped[0], swapped
    assert len(str(structural.value).splitlines()) == 4


def test_the_ranks_share_the_hashing(demo_data, tmp_path):
    """Two shares hash disjoint halves: a damaged file is found by exactly one of them."""
    from mimir_megatron.data.mixture import load_mixture
    from mimir_megatron.data.policy import training_data_problems

    data = copy_data(demo_data, tmp_path / "data")
    target = shard(data, "text-da", "bin")  # one token changed: only a digest sees it
    with open(target, "r+b") as f:
        first = f.read(1)[0]
        f.seek(0)
        f.write(bytes([first ^ 1]))
    mixture = load_mixture(data / "mixture.yaml")
    shares = [training_data_problems(mixture, rank=r, world=2) for r in (0, 1)]
    assert sorted(len(s) for s in shares) == [0, 1]
    assert f"dataset text-da: {target}: sha256 differs" in (shares[0] + shares[1])[0]


def test_a_read_only_data_directory_is_one_line(demo_data, tmp_path):
    with small_tmpfs(tmp_path / "ro", "2m") as mount:
        data = copy_data(demo_data, mount / "data")
        remount_read_only(mount)
        with pytest.raises(UserError, match=rf"^{data / '_index'} is not writable \(Read-only file system\); set "
                                            r"data.index_dir to a writable directory"):
            train_on(data, tmp_path / "run")
