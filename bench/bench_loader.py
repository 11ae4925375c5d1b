"""Loader throughput: how fast the memory-mapped datasets + packing + collate path delivers
micro-batches, synchronously and through the background prefetcher, next to what a training step
consumes. This decides whether a DALI loader backend could pay off (it cannot when the loader is
far faster than the step).

    python bench/bench_loader.py [--seq-len 4096] [--micro-batch 4] [--batches 200]

Prepares the bundled demo data in a temporary folder (or uses --mixture). On a GPU the batches
are also copied to the device (pinned, asynchronous when prefetched). Not a test: numbers depend
on the machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from mimir_megatron import backend
from mimir_megatron.data import build_train_loader
from mimir_megatron.data.config import DataConfig
from mimir_megatron.data.prefetch import DevicePrefetcher


def demo_mixture(root: Path) -> Path:
    from mimir_megatron.cli import main

    data = root / "data"
    assert main(["data", "demo", "--output", str(data), "--train-per-group", "400",
                 "--eval-per-group", "1", "--workers", "1"]) == 0
    names = sorted(p.name for p in data.iterdir() if (p / "manifest.json").is_file() and p.name != "eval")
    lines = ["name: bench", "datasets:"] + [
        f"  - {{name: {n}, path: {data / n}, category: demo, language: en, repeat: 1}}" for n in names
    ]
    mixture = data / "mixture.yaml"
    mixture.write_text("\n".join(lines) + "\n")
    return mixture


def measure(batches, count: int, device: torch.device) -> float:
    """Seconds per micro-batch, delivered on ``device``."""
    next(batches).to(device)  # first batch: opening datasets, packing index
    start = time.perf_counter()
    for _ in range(count):
        batch = next(batches).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    del batch
    return (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixture", help="mixture YAML (default: bundled demo data)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--step-seconds", type=float, default=1.1,
                        help="a training step's time, for the comparison (paper: ~1.1 s)")
    parser.add_argument("--tokens-per-gpu-step", type=int, default=32768,
                        help="tokens one GPU trains on per step (paper: 262,144 / 8 GPUs)")
    args = parser.parse_args()
    device = backend.device()
    with tempfile.TemporaryDirectory() as tmp:
        mixture = args.mixture or str(demo_mixture(Path(tmp)))
        cfg = DataConfig(mixture=mixture, seq_len=args.seq_len, index_dir=str(Path(tmp) / "index"))
        tokens = args.micro_batch * args.seq_len

        def loader():
            return build_train_loader(cfg, micro_batch_size=args.micro_batch, dp_rank=0, dp_size=1)

        sync = measure(loader(), args.batches, device)
        prefetcher = DevicePrefetcher(loader(), device, depth=4)
        ahead = measure(prefetcher, args.batches, device)
        prefetcher.close()
    print(f"device {device}, micro-batch {args.micro_batch} x {args.seq_len} tokens")
    print(f"synchronous loader: {sync * 1e3:8.2f} ms/batch  {tokens / sync:>14,.0f} tokens/s")
    print(f"prefetched (4):     {ahead * 1e3:8.2f} ms/batch  {tokens / ahead:>14,.0f} tokens/s")
    need = args.tokens_per_gpu_step / args.step_seconds
    print(f"training needs {need:,.0f} tokens/s per GPU ({args.tokens_per_gpu_step:,} tokens per "
          f"{args.step_seconds} s step): the synchronous loader has {tokens / sync / need:.0f}x headroom")


if __name__ == "__main__":
    main()
