"""Data- and tensor-parallel training against one process, with clipping off, and ZeRO-1 shards.

With clipping on every step and Adam cancelling a constant gradient factor, the losses of a run
whose data-parallel gradients are off by a factor still match; the gradient norm does not. So
the norms (the trainer's own, from MLflow) are compared with one process, clipping off. ZeRO-1 is
checked by what each rank owns: disjoint halves of the parameters, with Adam state for those only.
Tolerance as in test_train_parallel: only the order of fp32 reductions differs.
"""

import json

import pytest
from conftest import REPO, train_overrides
from distributed import run_ranks

from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.loop import train

pytestmark = pytest.mark.multiprocess
RTOL = 2e-5
SHORT = ("train.steps=3", "optim.clip_grad=0", "checkpoint.interval=100")


def grad_norms(run_dir) -> list[float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("mimir-demo").experiment_id])
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, "grad_norm"),
                                    key=lambda m: m.step)]


@pytest.fixture(scope="module")
def reference(demo_data, tmp_path_factory):
    """One process, micro-batch 2 x accumulation 2 = global batch 4."""
    run_dir = tmp_path_factory.mktemp("ref")
    losses = train(load_train_config(REPO / "configs/train/demo.yaml",
                                     train_overrides(demo_data, run_dir, *SHORT))).losses
    return losses, grad_norms(run_dir)


def test_data_parallel_grad_norms_and_zero1_shards(demo_data, tmp_path, reference):
    # DP=2, micro-batch 1 x accumulation 2: the same global batches, split over two ranks.
    run_ranks("numerics_worker.py", 2, str(demo_data), str(tmp_path), *SHORT, "train.micro_batch_size=1")
    losses, norms = reference
    assert json.loads((tmp_path / "losses.json").read_text()) == pytest.approx(losses, rel=RTOL)
    assert grad_norms(tmp_path) == pytest.approx(norms, rel=RTOL)

    shards = [json.loads((tmp_path / f"shard_rank{r}.json").read_text()) for r in (0, 1)]
    everything = shards[0]["all"]
    owned = [set(s["owned"]) for s in shards]
    assert not owned[0] & owned[1], "a parameter's Adam state is on both ranks"
    assert owned[0] | owned[1] == set(everything)
    sizes = [sum(everything[k] for k in o) for o in owned]
    total, largest = sum(everything.values()), max(everything.values())
    assert abs(sizes[0] - sizes[1]) <= largest, f"unbalanced shards {sizes} of {total}"
    for shard, size in zip(shards, sizes):
        assert shard["state_elements"] == size  # moments of the owned parameters only


def test_tensor_parallel_grad_norms(demo_data, tmp_path, reference):
    run_ranks("numerics_worker.py", 2, str(demo_data), str(tmp_path), *SHORT, "model.parallel.tensor_parallel_size=2")
    losses, norms = reference
    assert json.loads((tmp_path / "losses.json").read_text()) == pytest.approx(losses, rel=RTOL)
    assert grad_norms(tmp_path) == pytest.approx(norms, rel=RTOL)
