"""The data path within the open-file limit: `mimir train` under `ulimit -n 256` on a mixture of
more shard files than that (two files per shard), which needs the bounded pool of open files."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from audit_support import write_prepared
from conftest import REPO, train_overrides

LIMIT = 256
SHARDS = 300  # 600 shard files, more than twice the limit


def limited(limit: int):
    def preexec() -> None:  # soft and hard: the trainer cannot raise it past this
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    return preexec


def mimir_exe() -> str:
    beside = Path(sys.executable).parent / "mimir"
    exe = str(beside) if beside.exists() else shutil.which("mimir")
    assert exe, "the `mimir` console script is not installed (pip install -e .)"
    return exe


def test_training_reads_more_shards_than_the_open_file_limit(tmp_path):
    rng = np.random.default_rng(0)
    docs = [(rng.integers(5, 1000, int(rng.integers(3, 12))).tolist(),
             rng.integers(5, 1000, int(rng.integers(2, 12))).tolist()) for _ in range(SHARDS)]
    write_prepared(tmp_path / "many", docs, docs_per_file=1)
    assert len(list((tmp_path / "many" / "shards").iterdir())) == 2 * SHARDS > LIMIT
    mixture = tmp_path / "mixture.yaml"
    mixture.write_text(f"name: many\ndatasets:\n  - {{path: {tmp_path / 'many'}, category: A, language: en}}\n")
    overrides = train_overrides(tmp_path, tmp_path / "run", f"data.mixture={mixture}", "data.eval_path=null",
                                "train.steps=8", "checkpoint.interval=100")
    proc = subprocess.run([mimir_exe(), "train", "--config", str(REPO / "configs/train/demo.yaml"), *overrides],
                          capture_output=True, text=True, timeout=600, preexec_fn=limited(LIMIT),
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 8 steps x 4 contexts of 64 tokens: more than half of the 300 one-document shards were read.
    assert (tmp_path / "run" / "checkpoints" / "step_0000008").is_dir()
