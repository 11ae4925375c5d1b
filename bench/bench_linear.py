"""Usage: python bench/bench_linear.py [--threads 2] [--shape tiny|mid512] [--calls 2000] [--rotate N]

Wall time per call (µs) of the inference engine's weight products (``F.linear``, what
``inference/step.py`` runs) next to the same product on prepacked weights: oneDNN's
(``torch.ops.mkldnn._linear_pointwise`` on ``_reorder_linear_weight``) and MKL's
(``torch.ops.mkl._mkl_linear`` on ``_mkl_reorder_linear_weight``), the kernels Inductor's CPU
freezing uses, and the C loop the engine runs at 1-8 rows (``mimir_kernels.cpu_step.small_gemm``,
where the install built it). Rows M = 1 to 512 (a decoding step's rows, a prompt's tokens), the shape's
projections (fused QKV, MLP up, MLP down), alternated per call site; results checked equal.
A question it answers: would prepacked weights speed the serving engine's products on this CPU?
``--rotate N``: N distinct weights per product, called in turn, as a decoding step reads its
layers' weights one after another (N = 1: one weight, hot in the cache, which flatters F.linear).
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Callable

import torch
import torch.nn.functional as F

# (hidden, ffn); the products (N, K): QKV (4 * hidden, hidden), up (2 * ffn, hidden), down (hidden, ffn)
SHAPES = {
    "tiny": (256, 768),
    "mid512": (512, 1536),
}


def per_call_us(call: Callable[[], torch.Tensor], calls: int) -> float:
    for _ in range(min(50, calls)):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rows", default="1,2,4,8,16,32,512")
    parser.add_argument("--rotate", type=int, default=1, help="distinct weights per product, used in turn")
    args = parser.parse_args()
    if args.rotate < 1:
        parser.error(f"--rotate must be >= 1, got {args.rotate}")
    torch.set_num_threads(args.threads)
    from mimir_kernels import cpu_step

    lib = cpu_step.library()
    hidden, ffn = SHAPES[args.shape]
    products = {"qkv": (4 * hidden, hidden), "up": (2 * ffn, hidden), "down": (hidden, ffn)}
    print(f"{args.shape}, {args.threads} threads, µs per call ({args.calls} calls, {args.rotate} weight(s) "
          "in turn); ratios: prepacked / F.linear")
    print("| rows | product | F.linear | oneDNN prepacked | MKL prepacked | C loop | oneDNN / F.linear "
          "| MKL / F.linear | C loop / oneDNN |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rows in map(int, args.rows.split(",")):
        for name, (n, k) in products.items():
            x = torch.randn(rows, k)
            weights = [torch.randn(n, k) / k**0.5 for _ in range(args.rotate)]  # outputs of order 1
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
            mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
            order = itertools.cycle(range(args.rotate))

            def by_onednn(i: int) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], "")

            def by_mkl(i: int) -> torch.Tensor:
                return torch.ops.mkl._mkl_linear(x, mkl[i], weights[i], None, rows)

            def by_c_loop(i: int) -> torch.Tensor:
                return cpu_step.small_gemm(lib, x, weights[i])

            calls = {
                "linear": lambda: F.linear(x, weights[next(order)]),
                "onednn": lambda: by_onednn(next(order)),
                "mkl": lambda: by_mkl(next(order)),
            }
            others = [by_onednn, by_mkl]
            if lib is not None:
                calls["c"] = lambda: by_c_loop(next(order))
                others.append(by_c_loop)
            for i, w in enumerate(weights):
                for other in others:
                    torch.testing.assert_close(other(i), F.linear(x, w), rtol=1e-4, atol=1e-4)
            us = {key: per_call_us(call, args.calls) for key, call in calls.items()}
            c_loop = f"{us['c']:.1f}" if "c" in us else "not built"
            c_ratio = f"{us['c'] / us['onednn']:.2f}" if "c" in us else "-"
            print(f"| {rows} | {name} {n}x{k} | {us['linear']:.1f} | {us['onednn']:.1f} | {us['mkl']:.1f} | "
                  f"{c_loop} | {us['onednn'] / us['linear']:.2f} | {us['mkl'] / us['linear']:.2f} "
                  f"| {c_ratio} |")


if __name__ == "__main__":
    main()
