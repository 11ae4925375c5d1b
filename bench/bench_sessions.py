"""The engine under a closed loop of requests, in one process: tokens per CPU-second and per second.

    python bench/bench_sessions.py [--shape tiny|mid512] [--concurrency 1,8,32] [--threads 1]

``c`` clients of ``--requests-per-client`` requests each (64-token prompts, 64 new tokens,
greedy, no early stop) through one :class:`~mimir_megatron.inference.DecodeSession`: the first
``c`` requests join one per step, and a new one joins as soon as a row finishes, as rows join and
leave a server's batch. No HTTP, and CPU time next to wall time, so it compares two engines on a
loaded machine: run it alternately with another checkout first on ``PYTHONPATH``
(``PYTHONPATH=OTHER:OTHER/kernels:OTHER/data_prep``; only the engine's public session API is
used). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

from mimir_megatron.bench.shapes import SERVING_SHAPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SERVING_SHAPES), default="tiny")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    from mimir_megatron.process import setup_process

    setup_process(megatron=True)
    torch.set_num_threads(args.threads)
    from mimir_megatron.bench.shapes import model_config
    from mimir_megatron.inference import GenerationRequest, InferenceEngine, SamplingParams
    from mimir_megatron.model import build_model

    torch.manual_seed(0)
    base, overrides = SERVING_SHAPES[args.shape]
    engine = InferenceEngine(build_model(model_config(base, None, overrides)), None, max_batch_size=64)

    def closed_loop(clients: int, new: int = 64) -> list[list[int]]:
        g = torch.Generator().manual_seed(clients)
        waiting = torch.randint(8, 1024, (args.requests_per_client * clients, 64), generator=g).tolist()
        first, waiting = waiting[:clients], waiting[clients:]
        params = SamplingParams(max_new_tokens=new, use_default_stops=False)
        session, done = engine.open_session(), []
        while session.active or first:
            if first:
                session.add(GenerationRequest(first.pop(0), params))
            for event in session.step():
                if event.finished:
                    done.append(event.result.token_ids)
                    if waiting:
                        session.add(GenerationRequest(waiting.pop(0), params))
        return done

    closed_loop(4, 4)  # warm-up
    out = {"shape": args.shape, "threads": args.threads}
    for clients in (int(c) for c in args.concurrency.split(",")):
        wall, cpu = time.perf_counter(), time.process_time()
        tokens = sum(map(len, closed_loop(clients)))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        out[f"c={clients}"] = {"tokens_per_cpu_s": round(tokens / cpu, 1),
                               "tokens_per_s": round(tokens / wall, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
