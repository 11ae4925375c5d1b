"""What verification costs: checkpoint digests at load, prepared-data checks before step 1.

    python bench/bench_integrity.py              # 1 GiB of checkpoint files, 0.5 GiB of prepared data
    python bench/bench_integrity.py --gib 2      # 4 GiB and 2 GiB

Each figure is the best of three runs, in seconds per GB and as a ratio against its peer measured
in the same run: reading the same bytes (``cat``-like, 4 MiB blocks). Files are read from the page cache (they
were just written): the figures are the CPU cost of hashing; from a cold disk, reading them is
the floor either way. Not a test: numbers depend on the machine and its load (print ``uptime``).

- checkpoint: a checkpoint-sized set of files (4 data files, as 2 ranks x 2 writer threads
  write them) recorded in a trainer state, verified by ``start_verification`` (threads, what
  every load runs) and by one thread;
- data: one prepared dataset of ``--gib`` GB (a megatron indexed dataset and its manifest),
  through ``shard_problems`` (every start) and ``hash_outputs`` / ``output_problems``
  (``data.verify``, threads).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

BLOCK = 1 << 22


def read_all(paths: list[Path]) -> None:
    buffer = bytearray(BLOCK)
    for path in paths:
        with open(path, "rb") as f:
            while f.readinto(buffer):
                pass


REPEATS = 3


def timed(fn, *args) -> float:
    """The best of :data:`REPEATS` runs (a shared machine's load only ever adds time)."""
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - started)
    return best


def write_random(path: Path, size: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for start in range(0, size, BLOCK):
            f.write(rng.integers(0, 256, min(BLOCK, size - start), dtype=np.uint8).tobytes())


def bench_checkpoint(tmp: Path, size: int) -> None:
    from mimir_megatron.checkpoint.digests import collect_digests, start_verification
    from mimir_megatron.integrity import sha256_file
    from mimir_megatron.checkpoint.trainer_state import TrainerState, write_trainer_state

    ckpt = tmp / "step_0000001"
    ckpt.mkdir()
    files = [ckpt / f"__{rank}_{thread}.distcp" for rank in range(2) for thread in range(2)]
    for path in files:
        write_random(path, size // len(files))
    recorded = timed(lambda: write_trainer_state(ckpt, TrainerState(step=1, files=collect_digests(ckpt))))
    read = timed(read_all, files)
    verified = timed(lambda: start_verification(ckpt).check())
    one_thread = timed(lambda: [sha256_file(p) for p in files])
    gb = size / 1e9
    print(f"checkpoint, {gb:.2f} GB in {len(files)} files:")
    print(f"  read (peer)             {read / gb:6.2f} s/GB")
    print(f"  verify (threads)        {verified / gb:6.2f} s/GB  {verified / read:5.2f}x the read")
    print(f"  verify (one thread)     {one_thread / gb:6.2f} s/GB  {one_thread / read:5.2f}x the read")
    print(f"  record at commit        {recorded / gb:6.2f} s/GB  (what rank 0 pays for files no rank hashed)")


def bench_data(tmp: Path, size: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from mimir_megatron.data.manifest import write_manifest
    from mimir_megatron.data.prepared import hash_outputs, output_problems, shard_problems
    from mimir_megatron.integrity import sha256_file

    data = tmp / "prepared"
    (data / "shards").mkdir(parents=True)
    shards, per_shard = 4, size // 4 // 2  # uint16 tokens
    rng = np.random.default_rng(1)
    shard_entries: list[dict] = []
    outputs: dict[str, str] = {}
    for s in range(shards):
        prefix = data / "shards" / f"{s:05d}"
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
        documents, left = 0, per_shard
        while left > 0:
            n = min(left, 2048)
            builder.add_document(rng.integers(0, 50000, n, dtype=np.uint16), [n // 4, n - n // 4])
            documents, left = documents + 1, left - n
        builder.finalize(f"{prefix}.idx")
        shard_entries.append({"prefix": f"shards/{s:05d}", "documents": documents})
        for ext in ("bin", "idx"):
            outputs[f"shards/{s:05d}.{ext}"] = sha256_file(f"{prefix}.{ext}")
    manifest = write_manifest(data, {"documents": sum(e["documents"] for e in shard_entries),
                                     "tokens": {"total": shards * per_shard}, "dtype": "uint16",
                                     "tokenizer": {"sha256": "0" * 64}, "shards": shard_entries,
                                     "outputs": outputs})
    files = [data / rel for rel in manifest.outputs]
    gb = sum(p.stat().st_size for p in files) / 1e9
    read = timed(read_all, files)
    structural = timed(lambda: shard_problems(data, manifest))
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        def submit(path: Path):
            return pool.submit(sha256_file, path)

        verified = timed(lambda: output_problems(hash_outputs(data, manifest, submit)))
    print(f"prepared data, {gb:.2f} GB in {shards} shards:")
    print(f"  read (peer)             {read / gb:6.2f} s/GB")
    print(f"  sha256 (threads)        {verified / gb:6.2f} s/GB  {verified / read:5.2f}x the read")
    print(f"  structural checks       {structural * 1e3 / shards:6.2f} ms per shard (any size)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=0.5, help="GiB of prepared data (checkpoint: 2x)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    args = parser.parse_args()
    size = int(args.gib * 2**30)
    print(f"load: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        bench_checkpoint(Path(tmp), 2 * size)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        bench_data(Path(tmp), size)


if __name__ == "__main__":
    main()
