"""Usage: python bench/bench_residual_dtype.py SHAPE STEPS SEQ_LEN MICRO [KEY=VALUE ...]

e.g. `tiny 300 64 2` or `mid 50 64 2` (docs/training.md has the numbers); model overrides
(``key=value``) follow.

The loss curve of bf16 training against fp32 on CPU (issue 39 item 3: the residual stream in
the compute dtype). The same weights, the same batches (a learnable synthetic language: each
token follows from the previous one by a fixed random map, 10 % of tokens random) and the
trainer's own step (``train_step``: megatron DDP's fp32 gradient buffer, the per-module groups,
warm-up, clipping, the EMA) under two variants:

- ``fp32``: fp32 weights, fp32 compute (the reference);
- ``bf16``: bf16 weights with the distributed optimizer (fp32 gradients, main weights and Adam):
  bf16 matmuls and a bf16 residual stream, the norms computing in fp32 (the paper's recipes'
  configs on a GPU).

The bf16 variant differs from fp32 in the matmuls and the residual stream at once, so its
distance from fp32 bounds what the bf16 residual stream costs. (fp32 weights under CPU bf16
autocast, which would separate the two, do not run: megatron's linear layers declare their
autocast for CUDA, and their backward on CPU meets a bf16 gradient and an fp32 weight.)

The bf16 matmuls run as a GPU's tensor cores run them (:class:`TensorCoreMatmuls`: bf16
operands, fp32 sums, one rounding to bf16): torch's own bf16 GEMM on a CPU without bf16
instructions is up to 20x slower than fp32 for the layouts of a linear layer's backward.
``MIMIR_BENCH_NATIVE_BF16=1`` runs torch's CPU bf16 GEMM instead (the losses of a few steps
agree to ~1e-4).

Prints each curve (every 10th step) and, for the bf16 variant against fp32, the relative
difference of the loss per step (|l - l_fp32| / l_fp32): max and mean over all steps and over
the last half, and of the losses averaged over 10 steps.
"""

import contextlib
import os
import statistics
import sys
import time

os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")

from mimir_megatron.process import setup_process  # noqa: E402

setup_process(megatron=True)

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from mimir_megatron import parallel  # noqa: E402
from mimir_megatron.batch import IGNORE_INDEX, Batch  # noqa: E402
from mimir_megatron.bench.measure import SharedWeights  # noqa: E402
from mimir_megatron.bench.shapes import model_config  # noqa: E402
from mimir_megatron.train.config import OptimSection, TrainConfig, WindowSection  # noqa: E402
from mimir_megatron.train.schedules import plan_step  # noqa: E402
from mimir_megatron.train.step import build_trainer, train_step  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

VARIANTS = ("fp32", "bf16")
NOISE = 0.1
EMULATE = os.environ.get("MIMIR_BENCH_NATIVE_BF16") != "1"
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
           torch.ops.aten.baddbmm.default}


