"""The data path at the paper's shape: start-up, the step at an epoch boundary, memory, open files
and cold reads of a synthetic mixture of 161 datasets written in the project's prepared format.

    python bench/bench_data_scale.py                 # scaled down: 60M tokens, 1,130 shards
    python bench/bench_data_scale.py --full          # v1.5: 103.2B tokens, 5,648 shards (~410 GB)
    python bench/bench_data_scale.py --data DIR      # reuse a mixture written before

Phases, each in a fresh process so that its memory and open files are its own:
  rank 0 start-up  open the mixture and build the packing index as `mimir train`'s rank 0 does
                   before step 1 (this code: every epoch the run reaches; before: epoch 0 only)
  rank 1           a data-parallel rank (DP=2, micro-batch 4) reading micro-batches across the
                   boundary of epochs 0 and 1: the slowest and the median micro-batch, resident
                   memory (RSS) and the open file descriptors after it
  cold reads       the shard files evicted from the page cache (posix_fadvise DONTNEED), then
                   random contexts read: contexts/s

"Before" numbers come from the same script run against an older checkout
(`PYTHONPATH=OLD_CHECKOUT python bench/bench_data_scale.py --data DIR`); it uses only the
loader's public API (PackedMixture, build_train_loader). Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

N_DATASETS = 161
V15_TOKENS = 103_214_604_702
V15_SHARDS = 5_648
SEQ_LEN = 4096
MICRO_BATCH, DP = 4, 2


def synthetic_lengths(total_tokens: int, seed: int = 0):
    """Per dataset: document lengths (lognormal, 3..4096 tokens, dataset means 150-2,500) and a
    repeat factor (12 datasets repeated 4x, 10x or 20x, as in the paper's mixture)."""
    rng = np.random.default_rng(seed)
    shares = rng.dirichlet(np.full(N_DATASETS, 0.7))
    repeats = np.ones(N_DATASETS)
    repeats[rng.choice(N_DATASETS, 12, replace=False)] = rng.choice([4, 10, 20], 12)
    out = []
    for share, repeat, mean in zip(shares, repeats, rng.uniform(150, 2500, N_DATASETS)):
        sigma = 0.9
        n = max(1, int(share * total_tokens / repeat / mean))
        out.append(np.clip(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n), 3, SEQ_LEN).astype(np.int64))
    return out, repeats.tolist()


def write_shard(prefix: Path, lengths: np.ndarray, noise: np.ndarray) -> tuple[int, int]:
    """One shard in megatron-core's indexed format (int32 ids): each document a prefix of a third
    of its length and a response of the rest plus one (so it packs into ``length`` positions)."""
    prefix_len = np.maximum(1, lengths // 3)
    seqs = np.stack([prefix_len, lengths - prefix_len + 1], axis=1).reshape(-1)
    pointers = np.concatenate([[0], np.cumsum(seqs)[:-1]]) * 4
    with open(f"{prefix}.bin", "wb") as f:
        total = int(seqs.sum())
        for start in range(0, total, len(noise)):
            f.write(noise[: min(len(noise), total - start)].tobytes())
        os.fsync(f.fileno())
    head = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4)
    head += struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(lengths) + 1)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(head + seqs.astype("<i4").tobytes() + pointers.astype("<i8").tobytes()
                + np.arange(0, len(seqs) + 1, 2, dtype="<i8").tobytes())
        os.fsync(f.fileno())
    return len(lengths), int(seqs.sum())


def write_mixture(root: Path, total_tokens: int, shards: int) -> Path:
    """161 prepared datasets (manifests with per-file sha256, as `mimir prepare` writes them) and
    their mixture YAML; shards are given to datasets by token share (at least one each)."""
    from mimir_megatron.data.manifest import write_manifest
    from mimir_megatron.integrity import sha256_file

    lengths, repeats = synthetic_lengths(total_tokens)
    tokens = np.array([int(x.sum()) for x in lengths])
    per_dataset = np.maximum(1, np.round(tokens / tokens.sum() * (shards - N_DATASETS)).astype(int) + 1)
    noise = np.random.default_rng(1).integers(0, 262_144, 1 << 20, dtype=np.int32)
    lines = ["name: scale", "datasets:"]
    for i, (lens, repeat, n_shards) in enumerate(zip(lengths, repeats, per_dataset)):
        path = root / f"ds{i:03d}"
        (path / "shards").mkdir(parents=True, exist_ok=True)
        entries, outputs, documents, total = [], {}, 0, 0
        for s, part in enumerate(np.array_split(lens, n_shards)):
            rel = f"shards/{s:05d}"
            docs, toks = write_shard(path / rel, part, noise)
            entries.append({"prefix": rel, "documents": docs})
            for ext in (".bin", ".idx"):
                outputs[rel + ext] = sha256_file(path / (rel + ext))
            documents, total = documents + docs, total + toks
        tokenizer = {"path": "synthetic", "sha256": hashlib.sha256(b"synthetic").hexdigest()}
        write_manifest(path, {"documents": documents, "tokens": {"total": total}, "dtype": "int32",
                              "tokenizer": tokenizer, "shards": entries, "outputs": outputs})
        lines.append(f"  - {{path: {path.name}, category: c{i % 8}, language: en, repeat: {repeat}}}")
    (root / "mixture.yaml").write_text("\n".join(lines) + "\n")
    return root / "mixture.yaml"


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def config(mixture: Path, index_dir: Path):
    from mimir_megatron.data import DataConfig

    return DataConfig(mixture=str(mixture), seq_len=SEQ_LEN, seed=1234, index_dir=str(index_dir), prefetch=0)


