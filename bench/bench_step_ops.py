"""The inference step's CPU kernels against torch's operations and oneDNN's products, in the engine.

    .venv/bin/python bench/bench_step_ops.py [--shape tiny|mid512] [--rows 1,8,32] [--rounds 3]
        [--steps 24] [--threads 2] [--products]

One random model of the shape; for each row count, a session of that many requests (prompts of
64-79 tokens, so the rows' lengths differ as under real traffic and torch's attention needs its
mask), then decoding steps. Each round runs the session three ways, in turn in one process:

- ``torch``: ``TorchOps`` (torch's operations: RoPE, the cache writes, SDPA over the longest row
  under a mask, the gate, ``torch.rms_norm``) and ``PrepackedProducts`` (oneDNN's GEMM on
  prepacked weights, MKL's ``F.linear`` for one row of a small weight);
- ``ops``: ``NativeOps`` (the attention half and the norms in C), the same products;
- ``all``: ``NativeOps`` and the products ``products_for`` picks on this CPU, what the engine
  runs (the products at 1-8 rows through a kernel for few rows: MKL's sgemm on Intel CPUs, the
  C loop on others; on others with AVX-512 the C GEMM on packed weights from two rows; the
  script names it).

With ``--products`` it compares the product kernels instead, all with ``NativeOps``:
``onednn`` (``PrepackedProducts``), ``c_loop`` (``NativeProducts``, oneDNN's beyond 8 rows),
``mkl`` (``MklProducts``) and, where the CPU has AVX-512, ``packed`` (``NativeGemmProducts``:
the C GEMM from two rows, the C loop at one), the prefill steps likewise (``mkl`` also takes a
weight under 2 MiB at every row count).

It prints the median decoding step of each (median over ``--steps`` steps, then over rounds),
the ratios to ``torch``, and the prefill step of the joining prompts (their products oneDNN's
every way; under ``ops`` and ``all`` their attention half in the prompts' C kernel). The
same comparison, end to end over HTTP, is ``bench/bench_serve.py`` with ``--baseline-src`` on a
checkout before the kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mimir_megatron.bench.shapes import SERVING_SHAPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SERVING_SHAPES), default="mid512")
    parser.add_argument("--rows", default="1,8,32", help="decoding rows, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24, help="decoding steps timed per session")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--products", action="store_true",
                        help="compare the product kernels (oneDNN, C loop, MKL, packed GEMM) instead")
    args = parser.parse_args()

    from mimir_megatron.process import setup_process

    setup_process(megatron=True)
    torch.set_num_threads(args.threads)
    from mimir_kernels import cpu_step

    from mimir_megatron.bench.shapes import model_config
    from mimir_megatron.inference import GenerationRequest, InferenceEngine, SamplingParams
    from mimir_megatron.inference.products import (
        MklProducts,
        NativeGemmProducts,
        NativeProducts,
        PrepackedProducts,
        products_for,
    )
    from mimir_megatron.inference.step_ops import NativeOps, TorchOps
    from mimir_megatron.model import build_model

    lib = cpu_step.library()
    if lib is None:
        raise SystemExit("bench_step_ops: the C kernels are not built (mimir_kernels/_cpu_step): "
                         "install a C compiler and pip install -e . again, and unset MIMIR_CPU_KERNELS")
    torch.manual_seed(0)
    base, overrides = SERVING_SHAPES[args.shape]
    engine = InferenceEngine(build_model(model_config(base, None, overrides)), None, max_batch_size=64)
    step = engine.step_forward
    if step is None:
        raise SystemExit("bench_step_ops: this model runs megatron's recurrence, not the flattened step")
    if args.products:  # each kernel at every few-row count, whatever the weight's size
        rows = NativeProducts.MAX_ROWS
        variants = {"onednn": (NativeOps(lib), PrepackedProducts()),
                    "c_loop": (NativeOps(lib), NativeProducts(lib, rows)),
                    "mkl": (NativeOps(lib), MklProducts(rows))}
        if cpu_step.packed_gemm_available(lib):
            variants["packed"] = (NativeOps(lib), NativeGemmProducts(lib))
    else:
        engine_products = products_for(torch.device("cpu"))
        variants = {"torch": (TorchOps(), PrepackedProducts()), "ops": (NativeOps(lib), PrepackedProducts()),
                    "all": (NativeOps(lib), engine_products)}

    def session(rows: int, ops, products) -> tuple[float, float]:
        step.ops, step.products = ops, products
        s = engine.open_session()
        g = torch.Generator().manual_seed(1)
        for i in range(rows):
            prompt = torch.randint(8, 1024, (64 + i % 16,), generator=g).tolist()
            params = SamplingParams(max_new_tokens=args.steps + 8, use_default_stops=False)
            s.add(GenerationRequest(prompt, params))
        start = time.perf_counter()
        s.step()
        prefill = time.perf_counter() - start
        for _ in range(3):
            s.step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            s.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3, prefill * 1e3

    names = list(variants)
    first, others = names[0], names[1:]
    print(f"{args.shape}, {args.threads} threads, medians of {args.rounds} alternated rounds "
          f"of {args.steps} decoding steps")
    if not args.products:
        few = getattr(engine_products, "streamed_max_rows", None)
        print(f"all: {type(engine_products).__name__} (products_for on this CPU"
              + (f"; a weight of 2 MiB or more at 1-{few} rows)" if few else ")"))
    print("| rows | " + " | ".join(f"{n} ms/step" for n in names) + " | "
          + " | ".join(f"{n} / {first}" for n in others) + f" | prefill {' / '.join(names)} ms |")
    print("| ---: |" + " ---: |" * (2 * len(names)))
    for rows in (int(r) for r in args.rows.split(",")):
        decode = {name: [] for name in variants}
        prefill = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (ops, products) in variants.items():
                d, p = session(rows, ops, products)
                decode[name].append(d)
                prefill[name].append(p)
        d = {name: statistics.median(v) for name, v in decode.items()}
        p = {name: statistics.median(v) for name, v in prefill.items()}
        print(f"| {rows} | " + " | ".join(f"{d[n]:.2f}" for n in names) + " | "
              + " | ".join(f"{d[n] / d[first]:.2f}" for n in others) + " | "
              + " / ".join(f"{p[n]:.1f}" for n in names) + " |", flush=True)

if __name__ == "__main__":
    main()
