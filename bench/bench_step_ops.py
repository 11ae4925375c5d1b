"""The inference step's CPU kernels against torch's operations and oneDNN's products, in the engine.

    .venv/bin/python bench/bench_step_ops.py [--shape tiny|mid512] [--rows 1,8,32] [--rounds 3]
        [--steps 24] [--threads 2]

One random model of the shape; for each row count, a session of that many requests (prompts of
64-79 tokens, so the rows' lengths differ as under real traffic and torch's attention needs its
mask), then decoding steps. Each round runs the session three ways, in turn in one process:

- ``torch``: ``TorchOps`` (torch's operations: RoPE, the cache writes, SDPA over the longest row
  under a mask, the gate, ``torch.rms_norm``) and ``PrepackedProducts`` (oneDNN's GEMM on
  prepacked weights, MKL's ``F.linear`` for one row of a small weight);
- ``ops``: ``NativeOps`` (the attention half and the norms in C), the same products;
- ``all``: ``NativeOps`` and ``NativeProducts`` (the products at 1-8 rows in C too), what the
  engine runs.

It prints the median decoding step of each (median over ``--steps`` steps, then over rounds),
the ratios to ``torch``, and the prefill step of the joining prompts (their products oneDNN's
every way; under ``ops`` and ``all`` their RoPE, cache writes and gate in C around SDPA). The
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
    args = parser.parse_args()

    from mimir_megatron.process import setup_process

    setup_process(megatron=True)
    torch.set_num_threads(args.threads)
    from mimir_kernels import cpu_step

    from mimir_megatron.bench.shapes import model_config
    from mimir_megatron.inference import GenerationRequest, InferenceEngine, SamplingParams
    from mimir_megatron.inference.products import NativeProducts, PrepackedProducts
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
    variants = {"torch": (TorchOps(), PrepackedProducts()), "ops": (NativeOps(lib), PrepackedProducts()),
                "all": (NativeOps(lib), NativeProducts(lib))}

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

    print(f"{args.shape}, {args.threads} threads, medians of {args.rounds} alternated rounds "
          f"of {args.steps} decoding steps")
    print("| rows | torch ms/step | ops ms/step | all ms/step | ops / torch | all / torch "
          "| prefill torch / ops / all ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
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
        print(f"| {rows} | {d['torch']:.2f} | {d['ops']:.2f} | {d['all']:.2f} | {d['ops'] / d['torch']:.2f} "
              f"| {d['all'] / d['torch']:.2f} | {p['torch']:.1f} / {p['ops']:.1f} / {p['all']:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
