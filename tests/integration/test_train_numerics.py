"""Training numerics: the learning rates the optimizer really applies, non-finite steps, dtypes.

The applied learning rates are read back from the optimizer after every step and, on each
group's first update, recovered from the weight change itself (AdamW's first step moves a weight
by -lr * (wd * w + g / (|g| + eps)) exactly), against a table computed by hand, not by the
schedules under test.
"""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, train_overrides

from mimir_megatron.errors import ConfigError, NonFiniteTraining
from mimir_megatron.train import step as step_module
from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.loop import train
from mimir_megatron.train.optim import local_optimizer
from mimir_megatron.train.step import StepHooks

DEMO = REPO / "configs" / "train" / "demo.yaml"

# train_overrides: 6 steps, lr 3e-3, warm-up 2, window 2 -> 5 over 50 % (k = 2, 3, 4, 5, 5, 5).
# Plus a linear cool-down over the last 2 steps to 3e-4. With last_k over LLLH LLLH:
# k=2 "LH" (k_L 1, k_H 1), k=3 "LLH" (2, 1), k=4 "LLLH" (3, 1), k=5 "HLLLH" (3, 2); the embedding
# is reached only from k=5 (frozen before: lr 0).
SCHEDULE = ("optim.cooldown=linear", "optim.cooldown_steps=2", "optim.min_lr=3e-4", "optim.clip_grad=0")
BASE = [1.5e-3, 3e-3, 3e-3, 3e-3, 1.65e-3, 3e-4]  # warm-up (s+1)/2; cool-down 3e-3 -> 3e-4
K_L_H = [(1, 1), (2, 1), (3, 1), (3, 2), (3, 2), (3, 2)]
EXPECTED_LR = [
    {"embedding": base if k_h == 2 else 0.0, "head": base, "L": base / k_l, "H": base / k_h}
    for base, (k_l, k_h) in zip(BASE, K_L_H)
]
WEIGHT_DECAY, EPS = 0.1, 1e-8  # demo.yaml's weight decay, AdamW's default eps


def run(demo_data, run_dir, *extra, stop_at_step=None, faults=None):
    cfg = load_train_config(DEMO, train_overrides(demo_data, run_dir, *extra))
    return train(cfg, stop_at_step=stop_at_step, hooks=fault_hooks(faults or {}))


