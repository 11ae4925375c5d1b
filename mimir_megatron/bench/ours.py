"""Our model, timed through the trainer's own :func:`~mimir_megatron.train.step.train_step`:
megatron DDP buffers, the per-module optimizer groups and learning rates, clipping, the EMA and
the step's one host synchronisation, exactly as `mimir train` runs them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mimir_megatron.bench.measure import (
    BenchResult,
    BenchSetup,
    SharedWeights,
    failed,
    measure_windows,
    release,
    result,
    time_steps,
)

if TYPE_CHECKING:
    from mimir_megatron.config import ModelConfig
    from mimir_megatron.model.window import WindowPlan


StepFor = Callable[[int], tuple[Callable[[], None], "WindowPlan"]]
"""``step_for(k)``: one training step with window k, as a callable, and the window's plan."""


def our_steps(cfg: ModelConfig, setup: BenchSetup, weights: SharedWeights) -> tuple[StepFor, dict[str, Any]]:
    """The trainer on ``setup``'s batch: ``(step_for, settings)``. Raises what building it raises."""
    from mimir_megatron.train.config import OptimSection, TrainConfig, WindowSection
    from mimir_megatron.train.schedules import plan_step
    from mimir_megatron.train.step import build_trainer, train_step

    s = setup.step
    optim = OptimSection(optimizer=s.optimizer, lr=s.lr, warmup_steps=0, clip_grad=s.clip_grad,
                         ema_decay=s.ema_decay, shard_state=False)
    if setup.precision == "bf16" and setup.device.type == "cpu":
        raise ValueError("the trainer computes in bf16 on GPU only (train.precision); use --precision auto")
    release(setup.device)
    trainer = build_trainer(weights.model(cfg, setup.device), optim, device=setup.device,
                            precision=setup.precision)
    model = trainer.model
    settings = {"attention": model.attention_backend, "layers": model.layer_backend,
                "fp8": str(cfg.execution.fp8), "compile": cfg.execution.compile,
                "recompute": str(cfg.execution.recompute),
                "loss_chunk_tokens": cfg.execution.loss_chunk_tokens, "optimizer": s.optimizer,
                "clip_grad": s.clip_grad, "ema_decay": s.ema_decay}
    batches = [setup.batch]

    def step_for(k: int):
        window = WindowSection(schedule="constant", k=k)
        plan = plan_step(0, TrainConfig(model=cfg, window=window, optim=optim))

        def step() -> None:
            train_step(trainer, batches, plan, step=0)

        return step, plan.window

    return step_for, settings


def planned_peak_gb(cfg: ModelConfig, setup: BenchSetup, k_L: int, k_H: int) -> float:
    """`mimir plan`'s peak memory of the step measured (GB, 1e9 bytes): one process, the bench's
    micro-batch, the step's optimizer settings and precision."""
    from mimir_megatron import backend
    from mimir_megatron.data.config import DataConfig
    from mimir_megatron.train.config import OptimSection, TrainConfig, TrainSection
    from mimir_megatron.train.plan.layouts import one_process_step
    from mimir_megatron.train.plan.memory import GB

    rows = setup.tokens // setup.seq_len
    section = TrainSection(global_batch_size=rows, micro_batch_size=rows, precision=setup.precision)
    train = TrainConfig(model=cfg, data=DataConfig(seq_len=setup.seq_len), train=section,
                        optim=OptimSection(ema_decay=setup.step.ema_decay, shard_state=False))
    return one_process_step(train, rows, k_L, k_H, on_gpu=backend.has_gpu()).peak / GB


def bench_ours(name: str, cfg: ModelConfig, setup: BenchSetup, weights: SharedWeights) -> list[BenchResult]:
    from mimir_megatron.train.flops import flops_per_token

    try:
        step_for, settings = our_steps(cfg, setup, weights)
    except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
        return [failed(name, exc, setup.device, k) for k in setup.windows]

    def measure(k: int) -> BenchResult:
        step, w = step_for(k)
        times = time_steps(step, setup.warmup, setup.steps, setup.device)
        fpt = flops_per_token(cfg, w.k_L, w.k_H, setup.seq_len, attended_keys=setup.attended_keys)
        measured = result(name, times, setup, fpt, w.describe(), settings, k)
        measured.planned_peak_memory_gb = planned_peak_gb(cfg, setup, w.k_L, w.k_H)
        return measured

    return list(measure_windows(name, setup, measure))
