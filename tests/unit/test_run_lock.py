"""The run directory's lock and its mode on a shared filesystem (run.private)."""

from __future__ import annotations

import os
import stat

from conftest import REPO

from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.run_lock import RunLock


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_private_run_directory_is_its_owners_alone_whatever_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        new, existing = tmp_path / "new" / "run", tmp_path / "existing"
        existing.mkdir(mode=0o755)
        for run_dir in (new, existing):
            lock = RunLock(run_dir, private=True)
            lock.acquire()
            lock.release()
            assert _mode(run_dir) == 0o700, run_dir
        shared = tmp_path / "shared"
        lock = RunLock(shared)  # the default: the umask decides, as for every file in it
        lock.acquire()
        lock.release()
        assert _mode(shared) == 0o755
    finally:
        os.umask(old)


def test_run_private_is_a_config_key_off_by_default():
    demo = REPO / "configs" / "train" / "demo.yaml"
    assert load_train_config(demo).run.private is False
    assert load_train_config(demo, ["run.private=true"]).run.private is True
