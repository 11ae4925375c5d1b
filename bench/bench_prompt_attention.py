"""The joining prompts' attention half of a layer: the prompts' C kernel against SDPA between C calls.

    .venv/bin/python bench/bench_prompt_attention.py [--heads 8] [--head-dim 64] [--threads 2]
        [--prompts 1x64,4x64,32x64,1x128,1x192,1x256,1x512,1x1024] [--rounds 5]

For each case (``COUNTxLENGTH``: that many prompts of that many tokens joining one step), the
attention half of one layer as ``NativeOps`` runs it (``inference/step_ops.py``), both ways in
turn in one process: ``kernel`` (``mimir_kernels.cpu_step.prompt_attention``: RoPE, the cache's
writes, attention and the gate in one call) and ``sdpa`` (RoPE and the writes in C, torch's SDPA
per run of equal-length prompts, the gate in C: what the step runs above
``NativeOps.PROMPT_KERNEL_MAX``). It prints the median µs of each (calls timed in blocks, the
median over ``--rounds``), their ratio (< 1: the kernel faster), the largest difference between
the two results, and which way the step takes. Measure with the machine otherwise idle.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_linear import per_call_us

from mimir_megatron.inference.kv_cache import KVCache
from mimir_megatron.inference.step_ops import NativeOps, Prompts, StepTokens
from mimir_megatron.model.rope import RotaryTable, rotary_angles


def _case(count: int, length: int, heads: int, head_dim: int):
    """A step of ``count`` joining prompts of ``length`` tokens: its tokens, the cache's buffers
    and the fused projection's output."""
    g = torch.Generator().manual_seed(count * 1000 + length)
    cache = KVCache()
    cache.reserve(count, length)
    keys, values = cache.buffers((0, 1), torch.empty(1, heads, head_dim))
    positions = torch.arange(length).repeat(count)
    step = StepTokens.of(None, [Prompts(0, count, length, 0)],
                         RotaryTable(rotary_angles(positions[None], head_dim, 10000.0)))
    mixed = torch.randn(count * length, heads, 4, head_dim, generator=g)
    return step, mixed, keys, values


def _time(call, budget_s: float = 0.2) -> float:
    """µs per call, over as many calls as fit in about ``budget_s``."""
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-6)
    return per_call_us(call, max(3, int(budget_s / once)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", default="1x64,4x64,32x64,1x128,1x192,1x256,1x512,1x1024",
                        help="comma-separated COUNTxLENGTH cases")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from mimir_kernels import cpu_step

    lib = cpu_step.library()
    if lib is None:
        raise SystemExit("the C kernels are not built (pip install -e . with a C compiler)")
    kernel, sdpa = NativeOps(lib), NativeOps(lib)
    kernel.PROMPT_KERNEL_MAX, sdpa.PROMPT_KERNEL_MAX = 1 << 62, 0
    print(f"{args.heads} heads of {args.head_dim}, {args.threads} threads; "
          f"the step takes the kernel up to {NativeOps.PROMPT_KERNEL_MAX // args.head_dim} tokens")
    print("| prompts | kernel µs | sdpa µs | kernel / sdpa | largest difference | the step takes |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for case in args.prompts.split(","):
        count, length = (int(v) for v in case.split("x"))
        step, mixed, keys, values = _case(count, length, args.heads, args.head_dim)
        kernel.prepare(step)
        times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
        for r in range(args.rounds):
            for name in (("kernel", "sdpa") if r % 2 == 0 else ("sdpa", "kernel")):
                ops = kernel if name == "kernel" else sdpa
                times[name].append(_time(lambda: ops.attend(mixed, keys, values, step, None, torch.float32)))
        a = kernel.attend(mixed, keys, values, step, None, torch.float32)
        b = sdpa.attend(mixed, keys, values, step, None, torch.float32)
        k, s = statistics.median(times["kernel"]), statistics.median(times["sdpa"])
        takes = "kernel" if length * args.head_dim <= NativeOps.PROMPT_KERNEL_MAX else "sdpa"
        print(f"| {case} | {k:,.0f} | {s:,.0f} | {k / s:.2f} | {(a - b).abs().max().item():.1e} | {takes} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
