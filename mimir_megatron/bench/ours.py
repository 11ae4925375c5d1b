"""Our model, timed through the trainer's own :func:`~mimir_megatron.train.step.train_step`:
megatron DDP buffers, the per-module optimizer groups and learning rates, clipping, the EMA and
the step's one host synchronisation, exactly as `mimir train` runs them."""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def bench_ours(name: str, cfg: ModelConfig, setup: BenchSetup, weights: SharedWeights) -> list[BenchResult]:
    from mimir_megatron.train.config import OptimSection, TrainConfig, WindowSection
    from mimir_megatron.train.flops import flops_per_token
    from mimir_megatron.train.schedules import plan_step
    from mimir_megatron.train.step import build_trainer, train_step

    s = setup.step
    optim = OptimSection(optimizer=s.optimizer, lr=s.lr, warmup_steps=0, clip_grad=s.clip_grad,
                         ema_decay=s.ema_decay, shard_state=False)
    if setup.precision == "bf16" and setup.device.type == "cpu":
        error = ValueError("the trainer computes in bf16 on GPU only (train.precision); use --precision auto")
        return [failed(name, error, setup.device, k) for k in setup.windows]
    release(setup.device)
    try:
        trainer = build_trainer(weights.model(cfg, setup.device), optim, device=setup.device,
                                precision=setup.precision)
    except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
        return [failed(name, exc, setup.device, k) for k in setup.windows]
    model = trainer.model
    settings = {"attention": model.attention_backend, "layers": model.layer_backend,
                "fp8": str(cfg.execution.fp8), "compile": cfg.execution.compile,
                "recompute": str(cfg.execution.recompute),
                "loss_chunk_tokens": cfg.execution.loss_chunk_tokens, "optimizer": s.optimizer,
                "clip_grad": s.clip_grad, "ema_decay": s.ema_decay}

    def measure(k: int) -> BenchResult:
        train_cfg = TrainConfig(model=cfg, window=WindowSection(schedule="constant", k=k), optim=optim)
        plan = plan_step(0, train_cfg)
        batches = [setup.batch]

        def step() -> None:
            train_step(trainer, batches, plan, step=0)

        times = time_steps(step, setup.warmup, setup.steps, setup.device)
        w = plan.window
        fpt = flops_per_token(cfg, w.k_L, w.k_H, setup.seq_len, attended_keys=setup.attended_keys)
        return result(name, times, setup, fpt, w.describe(), settings, k)

    return list(measure_windows(name, setup, measure))
