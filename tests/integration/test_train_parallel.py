"""Data and tensor parallel training against one process, and checkpoints across TP layouts.

Tolerance: DP and TP change only the order of fp32 reductions, so losses agree to ~1e-6
relative; we allow 2e-5 over six steps. Data parallelism is compared with clipping off and on the
whole state (weights, EMA, Adam moments): with clipping on (every step clips) and Adam cancelling a
constant factor, losses alone would not notice gradients off by a factor; Adam's moments would.
"""

import json

import pytest
from conftest import REPO, train_overrides
from checkpoint_states import assert_close_states
from distributed import run_ranks

from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.loop import train

pytestmark = pytest.mark.multiprocess
RTOL = 2e-5


def losses(run_dir, final_step=6):
    return json.loads((run_dir / f"losses_{final_step}.json").read_text())


UNCLIPPED = ("optim.clip_grad=0", "train.steps=3")


@pytest.fixture(scope="module")
def reference(reference_run):
    """One process, micro-batch 2 x accumulation 2 = global batch 4."""
    return reference_run[1].losses


def test_data_parallel_matches_one_process(demo_data, tmp_path):
    # DP=2, micro-batch 1 x accumulation 2: the same global batches, split differently.
    one = tmp_path / "one"
    expected = train(load_train_config(REPO / "configs/train/demo.yaml",
                                       train_overrides(demo_data, one, *UNCLIPPED))).losses
    run_ranks("train_worker.py", 2, str(demo_data), str(tmp_path / "dp"), "none",
              "train.micro_batch_size=1", *UNCLIPPED)
    assert losses(tmp_path / "dp", 3) == pytest.approx(expected, rel=RTOL)
    step = "checkpoints/step_0000003"
    assert_close_states(tmp_path / "dp" / step, one / step, rtol=1e-4)


def test_tensor_parallel_matches_one_process(demo_data, tmp_path, reference):
    run_ranks("train_worker.py", 2, str(demo_data), str(tmp_path), "none",
              "model.parallel.tensor_parallel_size=2")
    assert losses(tmp_path) == pytest.approx(reference, rel=RTOL)


def test_tp2_checkpoint_resumes_at_tp1(demo_data, tmp_path, reference):
    run_ranks("train_worker.py", 2, str(demo_data), str(tmp_path), "3", "model.parallel.tensor_parallel_size=2")
    first = losses(tmp_path, 3)
    cfg = load_train_config(REPO / "configs/train/demo.yaml", train_overrides(demo_data, tmp_path))
    second = train(cfg).losses
    assert first + second == pytest.approx(reference, rel=RTOL)


def test_tp1_checkpoint_resumes_at_tp2(demo_data, tmp_path, reference):
    cfg = load_train_config(REPO / "configs/train/demo.yaml", train_overrides(demo_data, tmp_path))
    first = train(cfg, stop_at_step=3).losses
    run_ranks("train_worker.py", 2, str(demo_data), str(tmp_path), "none", "model.parallel.tensor_parallel_size=2")
    assert first + losses(tmp_path) == pytest.approx(reference, rel=RTOL)


def test_sharded_optimizer_checkpoint_resumes_at_dp1(demo_data, tmp_path, reference):
    """ZeRO-1 at DP=2 (each rank owns half the Adam state) -> one process, and the reverse."""
    run_ranks("train_worker.py", 2, str(demo_data), str(tmp_path), "3", "train.micro_batch_size=1")
    first = losses(tmp_path, 3)
    cfg = load_train_config(REPO / "configs/train/demo.yaml", train_overrides(demo_data, tmp_path))
    assert first + train(cfg).losses == pytest.approx(reference, rel=RTOL)


def test_dp1_checkpoint_resumes_with_a_sharded_optimizer(demo_data, tmp_path, reference):
    cfg = load_train_config(REPO / "configs/train/demo.yaml", train_overrides(demo_data, tmp_path))
    first = train(cfg, stop_at_step=3).losses
    run_ranks("train_worker.py", 2, str(demo_data), str(tmp_path), "none", "train.micro_batch_size=1")
    assert first + losses(tmp_path) == pytest.approx(reference, rel=RTOL)
