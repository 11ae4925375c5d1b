"""Window and learning-rate schedules against hand-computed values."""

import math

import pytest
from conftest import REPO

from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.schedules import base_lr_at, plan_step, window_at


def test_v1_window_ramp_is_the_reference_step_function():
    # 2 -> 5 over the first 20 % of 100 steps: k = 2 + int(step / 20 * 3)
    ks = [window_at(s, 100, "linear", 0, 2, 5, 0.2) for s in range(100)]
    assert ks[:7] == [2] * 7          # 6/20*3 = 0.9
    assert ks[7:14] == [3] * 7        # 7/20*3 = 1.05 ... 13/20*3 = 1.95
    assert ks[14:20] == [4] * 6       # 14/20*3 = 2.1 ... 19/20*3 = 2.85
    assert ks[20:] == [5] * 80


def test_a_linear_window_without_a_ramp_fraction_grows_over_the_papers_20_percent(tmp_path):
    """The default itself: every shipped recipe sets window.ramp_fraction, so only a config that
    leaves it out shows the default (Mimir v1: k 2 -> 5 over the first 20 % of the steps)."""
    import yaml

    recipe = yaml.safe_load((REPO / "configs/train/demo.yaml").read_text())
    del recipe["window"]["ramp_fraction"]
    recipe["model"]["config"] = str(REPO / recipe["model"]["config"])
    (tmp_path / "no_ramp.yaml").write_text(yaml.safe_dump(recipe))
    cfg = load_train_config(tmp_path / "no_ramp.yaml", ["train.steps=300"])
    ks = [plan_step(s, cfg).window.k for s in range(300)]
    # 20 % of 300 steps = 60: k = 2 + int(step / 60 * 3)
    assert ks[:20] == [2] * 20 and ks[20:40] == [3] * 20 and ks[40:60] == [4] * 20 and ks[60:] == [5] * 240


def test_v1_5_window_ramp_reaches_full_backprop():
    ks = [window_at(s, 1000, "linear", 0, 5, 8, 0.1) for s in (0, 33, 34, 67, 99, 100, 999)]
    assert ks == [5, 5, 6, 7, 7, 8, 8]


def test_constant_window():
    assert {window_at(s, 10, "constant", 4, 2, 5, 0.2) for s in range(10)} == {4}


def test_warmup_constant_cooldown():
    lr = lambda s, c="none", n=0: base_lr_at(s, 100, 3e-4, 3e-5, 10, c, n)  # noqa: E731
    assert lr(0) == pytest.approx(3e-5)       # (0 + 1) / 10 of the peak
    assert lr(9) == pytest.approx(3e-4)
    assert lr(50) == lr(99) == 3e-4
    assert lr(79, "linear", 20) == 3e-4       # cool-down starts at step 80
    assert lr(80, "linear", 20) == pytest.approx(3e-4 + (3e-5 - 3e-4) * 1 / 20)
    assert lr(99, "linear", 20) == pytest.approx(3e-5)
    assert lr(89, "cosine", 20) == pytest.approx(3e-5 + 2.7e-4 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr(99, "cosine", 20) == pytest.approx(3e-5)


@pytest.fixture(scope="module")
def v1():
    return load_train_config(
        REPO / "configs/train/demo.yaml",
        ["optim.warmup_steps=0", "optim.cooldown=none", "optim.lr=3e-4", "window.schedule=constant",
         "train.steps=100"],
    )


@pytest.mark.parametrize(
    "k,eta_L,eta_H,frozen",
    # The paper's examples (last-k): k=2 LH: both eta; k=4 LLLH: eta_L = eta/3, eta_H = eta;
    # k=5 HLLLH: eta_H = eta/2, eta_L = eta/3; k=8: eta_H = eta/2, eta_L = eta/6.
    [(2, 1, 1, ("embedding",)), (4, 1 / 3, 1, ("embedding",)), (5, 1 / 3, 1 / 2, ()),
     (8, 1 / 6, 1 / 2, ()), (1, 0, 1, ("embedding", "L"))],
)
def test_group_learning_rates_follow_the_window(v1, k, eta_L, eta_H, frozen):
    v1.window.k = k
    plan = plan_step(50, v1)
    assert plan.group_lr["embedding"] == (0.0 if "embedding" in frozen else 3e-4)
    assert plan.group_lr["head"] == 3e-4
    assert plan.group_lr["L"] == pytest.approx(3e-4 * eta_L)
    assert plan.group_lr["H"] == pytest.approx(3e-4 * eta_H)
    assert plan.frozen == frozen


def test_h_first_window_reaches_the_embedding(v1):
    v1.window.k = 3
    v1.model.window_policy = "h_first"
    try:
        plan = plan_step(0, v1)
    finally:
        v1.model.window_policy = "last_k"
    assert plan.window.describe() == "lllHllLH"
    assert plan.frozen == ()
    assert plan.group_lr["L"] == pytest.approx(3e-4) and plan.group_lr["H"] == pytest.approx(1.5e-4)


def test_learning_rates_change_exactly_when_the_window_does(v1):
    v1.window.schedule, v1.window.k0, v1.window.k1, v1.window.ramp_fraction = "linear", 2, 5, 0.2
    plans = [plan_step(s, v1) for s in range(30)]
    for before, after in zip(plans, plans[1:]):
        same_window = before.window == after.window
        assert (before.group_lr == after.group_lr) == same_window
