"""`mimir serve` throughput: N requests sent concurrently (they share decoding steps) next to the
same N sent one after another, through the official `openai` client.

    python bench/bench_serve.py [--requests 16] [--max-tokens 32] [--shape tiny] [--device cpu]

A random model of the given shape with the bundled demo tokenizer; greedy decoding with no stop
token (``ignore_eos``-like: the default stop ids are cleared), so every request generates exactly
``--max-tokens`` tokens. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--shape", default="tiny", help="configs/model/SHAPE.yaml")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=2, help="each mode is run this many times; best kept")
    args = parser.parse_args()

    import torch
    from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR
    from openai import OpenAI

    from mimir_megatron.process import setup_process
    from mimir_megatron.chat import load_tokenizer
    from mimir_megatron.config import load_config
    from mimir_megatron.inference import InferenceEngine
    from mimir_megatron.inference.server import app_server, build_app, serve_app_in_thread
    from mimir_megatron.model import build_model

    setup_process(megatron=True)  # this script is an entry point: the CPU backend, once, before any model
    cfg = load_config(REPO / "configs" / "model" / f"{args.shape}.yaml", ["vocab_size=1024"])
    model = build_model(cfg).to(args.device)
    engine = InferenceEngine(model, load_tokenizer(DEMO_TOKENIZER_DIR),
                             max_batch_size=max(32, args.requests))
    engine.default_stop_ids = ()  # every request runs to max_tokens: equal work in both modes
    prompts = [f"Request number {i}: tell me something about topic {i * 7}." for i in range(args.requests)]
    app = build_app(engine, max_queue=max(256, args.requests))
    scheduler = app_server(app).scheduler

    with serve_app_in_thread(app) as url:
        client = OpenAI(base_url=url, api_key="x", max_retries=0, timeout=3600)

        def one(prompt: str) -> int:
            r = client.completions.create(model=engine.model_name, prompt=prompt,
                                          max_tokens=args.max_tokens, temperature=0)
            return r.usage.completion_tokens

        one("warm up")
        results = {}
        for mode in ("sequential", "concurrent"):
            best = None
            for _ in range(args.rounds):
                steps = scheduler.stats.steps
                start = time.perf_counter()
                if mode == "sequential":
                    tokens = sum(one(p) for p in prompts)
                else:
                    with ThreadPoolExecutor(args.requests) as pool:
                        tokens = sum(pool.map(one, prompts))
                seconds = time.perf_counter() - start
                run = {"seconds": round(seconds, 3), "requests_per_s": round(args.requests / seconds, 2),
                       "tokens_per_s": round(tokens / seconds, 1), "tokens": tokens,
                       "decoding_steps": scheduler.stats.steps - steps}
                if best is None or seconds < best["seconds"]:
                    best = run
            results[mode] = best
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    results["speedup_concurrent_over_sequential"] = round(
        results["concurrent"]["tokens_per_s"] / results["sequential"]["tokens_per_s"], 2)
    results["setup"] = {"shape": args.shape, "device": args.device, "requests": args.requests,
                        "max_tokens": args.max_tokens, "torch_threads": torch.get_num_threads()}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