def fault_hooks(faults: dict[int, str]) -> StepHooks:
    """``{step: "loss" | "grad"}`` (1-based): that step's loss, or its gradient norm, becomes
    non-finite on every rank."""

    def inject(step: int, loss_sum: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
        if faults.get(step) == "loss":
            loss_sum.fill_(float("nan"))
        elif faults.get(step) == "grad":
            params[0].main_grad.view(-1)[0] = float("inf")

    return StepHooks(after_reduction=inject)


def test_applied_learning_rates_and_first_adam_updates(demo_data, tmp_path, monkeypatch):
    applied: list[dict[str, float]] = []
    first_updates: list[tuple] = []  # (step, group, weight before, change, expected change)
    real_step = step_module.optimizer_step

    def spy(optimizer, plan):
        local = local_optimizer(optimizer)
        step = len(applied)
        before = {}
        for group in local.param_groups:
            for p in group["params"]:
                if local.state[p]["step"].item() == 0 and group["name"] not in plan.frozen:
                    before[p] = (group["name"], p.detach().clone(), p.main_grad.detach().clone())
        real_step(optimizer, plan)
        applied.append({g["name"]: g["lr"] for g in local.param_groups})
        for p, (name, w, g) in before.items():
            lr = EXPECTED_LR[step][name]
            want = -lr * (WEIGHT_DECAY * w + g / (g.abs() + EPS))
            first_updates.append((step, name, w, p.detach() - w, want))

    monkeypatch.setattr(step_module, "optimizer_step", spy)
    run(demo_data, tmp_path, *SCHEDULE, "optim.ema_decay=0", "checkpoint.interval=100")
    assert len(applied) == 6
    for step, (got, want) in enumerate(zip(applied, EXPECTED_LR)):
        assert got == pytest.approx(want, rel=1e-12), f"step {step}"
    assert {(s, n) for s, n, *_ in first_updates} == {(0, "head"), (0, "L"), (0, "H"), (3, "embedding")}
    for step, name, w, got, want in first_updates:
        # fp32 rounding of w + change is ~1 ulp of w; a wrong lr is off by percent, not ulps.
        tolerance = 1e-4 * want.abs() + 4 * torch.finfo(torch.float32).eps * w.abs()
        worst = ((got - want).abs() / tolerance).max().item()
        assert worst <= 1, f"{name} at step {step}: change off by {worst:.1f} x tolerance"


def _full_state(path, cfg) -> dict[str, torch.Tensor]:
    """Weights, EMA and Adam moments (and steps) of a checkpoint, by name."""
    from mimir_megatron.model import build_model
    from mimir_megatron.checkpoint import load_checkpoint
    from mimir_megatron.train.optim import EMA, build_optimizer

    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    ema = EMA(model, cfg.optim.ema_decay)
    load_checkpoint(path, model, optimizer, ema)
    state = {f"weight/{n}": p.detach().clone() for n, p in model.named_parameters()}
    state |= {f"ema/{n}": t.clone() for n, t in ema.shadow.items()}
    for n, p in model.named_parameters():
        slot = optimizer.state[p]
        state |= {f"{key}/{n}": slot[key].clone() for key in ("exp_avg", "exp_avg_sq", "step")}
    return state


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def skipped_run(demo_data, tmp_path_factory):
    """4 steps, a checkpoint after each, step 3's gradient norm made infinite."""
    run_dir = tmp_path_factory.mktemp("skip")
    extra = ("train.steps=4", "checkpoint.interval=1", "checkpoint.keep=10")
    result = run(demo_data, run_dir, *extra, faults={3: "grad"})
    cfg = load_train_config(DEMO, train_overrides(demo_data, run_dir, *extra))
    states = {s: _full_state(run_dir / "checkpoints" / f"step_{s:07d}", cfg) for s in (2, 3, 4)}
    return result, run_dir, states


def test_a_nonfinite_step_is_skipped_whole(skipped_run):
    from mlflow.tracking import MlflowClient

    result, run_dir, states = skipped_run
    assert result.final_step == 4 and not result.preempted
    assert _same(states[2], states[3])       # weights, EMA and Adam state untouched by step 3
    assert not _same(states[3], states[4])   # and training goes on after it
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    skips = [m.value for m in client.get_metric_history(result.run_id, "nonfinite_skip")]
    assert skips == [0, 0, 1, 0]


def test_stop_saves_the_last_good_state_and_fails(demo_data, tmp_path, skipped_run):
    from mlflow.tracking import MlflowClient

    with pytest.raises(NonFiniteTraining, match=r"non-finite step 3: loss nan.*last good state: step 2"):
        run(demo_data, tmp_path, "train.on_nonfinite=stop", "train.steps=4", "checkpoint.interval=5",
            faults={3: "loss"})
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_0000002"
    cfg = load_train_config(DEMO, train_overrides(demo_data, tmp_path, "train.steps=4"))
    # The same two good steps as the skipping run: the saved state is the one before step 3.
    assert _same(_full_state(tmp_path / "checkpoints" / "step_0000002", cfg), skipped_run[2][2])
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("mimir-demo").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]


def test_skips_in_a_row_beyond_the_limit_stop(demo_data, tmp_path):
    with pytest.raises(NonFiniteTraining, match=r"step 3: .*\(2 in a row.*last good state: step 2"):
        run(demo_data, tmp_path, "train.max_nonfinite_skips=1", "train.steps=4", "checkpoint.interval=5",
            faults={2: "grad", 3: "loss"})
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_0000002"


@pytest.mark.parametrize("override,message", [
    ("model.params_dtype=bfloat16", "model.params_dtype=bfloat16 needs optim.distributed_optimizer=true"),
    ("optim.distributed_optimizer=true optim.shard_state=false", "contradicts optim.shard_state=false"),
    ("train.on_nonfinite=ignore", "train.on_nonfinite must be one of skip, stop"),
    ("train.max_nonfinite_skips=-1", "train.max_nonfinite_skips must be >= 0"),
])
def test_refused_at_start_up(demo_data, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(DEMO, train_overrides(demo_data, tmp_path, *override.split()))
