"""Data- and tensor-parallel training against one process, ZeRO-1 shards, and checkpoints that
change layout on resume.

Every run here has clipping off: with clipping on every step and Adam cancelling a constant
factor, neither the losses nor the Adam moments of a run whose parallel gradients are off by a
factor would differ. So each 2-rank run is compared with one process on its losses, on the
gradient norms the trainer logs to MLflow (the norm clipping would use), and, for data
parallelism, on the whole state (weights, EMA, Adam moments). ZeRO-1 is checked by what each
rank owns: disjoint halves of the parameters, with Adam state for those only.

A 2-rank launch costs ~10 s of process start-up, so each layout runs once (6 steps, checkpoints
at 3 and 6) and serves several tests; a layout change is a resume of another run's step-3
checkpoint (`checkpoint.resume`), whose steps 4-6 must be the one-process run's.

Tolerance: DP and TP change only the order of fp32 reductions, so losses agree to ~1e-6
relative; we allow 2e-5 over six steps. The whole state is compared relative to each tensor's
largest value, at 1e-3: Adam divides each gradient by its own root mean square, so an embedding
row of a token seen once or twice turns a rounding difference of its gradient into a
weight difference of up to lr; measured 2.4e-4 (embedding, step 6) on one Xeon, under 1e-4 on
another. A DP gradient off by a factor moves the second moments by its square (x4 for a factor of
2), far outside that; the logged gradient norms above catch it too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from checkpoint_states import assert_close_states
from conftest import REPO, train_overrides
from distributed import run_ranks

from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.loop import train
from mimir_megatron.train.tracking import metric_name

pytestmark = pytest.mark.multiprocess
RTOL = 2e-5
STATE_RTOL = 1e-3
UNCLIPPED = ("optim.clip_grad=0",)  # 6 steps, checkpoints at 3 and 6 (train_overrides)
DATA_PARALLEL = ("train.micro_batch_size=1",)  # DP=2 x micro-batch 1 x accumulation 2: the same global batches
TENSOR_PARALLEL = ("model.parallel.tensor_parallel_size=2",)
STEP_3, STEP_6 = "checkpoints/step_0000003", "checkpoints/step_0000006"


@dataclass(frozen=True)
class Run:
    run_dir: Path
    losses: list[float]
    grad_norms: list[float]


def grad_norms(run_dir: Path) -> list[float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("mimir-demo").experiment_id])
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, metric_name("grad_norm")),
                                    key=lambda m: m.step)]


def two_ranks(demo_data: Path, run_dir: Path, *overrides: str) -> Run:
    """A 2-rank run of tests/workers/numerics_worker.py (losses, ZeRO-1 shards, MLflow)."""
    run_ranks("numerics_worker.py", 2, str(demo_data), str(run_dir), *UNCLIPPED, *overrides)
    return Run(run_dir, json.loads((run_dir / "losses.json").read_text()), grad_norms(run_dir))


def resumed_in_one_process(demo_data: Path, checkpoint: Path, run_dir: Path) -> list[float]:
    cfg = load_train_config(REPO / "configs/train/demo.yaml",
                            train_overrides(demo_data, run_dir, *UNCLIPPED, f"checkpoint.resume={checkpoint}"))
    return train(cfg).losses


def resumed_on_two_ranks(demo_data: Path, checkpoint: Path, run_dir: Path, *overrides: str) -> list[float]:
    run_ranks("train_worker.py", 2, str(demo_data), str(run_dir), "none", *UNCLIPPED,
              f"checkpoint.resume={checkpoint}", *overrides)
    return json.loads((run_dir / "losses_6.json").read_text())


@pytest.fixture(scope="module")
def one_process(demo_data, tmp_path_factory) -> Run:
    """One process, micro-batch 2 x accumulation 2 = global batch 4."""
    run_dir = tmp_path_factory.mktemp("one")
    result = train(load_train_config(REPO / "configs/train/demo.yaml",
                                     train_overrides(demo_data, run_dir, *UNCLIPPED)))
    return Run(run_dir, result.losses, grad_norms(run_dir))


@pytest.fixture(scope="module")
def data_parallel(demo_data, tmp_path_factory) -> Run:
    return two_ranks(demo_data, tmp_path_factory.mktemp("dp"), *DATA_PARALLEL)


@pytest.fixture(scope="module")
def tensor_parallel(demo_data, tmp_path_factory) -> Run:
    return two_ranks(demo_data, tmp_path_factory.mktemp("tp"), *TENSOR_PARALLEL)


def test_data_parallel_matches_one_process(data_parallel, one_process):
    assert len(one_process.losses) == len(one_process.grad_norms) == 6
    assert data_parallel.losses == pytest.approx(one_process.losses, rel=RTOL)
    assert data_parallel.grad_norms == pytest.approx(one_process.grad_norms, rel=RTOL)
    for step in (STEP_3, STEP_6):
        assert_close_states(data_parallel.run_dir / step, one_process.run_dir / step, rtol=STATE_RTOL)


def test_zero1_gives_each_rank_the_adam_state_of_half_the_parameters(data_parallel):
    shards = [json.loads((data_parallel.run_dir / f"shard_rank{r}.json").read_text()) for r in (0, 1)]
    everything = shards[0]["all"]
    owned = [set(s["owned"]) for s in shards]
    assert not owned[0] & owned[1], "a parameter's Adam state is on both ranks"
    assert owned[0] | owned[1] == set(everything)
    sizes = [sum(everything[k] for k in o) for o in owned]
    total, largest = sum(everything.values()), max(everything.values())
    assert abs(sizes[0] - sizes[1]) <= largest, f"unbalanced shards {sizes} of {total}"
    for shard, size in zip(shards, sizes):
        assert shard["state_elements"] == size  # moments of the owned parameters only


def test_tensor_parallel_matches_one_process(tensor_parallel, one_process):
    assert tensor_parallel.losses == pytest.approx(one_process.losses, rel=RTOL)
    assert tensor_parallel.grad_norms == pytest.approx(one_process.grad_norms, rel=RTOL)


def test_tp2_checkpoint_resumes_at_tp1(demo_data, tmp_path, tensor_parallel, one_process):
    resumed = resumed_in_one_process(demo_data, tensor_parallel.run_dir / STEP_3, tmp_path)
    assert resumed == pytest.approx(one_process.losses[3:], rel=RTOL)


def test_sharded_optimizer_checkpoint_resumes_at_dp1(demo_data, tmp_path, data_parallel, one_process):
    """ZeRO-1 at DP=2 (each rank owns half the Adam state) -> one process."""
    resumed = resumed_in_one_process(demo_data, data_parallel.run_dir / STEP_3, tmp_path)
    assert resumed == pytest.approx(one_process.losses[3:], rel=RTOL)


def test_tp1_checkpoint_resumes_at_tp2(demo_data, tmp_path, one_process):
    resumed = resumed_on_two_ranks(demo_data, one_process.run_dir / STEP_3, tmp_path, *TENSOR_PARALLEL)
    assert resumed == pytest.approx(one_process.losses[3:], rel=RTOL)


def test_dp1_checkpoint_resumes_with_a_sharded_optimizer(demo_data, tmp_path, one_process):
    resumed = resumed_on_two_ranks(demo_data, one_process.run_dir / STEP_3, tmp_path, *DATA_PARALLEL)
    assert resumed == pytest.approx(one_process.losses[3:], rel=RTOL)


@pytest.mark.parametrize("layout", ["data_parallel", "tensor_parallel"])
def test_the_data_lineage_is_the_one_process_runs(layout, one_process, request):
    """Counted per rank, summed over data-parallel ranks only (TP peers see the same batches)."""
    from mimir_megatron.checkpoint import read_trainer_state

    run = request.getfixturevalue(layout)
    for step in (STEP_3, STEP_6):
        got, want = (read_trainer_state(r.run_dir / step).lineage for r in (run, one_process))
        assert sum(e.tokens for e in want) > 0 and got == want