class TensorCoreMatmuls(TorchDispatchMode):
    """bf16 matmuls as a GPU's tensor cores run them: bf16 operands, products summed in fp32,
    the result rounded to bf16 once. The same rounding as cuBLAS's bf16 GEMM (up to the order of
    the fp32 sums), at fp32 speed: this CPU has no bf16 instructions, and torch's bf16 GEMM on
    it runs some operand layouts (those of a linear layer's backward) about 20x slower. A
    dispatch mode, so that the backward's matmuls (megatron's linear layers) are caught too."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bf16 = [isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args]
        if func in MATMULS and any(bf16):
            wide = [a.float() if is_bf16 else a for a, is_bf16 in zip(args, bf16)]
            return func(*wide, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def batches(vocab: int, steps: int, micro: int, seq: int) -> list[Batch]:
    """One micro-batch a step: whole contexts of one sample, every position supervised."""
    g = torch.Generator().manual_seed(0)
    follow = torch.randperm(vocab, generator=g)
    out = []
    for _ in range(steps):
        ids = torch.empty(micro, seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (micro,), generator=g)
        for t in range(1, seq + 1):
            noise = torch.rand(micro, generator=g) < NOISE
            ids[:, t] = torch.where(noise, torch.randint(0, vocab, (micro,), generator=g),
                                    follow[ids[:, t - 1]])
        labels = ids[:, 1:].clone()
        labels[:, 0] = IGNORE_INDEX  # a bos-like first position: nothing to predict it from
        out.append(Batch(input_ids=ids[:, :-1].contiguous(),
                         position_ids=torch.arange(seq).expand(micro, seq).contiguous(),
                         segment_ids=torch.ones(micro, seq, dtype=torch.long),
                         prefix_mask=torch.zeros(micro, seq, dtype=torch.bool), labels=labels))
    return out


def curve(variant: str, shape: str, overrides: list[str], data: list[Batch], weights: SharedWeights
          ) -> list[float]:
    dtype = ["params_dtype=bfloat16"] if variant == "bf16" else []
    cfg = model_config(shape, None, [*overrides, *dtype])
    optim = OptimSection(lr=1e-3, warmup_steps=min(50, len(data) // 5), clip_grad=1.0, ema_decay=0.999,
                         shard_state=False, distributed_optimizer=variant == "bf16")
    model = weights.model(cfg, torch.device("cpu"))  # fp32 first: the others load its values
    trainer = build_trainer(model, optim, device=torch.device("cpu"),
                            dp_group=parallel_state.get_data_parallel_group(), dp_size=1)
    window = WindowSection(schedule="constant", k=cfg.bp_window)
    train_cfg = TrainConfig(model=cfg, window=window, optim=optim)
    losses = []
    start = time.perf_counter()
    for step, mb in enumerate(data):
        with TensorCoreMatmuls() if variant == "bf16" and EMULATE else contextlib.nullcontext():
            outcome = train_step(trainer, [mb], plan_step(step, train_cfg), step=step)
        losses.append(outcome.loss)
        if step % 10 == 0 or step == len(data) - 1:
            print(f"{variant} step {step} loss {outcome.loss:.4f} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    return losses


def relative(a: list[float], ref: list[float]) -> list[float]:
    return [abs(x - r) / abs(r) for x, r in zip(a, ref)]


def smooth(xs: list[float], n: int = 10) -> list[float]:
    return [statistics.fmean(xs[max(0, i - n + 1): i + 1]) for i in range(len(xs))]


def main() -> None:
    shape, steps, seq, micro = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    overrides = sys.argv[5:]
    parallel.init_distributed()
    parallel.init_model_parallel(1)
    cfg = model_config(shape, None, overrides)
    data = batches(cfg.vocab_size, steps, micro, seq)
    weights = SharedWeights()
    curves = {v: curve(v, shape, overrides, data, weights) for v in VARIANTS}  # fp32 first
    ref = curves["fp32"]
    half = steps // 2
    print(f"\n{shape} {steps} steps of {micro} x {seq} tokens, k={cfg.bp_window}, lr 1e-3; "
          f"fp32 loss {ref[0]:.3f} -> {ref[-1]:.3f} (last 10 mean {statistics.fmean(ref[-10:]):.3f})")
    for v in VARIANTS[1:]:
        rel, rel_smooth = relative(curves[v], ref), relative(smooth(curves[v]), smooth(ref))
        print(f"{v} vs fp32: loss {curves[v][-1]:.3f} at the end; relative difference per step max "
              f"{max(rel):.2e} mean {statistics.fmean(rel):.2e}; last half max {max(rel[half:]):.2e} "
              f"mean {statistics.fmean(rel[half:]):.2e}; 10-step means max {max(rel_smooth):.2e} "
              f"(last half {max(rel_smooth[half:]):.2e})")


if __name__ == "__main__":
    main()
