"""The distributed optimizer (``optim.distributed_optimizer``, train/dist_optim.py): Megatron's
mixed precision, fp32 main weights, Adam moments and EMA kept by rows evenly over data-parallel
ranks, checked against the default optimizer, across layouts, and across kill -9 and resume.

- fp32 weights: the main weights are views of the weights, so one process runs the default
  optimizer's step bit for bit (weights, moments, EMA, torch's RNG: ``torch.equal``), and a
  checkpoint of the default optimizer (an old checkpoint) resumes to its exact losses and state.
- bf16 weights (Megatron's mixed precision): 1 rank against 2 ranks (gloo) on the losses, the
  gradient norms and the whole fp32 state, each rank keeping half the rows of every weight and
  receiving their gradients by a reduce-scatter (no gradient all-reduced); a
  DP=2 checkpoint resumed on one process; and a run killed with SIGKILL and resumed ends in the
  uninterrupted run's state bit for bit.

Tolerances (bf16, 1 rank vs 2): the two layouts run different micro-batches (2 x 1 context against
1 x 2), so bf16 matmuls round differently, not only the fp32 reduction order. The losses agree
within 2e-3 relative (the gradient norms within 1e-2); the state, relative to each tensor's largest
value, measured at step 6: weights 3.5e-2 (the embedding: Adam turns a rounding difference of a
rarely seen row's gradient into an update of up to lr), Adam moments 1.4e-2, EMA 8e-4; we allow
5e-2. A DP gradient off by a factor of 2 moves the first moments x2 and the second x4.
Python's and numpy's RNG are not seeded by the trainer, so two independent runs differ there; a
resumed run restores them and is compared on them too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_faults import wait_for_the_run_lock
from checkpoint_states import assert_close_states, assert_same_state
from conftest import REPO, train_overrides
from distributed import run_ranks
from polling import wait_for

from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.loop import train
from mimir_megatron.train.tracking import metric_name

pytestmark = pytest.mark.multiprocess
DEMO = REPO / "configs" / "train" / "demo.yaml"
UNCLIPPED = ("optim.clip_grad=0",)
ROWS = ("optim.distributed_optimizer=true",)
BF16 = (*ROWS, "model.params_dtype=bfloat16", *UNCLIPPED)
DATA_PARALLEL = ("train.micro_batch_size=1",)
UNSEEDED = ("rng.numpy", "rng.python")  # the trainer does not seed them: independent runs differ
BF16_RTOL, BF16_STATE_RTOL = 2e-3, 5e-2
STEP_3, STEP_6 = "checkpoints/step_0000003", "checkpoints/step_0000006"


def run(demo_data: Path, run_dir: Path, *extra: str):
    return train(load_train_config(DEMO, train_overrides(demo_data, run_dir, *extra)))


def grad_norms(run_dir: Path) -> list[float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    (found,) = client.search_runs([client.get_experiment_by_name("mimir-demo").experiment_id])
    return [m.value for m in sorted(client.get_metric_history(found.info.run_id, metric_name("grad_norm")),
                                    key=lambda m: m.step)]


@pytest.fixture(scope="module")
def one_bf16(demo_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one_bf16")
    return run_dir, run(demo_data, run_dir, *BF16).losses


@pytest.fixture(scope="module")
def two_bf16(demo_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two_bf16")
    run_ranks("numerics_worker.py", 2, str(demo_data), str(run_dir), *BF16, *DATA_PARALLEL)
    return run_dir, json.loads((run_dir / "losses.json").read_text())


def test_fp32_rows_run_the_default_step_bit_for_bit(demo_data, tmp_path, reference_run):
    ref_dir, ref = reference_run
    result = run(demo_data, tmp_path / "rows", *ROWS)
    assert result.losses == ref.losses
    for step in (STEP_3, STEP_6):
        assert_same_state(tmp_path / "rows" / step, ref_dir / step, ignore=UNSEEDED)


def test_a_default_optimizer_checkpoint_resumes_bit_for_bit(demo_data, tmp_path, reference_run):
    """A checkpoint written by the plain optimizer (as every checkpoint before this one was)."""
    ref_dir, ref = reference_run
    resumed = run(demo_data, tmp_path, *ROWS, f"checkpoint.resume={ref_dir / STEP_3}")
    assert resumed.losses == ref.losses[3:]
    assert_same_state(tmp_path / STEP_6, ref_dir / STEP_6)


def test_bf16_on_two_ranks_matches_one_process(one_bf16, two_bf16):
    (one_dir, one), (two_dir, two) = one_bf16, two_bf16
    assert len(one) == 6 and two == pytest.approx(one, rel=BF16_RTOL)
    norms = grad_norms(one_dir)
    assert len(norms) == 6 and grad_norms(two_dir) == pytest.approx(norms, rel=BF16_RTOL * 5)
    for step in (STEP_3, STEP_6):
        assert_close_states(two_dir / step, one_dir / step, rtol=BF16_STATE_RTOL)


def test_bf16_stays_near_fp32(one_bf16, reference_run, demo_data, tmp_path):
    fp32 = run(demo_data, tmp_path, *UNCLIPPED).losses
    assert one_bf16[1] == pytest.approx(fp32, rel=1e-2)


def test_each_rank_keeps_half_the_rows_of_every_weight_in_fp32(two_bf16):
    run_dir, _ = two_bf16
    shards = [json.loads((run_dir / f"shard_rank{r}.json").read_text()) for r in (0, 1)]
    assert shards[0]["rows"].keys() == shards[1]["rows"].keys() and len(shards[0]["rows"]) == 10
    total = 0
    for name, (start, stop, rows, row_size) in shards[0]["rows"].items():
        assert (start, stop) == (0, rows // 2), name
        assert shards[1]["rows"][name][:2] == [rows // 2, rows], name
        total += rows * row_size
    for shard in shards:
        assert shard["param_dtype"] == ["torch.bfloat16"] and shard["main_dtype"] == ["torch.float32"]
        assert shard["state_elements"] == total // 2  # moments of its rows only: exactly half


def test_gradients_are_reduce_scattered_not_all_reduced(two_bf16):
    """Each weight's fp32 gradient goes to the rank keeping its rows (one reduce-scatter a weight,
    the whole buffer in all), and no all-reduce carries gradients (the largest is of scalars)."""
    run_dir, _ = two_bf16
    for r in (0, 1):
        shard = json.loads((run_dir / f"shard_rank{r}.json").read_text())
        sizes = sorted(rows * row_size for _, _, rows, row_size in shard["rows"].values())
        assert sorted(shard["comm"]["reduce_scatter"]) == sizes
        assert shard["comm"]["all_reduce_max"] < sizes[0]


def test_the_reduce_scatter_sums_each_ranks_rows_even_or_not():
    """Two ranks, a weight whose rows split evenly and one whose rows do not
    (tests/workers/reduce_scatter_worker.py checks the sums, the norm and clipping by hand)."""
    run_ranks("reduce_scatter_worker.py", 2, timeout=120)


def test_a_dp2_checkpoint_resumes_on_one_process(demo_data, tmp_path, one_bf16, two_bf16):
    resumed = run(demo_data, tmp_path, *BF16, f"checkpoint.resume={two_bf16[0] / STEP_3}")
    assert resumed.losses == pytest.approx(one_bf16[1][3:], rel=BF16_RTOL)


def test_a_dp2_run_resumes_on_two_ranks_bit_for_bit(demo_data, tmp_path, two_bf16):
    run_ranks("train_worker.py", 2, str(demo_data), str(tmp_path), "none", *BF16, *DATA_PARALLEL,
              f"checkpoint.resume={two_bf16[0] / STEP_3}")
    assert json.loads((tmp_path / "losses_6.json").read_text()) == two_bf16[1][3:]
    assert_same_state(tmp_path / STEP_6, two_bf16[0] / STEP_6)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_bf16_run_resumes_to_the_uninterrupted_state(demo_data, tmp_path, one_bf16):
    """SIGKILL once step 4 is logged (after step 3's checkpoint), then resume to the end."""
    run_dir, log_path = tmp_path / "killed", tmp_path / "attempt.log"
    cmd = [sys.executable, "-m", "mimir_megatron.cli", "train", "--config", str(DEMO),
           *train_overrides(demo_data, run_dir, *BF16, "train.log_interval=1")]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "step 4/6 loss" in log_path.read_text() or proc.poll() is not None, timeout=600,
                 what="step 4 of the run to be killed")
        assert proc.poll() is None, log_path.read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    wait_for_the_run_lock(run_dir)
    assert not (run_dir / STEP_6).exists()
    resumed = run(demo_data, run_dir, *BF16, "train.log_interval=1")
    assert resumed.losses == one_bf16[1][len(one_bf16[1]) - len(resumed.losses):]
    assert_same_state(run_dir / STEP_6, one_bf16[0] / STEP_6, ignore=UNSEEDED)  # another process


def test_a_dp2_bf16_checkpoint_loads_for_inference_with_its_fp32_weights(two_bf16):
    """`load_model` (export, serving, evaluation) reads the fp32 main weights the rows hold, and
    the EMA: the checkpoint records fp32 weights whatever the run's parameters were."""
    import torch
    from checkpoint_states import checkpoint_state

    from mimir_megatron import load_model, parallel
    from mimir_megatron.checkpoint import read_trainer_state

    parallel.init_distributed()  # the checkpoint readers are collective (a one-rank group here)
    path = two_bf16[0] / STEP_6
    assert read_trainer_state(path).model["params_dtype"] == "float32"
    saved = checkpoint_state(path)
    weights = dict(load_model(path).named_parameters())
    ema = dict(load_model(path, ema=True).named_parameters())
    assert {w.dtype for w in weights.values()} == {torch.float32}
    for name in ("embedding.weight", "head.weight"):
        assert torch.equal(weights[name], saved[name])
        assert torch.equal(ema[name], saved[f"ema.{name}"])
