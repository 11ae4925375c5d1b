"""Pure schedules of the recurrence trainer: the bp window per step and each group's learning rate.

The recurrence scheduler grows the truncated-backprop window k during training; the L and H
learning rates are divided by how often each module is applied inside the window (k_L, k_H), so
they change exactly when the window does. A module absent from the window (k_M = 0) is frozen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mimir_megatron.model.window import WindowPlan, plan_window

GROUPS = ("embedding", "head", "L", "H")


def window_at(step: int, total_steps: int, schedule: str, k: int, k0: int, k1: int,
              ramp_fraction: float) -> int:
    """Window k for optimizer step ``step`` (0-based).

    ``linear`` is the reference trainer's step function: k = k0 + int(progress * (k1 - k0)) with
    progress = step / (ramp_fraction * total_steps), capped at 1. Mimir v1: 2 -> 5 over 20 %.
    """
    if schedule == "constant":
        return k
    if schedule == "linear":
        ramp = max(1.0, ramp_fraction * total_steps)
        progress = min(1.0, step / ramp)
        return k0 + int(progress * (k1 - k0))
    raise ValueError(f"unknown window schedule {schedule!r}")


def base_lr_at(step: int, total_steps: int, lr: float, min_lr: float, warmup_steps: int,
               cooldown: str, cooldown_steps: int) -> float:
    """Peak-relative learning rate: linear warm-up, constant, optional cool-down to a floor.

    Step ``s`` (0-based) of warm-up uses lr * (s + 1) / warmup_steps, so the first update is
    not wasted at lr 0 and step warmup_steps - 1 reaches the peak.
    """
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    start = total_steps - cooldown_steps
    if cooldown == "none" or step < start:
        return lr
    progress = min(1.0, (step - start + 1) / cooldown_steps)
    if cooldown == "linear":
        return lr + (min_lr - lr) * progress
    if cooldown == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown cool-down {cooldown!r}")


@dataclass(frozen=True)
class StepPlan:
    """Everything the schedules decide for one optimizer step."""

    step: int
    window: WindowPlan
    lr: float
    group_lr: dict[str, float]
    """Learning rate per group (0.0 for frozen groups)."""
    frozen: tuple[str, ...]
    """Groups that get no update this step (no weight decay either): L or H when absent from
    the window, the embedding when the window does not reach it."""


def plan_step(step: int, cfg) -> StepPlan:
    """Window and learning rates of step ``step`` for a TrainConfig."""
    w, o, m = cfg.window, cfg.optim, cfg.model
    k = window_at(step, cfg.train.steps, w.schedule, w.k, w.k0, w.k1, w.ramp_fraction)
    plan = plan_window(m.h_cycles, m.l_cycles, k, m.window_policy)
    lr = base_lr_at(step, cfg.train.steps, o.lr, o.min_lr, o.warmup_steps, o.cooldown,
                    o.cooldown_steps)
    divide = o.divide_lr_by_window
    group_lr = {"embedding": lr, "head": lr}
    frozen = [] if plan.reaches_embedding else ["embedding"]
    for name, applications in (("L", plan.k_L), ("H", plan.k_H)):
        if applications == 0:
            frozen.append(name)
        group_lr[name] = lr / applications if divide and applications else lr
    for name in frozen:
        group_lr[name] = 0.0
    return StepPlan(step=step, window=plan, lr=lr, group_lr=group_lr, frozen=tuple(frozen))
