"""The shipped recipes say what the paper says (/work/shared/reference/hrm-text.md, Table 10).

Mimir v1: window 2 -> 5 over the first 20 % of the steps, LR 3e-4 after a 2,000-step linear
warm-up then constant, EMA 0.9999, 262,144 tokens per global batch. v1.5 continues from v1 with
window 5 -> 8 and ends with a cool-down to 3e-5. Checked through the schedules the trainer uses
(plan_step), so a recipe value and its meaning are both pinned.
"""

from __future__ import annotations

import pytest
from conftest import REPO

from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.schedules import plan_step

TOKENS_PER_BATCH = 262_144


def recipe(name: str):
    return load_train_config(REPO / "configs" / "train" / f"{name}.yaml",
                             ["data.mixture=" + str(REPO / "configs/data/demo.yaml")])


def window(cfg, step: int) -> int:
    return plan_step(step, cfg).window.k


def test_v1_window_grows_from_2_to_5_over_the_first_20_percent():
    cfg = recipe("mimir_v1")
    steps = cfg.train.steps
    ramp_end = round(0.2 * steps)
    assert window(cfg, 0) == 2
    assert window(cfg, ramp_end - 1) == 4 and window(cfg, ramp_end) == 5  # reaches 5 at 20 %, not later
    assert window(cfg, steps - 1) == 5
    # The reference's step function k = 2 + int(progress * 3): k = 3 from a third of the ramp.
    assert window(cfg, ramp_end // 3 - 1) == 2 and window(cfg, ramp_end // 3 + 1) == 3


def test_v1_learning_rate_warms_up_over_2000_steps_then_stays_at_3e_4():
    cfg = recipe("mimir_v1")
    steps = (0, 999, 1999, 2000, cfg.train.steps // 2, cfg.train.steps - 1)
    lr = [plan_step(s, cfg).lr for s in steps]  # warm-up step s uses 3e-4 * (s + 1) / 2000
    assert lr == pytest.approx([3e-4 / 2000, 1.5e-4, 3e-4, 3e-4, 3e-4, 3e-4], rel=1e-9)


@pytest.mark.parametrize("name", ["mimir_v1", "mimir_v1_5"])
def test_ema_and_global_batch(name):
    cfg = recipe(name)
    assert cfg.optim.ema_decay == 0.9999
    assert cfg.train.global_batch_size * cfg.data.seq_len == TOKENS_PER_BATCH


def test_v1_5_window_grows_from_5_to_8_and_cools_down_to_3e_5():
    cfg = recipe("mimir_v1_5")
    steps = cfg.train.steps
    assert window(cfg, 0) == 5 and window(cfg, steps - 1) == 8
    assert plan_step(2000, cfg).lr == pytest.approx(3e-4, rel=1e-9)
    assert plan_step(steps - 1, cfg).lr == pytest.approx(3e-5, rel=1e-3)
    assert plan_step(steps - 1, cfg).lr < plan_step(steps // 2, cfg).lr
