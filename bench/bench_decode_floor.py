"""The floor under a decoding step: its weight matmuls alone, next to whole steps of ours and transformers.

    .venv/bin/python bench/bench_decode_floor.py [--shape tiny|mid] [--batches 1,8,32]
        [--threads 1] [--rounds 5] [--prompt-len 64] [--new-tokens 32]

One decoding step of HRM-Text multiplies one token per row by every weight of the schedule's
module applications (LLLHLLLH: each L layer six times, each H layer twice) and by the head.
Any implementation that keeps fp32 and torch's CPU BLAS makes these products: fused or split,
the multiply-adds and the bytes of weight read per step are the same. This script times them
alone (``F.linear`` of a ``[batch, in]`` input by each weight of the model, in the step's order,
fastest of ``--rounds`` steps; both as fused weights and split into the products transformers
makes) and, in the same process, whole decoding steps of our engine and
of transformers ``generate`` on the same weights (``bench_generate.py``'s runners: ``(t(1 + n) -
t(1)) / n``, fastest of ``--rounds``). ``transformers / floor`` is the highest decode ratio to
transformers that any implementation can reach on this machine without changing the arithmetic
(a lower precision, another matmul library, a GPU).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_generate's runners


def step_weights(model, split: bool) -> list:
    """The weights one decoding step multiplies by, in order: per module application, per layer,
    the fused q/gate/k/v, the attention output, the MLP's two projections; then the head.
    ``split``: the fused weights as the products a split implementation makes (transformers':
    q, k, v and the gate apart, the MLP's gate and up apart), row blocks of the same tensors."""
    weights = []
    for module in model.window_plan().schedule:
        for layer in getattr(model, module).layers:
            attn, mlp = layer.self_attention, layer.mlp
            qkv, fc1 = attn.linear_qkv.weight, mlp.linear_fc1.weight
            weights += list(torch.chunk(qkv, 4)) if split else [qkv]
            weights.append(attn.linear_proj.weight)
            weights += list(torch.chunk(fc1, 2)) if split else [fc1]
            weights.append(mlp.linear_fc2.weight)
    return weights + [model.head.weight]


def matmul_floor(weights: list, batch: int, rounds: int) -> float:
    """Seconds of the step's ``F.linear`` calls alone, fastest of ``rounds`` (after one warm-up)."""
    import torch.nn.functional as F

    inputs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}
    best = float("inf")
    with torch.no_grad():
        for r in range(rounds + 1):
            start = time.perf_counter()
            for w in weights:
                F.linear(inputs[w.shape[1]], w)
            if r:
                best = min(best, time.perf_counter() - start)
    return best


def step_seconds(run, new: int, rounds: int) -> float:
    """One decoding step of ``run`` (generate ``n`` tokens): ``(t(1 + new) - t(1)) / new``, each
    the fastest of ``rounds``."""
    t1 = tn = float("inf")
    run(2)  # warm-up
    for _ in range(rounds):
        start = time.perf_counter()
        run(1)
        t1 = min(t1, time.perf_counter() - start)
        start = time.perf_counter()
        run(1 + new)
        tn = min(tn, time.perf_counter() - start)
    return (tn - t1) / new


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny", choices=("tiny", "mid"))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    import torch

    from mimir_megatron.process import setup_process

    setup_process(megatron=True)  # an entry point: the CPU backend, once, before any model
    torch.set_num_threads(args.threads)
    from bench_generate import _runners

    from mimir_megatron.bench.shapes import model_config
    from mimir_megatron.interop import export_hf, save_weights
    from mimir_megatron.model import build_model

    work = Path(tempfile.mkdtemp(prefix="bench_decode_floor_"))
    model = build_model(model_config(args.shape, None)).eval()
    save_weights(model, work / "weights")
    export_hf(model, work / "hf")
    fused, split = step_weights(model, split=False), step_weights(model, split=True)
    print(f"{args.shape}: {len(fused)} fused / {len(split)} split weight products per step, "
          f"{sum(w.numel() for w in fused) * 4 / 2**20:,.0f} MiB of fp32 weight read; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    print("| batch | products alone, fused ms/step | split ms/step | ours ms/step | transformers ms/step "
          "| transformers / fastest products (the highest ratio reachable) | ours vs transformers |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in [int(b) for b in args.batches.split(",")]:
        runners = _runners(["ours", "transformers"], work / "weights", work / "hf", batch, args.prompt_len)
        floor_fused = matmul_floor(fused, batch, args.rounds)
        floor_split = matmul_floor(split, batch, args.rounds)
        ours = step_seconds(runners["ours"], args.new_tokens, args.rounds)
        peer = step_seconds(runners["transformers"], args.new_tokens, args.rounds)
        floor = min(floor_fused, floor_split)
        print(f"| {batch} | {floor_fused * 1e3:.2f} | {floor_split * 1e3:.2f} | {ours * 1e3:.2f} "
              f"| {peer * 1e3:.2f} | {peer / floor:.2f} | {peer / ours:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
