"""Usage: python bench/bench_step_alternating.py SHAPE SEQ_LEN MICRO_BATCH ROUNDS [WINDOWS [KEY=VALUE ...]]

e.g. `tiny 256 4 4 5,8` (WINDOWS defaults to 5,8); model overrides follow the windows, e.g. the
demo's model: `tiny 256 8 5 2,5 num_layers_L=1 num_layers_H=1`.

Ours (the trainer's train_step) and the transformers peer, steps alternating, in one process:
on a shared machine the load changes between two sequential runs, alternation exposes both to it.
Both steps are those `mimir bench` times (mimir_megatron.bench.ours / .peer: the same weights,
batch, optimizer, clipping at 1.0 and EMA).

Each step is timed twice: wall clock, and the process's CPU time (user + system, all threads).
On an oversubscribed machine the wall clock mostly measures the other jobs; the CPU time measures
the work each implementation does. Run with ``OMP_NUM_THREADS=1`` for CPU times free of the
thread pool's spin-waiting (with several threads, idle threads spinning at a barrier count too).
"""

import statistics
import sys
import time

import torch

from mimir_megatron.bench.measure import BenchSetup, SharedWeights, StepSettings, bench_batch
from mimir_megatron.bench.ours import our_steps
from mimir_megatron.bench.peer import peer_steps
from mimir_megatron.bench.shapes import model_config
from mimir_megatron.train.flops import attended_keys_per_token


def main() -> None:
    shape, seq, mb, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    windows = [int(k) for k in sys.argv[5].split(",")] if len(sys.argv) > 5 else [5, 8]
    cfg = model_config(shape, None, sys.argv[6:])
    batch = bench_batch(cfg.vocab_size, mb, seq)
    setup = BenchSetup(windows=windows, tokens=mb * seq, seq_len=seq, batch=batch, device=torch.device("cpu"),
                       precision="auto", peak_tflops=None, warmup=0, steps=rounds,
                       attended_keys=attended_keys_per_token(batch.segment_ids, batch.prefix_mask).item(),
                       step=StepSettings(lr=1e-4, clip_grad=1.0, ema_decay=0.9999))
    weights = SharedWeights()
    ours, _ = our_steps(cfg, setup, weights)
    peer, _ = peer_steps(cfg, setup, weights, checkpointing=False)
    print(f"torch threads {torch.get_num_threads()}", flush=True)
    for k in windows:
        steps = {"ours": ours(k)[0], "peer": peer(k)[0]}
        wall: dict[str, list[float]] = {"ours": [], "peer": []}
        cpu: dict[str, list[float]] = {"ours": [], "peer": []}
        for i in range(rounds + 1):
            for name in ("ours", "peer") if i % 2 == 0 else ("peer", "ours"):
                s, c = time.perf_counter(), time.process_time()
                steps[name]()
                if i:  # the first round is untimed (warm-up)
                    wall[name].append(time.perf_counter() - s)
                    cpu[name].append(time.process_time() - c)
        tok = mb * seq
        for clock, t in (("wall", wall), ("cpu", cpu)):
            mo, mp = statistics.median(t["ours"]), statistics.median(t["peer"])
            print(
                f"{shape} k={k} {mb}x{seq} {clock}: ours {tok / mo:,.0f} tok/s (median {mo:.3f} s, "
                f"{min(t['ours']):.3f}-{max(t['ours']):.3f}); peer {tok / mp:,.0f} tok/s (median {mp:.3f} s, "
                f"{min(t['peer']):.3f}-{max(t['peer']):.3f}); ratio {mp / mo:.2f}; "
                f"ratio of fastest steps {min(t['peer']) / min(t['ours']):.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