def phase_start(mixture: Path, index_dir: Path) -> dict:
    """Rank 0 before step 1: open the mixture, build what the trainer builds."""
    from mimir_megatron.data import PackedMixture

    started = time.perf_counter()
    stream = PackedMixture(config(mixture, index_dir))
    first = stream.epoch(0).num_contexts
    if hasattr(stream, "build_ahead"):  # this code: every epoch the run reaches (here 2)
        stream.build_ahead(first + 8 * MICRO_BATCH * DP)
    else:  # before: rank 0 built the epoch being resumed (0) only
        stream.locate(0)
    return {"start_s": time.perf_counter() - started, "epoch0_contexts": first, "rss_mib": rss_mib()}


def phase_rank(mixture: Path, index_dir: Path) -> dict:
    """DP rank 1 reading micro-batches across the first epoch boundary."""
    from mimir_megatron.data import PackedMixture, build_train_loader

    stream = PackedMixture(config(mixture, index_dir))
    step = MICRO_BATCH * DP
    first = stream.epoch(0).num_contexts
    consumed = max(0, (first // step - 4) * step)
    loader = build_train_loader(stream.cfg, micro_batch_size=MICRO_BATCH, dp_rank=1, dp_size=DP,
                                consumed_samples=consumed, stream=stream)
    t = time.perf_counter()
    next(loader)  # the rank's first micro-batch: opens what it needs (lengths, index, files)
    first_batch = time.perf_counter() - t
    times = []
    for _ in range(7):  # 2 more before the boundary, the one across it (epoch 1 starts), 4 after
        t = time.perf_counter()
        next(loader)
        times.append(time.perf_counter() - t)
    return {"first_batch_s": first_batch, "boundary_batch_s": max(times),
            "median_batch_s": statistics.median(times), "rss_mib": rss_mib(), "open_files": open_files()}


def evict(root: Path) -> None:
    for path in root.glob("ds*/shards/*"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def phase_cold(mixture: Path, index_dir: Path, contexts: int) -> dict:
    """Random contexts of epoch 0 read right after the shard files left the page cache."""
    from mimir_megatron.data import PackedMixture

    stream = PackedMixture(config(mixture, index_dir))
    n = stream.epoch(0).num_contexts
    stream.sample_lengths  # noqa: B018 (the lengths are read at start-up, not per context)
    picks = np.random.default_rng(7).choice(n, min(n, contexts), replace=False)
    evict(mixture.parent)
    started = time.perf_counter()
    tokens = sum(len(p) + len(r) for s in picks for p, r in stream.context(int(s)))
    seconds = time.perf_counter() - started
    return {"cold_contexts_per_s": len(picks) / seconds, "cold_tokens": tokens, "open_files": open_files()}


def run_phase(name: str, args: argparse.Namespace) -> dict:
    out = subprocess.run([sys.executable, __file__, "--phase", name, "--data", str(args.data),
                          "--index-dir", str(args.index_dir), "--contexts", str(args.contexts)],
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the paper's v1.5 size (~410 GB of shards)")
    parser.add_argument("--tokens", type=int, default=60_000_000)
    parser.add_argument("--shards", type=int, default=1_130, help="default: a fifth of v1.5's 5,648")
    parser.add_argument("--data", type=Path, default=Path("/tmp/mimir-bench-data-scale"))
    parser.add_argument("--index-dir", type=Path, default=None, help="default: DATA/_index (emptied first)")
    parser.add_argument("--contexts", type=int, default=300, help="cold reads (default 300)")
    parser.add_argument("--phase", choices=("start", "rank", "cold"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.index_dir = args.index_dir or args.data / "_index"
    mixture = args.data / "mixture.yaml"
    if args.phase:
        # The trainer has megatron-core imported before it opens the data: so do the phases,
        # before their clocks start (the import alone takes seconds).
        from megatron.core.datasets import indexed_dataset  # noqa: F401
        import torch  # noqa: F401

        if args.phase == "cold":
            result = phase_cold(mixture, args.index_dir, args.contexts)
        else:
            result = {"start": phase_start, "rank": phase_rank}[args.phase](mixture, args.index_dir)
        print(json.dumps(result))
        return 0
    if args.full:
        args.tokens, args.shards = V15_TOKENS, V15_SHARDS
    if not mixture.is_file():
        started = time.perf_counter()
        write_mixture(args.data, args.tokens, args.shards)
        print(f"wrote {args.data}: {N_DATASETS} datasets, {len(list(args.data.glob('ds*/shards/*.bin')))} "
              f"shards in {time.perf_counter() - started:.0f} s")
    for old in args.index_dir.glob("*") if args.index_dir.is_dir() else []:
        old.unlink()
    print(f"soft open-file limit {__import__('resource').getrlimit(__import__('resource').RLIMIT_NOFILE)[0]}")
    for name in ("start", "rank", "cold"):
        print(name, json.dumps(run_phase(name, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
