"""Data pipeline benchmark: `mimir prepare` tokens/s per worker, and packing-index build time and
peak memory for a 103B-token mixture with synthetic document lengths.

    python bench/bench_data.py            # full: 103,214,604,702 tokens (several minutes)
    python bench/bench_data.py --small    # 1B tokens, a few seconds
    python bench/bench_data.py --against-tokenizer [--small] [--split] [--repeat N]  # vs encode_batch

Not a test: numbers depend on the machine. Peak memory is the process's maximum resident set
size, read after each phase (it includes the Python/torch baseline, printed first).
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MIMIR_V15_TOKENS = 103_214_604_702
N_DATASETS = 161


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def write_corpus(path: Path, documents: int, seed: int = 0) -> None:
    """Multi-turn conversations of about 400 tokens built from the bundled demo texts."""
    import json
    import random

    from mimir_data_prep.demo_data import TEXT_FILES

    rng = random.Random(seed)
    paragraphs = [p for f in TEXT_FILES.values() for p in f.read_text().split("\n\n") if p]
    with path.open("w") as out:
        for _ in range(documents):
            messages = [{"role": "system", "content": "You are a helpful assistant."}]
            for _ in range(3):
                messages.append({"role": "user", "content": rng.choice(paragraphs)})
                messages.append({"role": "assistant", "content": rng.choice(paragraphs)})
            out.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")


def bench_prepare(documents: int, workers: list[int], tokenizer: str | None) -> None:
    from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR
    from mimir_data_prep.prepare import prepare

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        write_corpus(corpus, documents)
        size_mib = corpus.stat().st_size / 2**20
        for n in workers:
            start = time.perf_counter()
            m = prepare(
                [corpus],
                tokenizer or DEMO_TOKENIZER_DIR,
                Path(tmp) / f"out{n}",
                seq_len=4096,
                workers=n,
                shard_bytes=max(1, corpus.stat().st_size // (4 * n)),
                progress=False,
            )
            dt = time.perf_counter() - start
            tok = m.tokens_total
            print(
                f"prepare: {m.documents:,} docs, {tok:,} tokens, {size_mib:.1f} MiB JSONL, "
                f"{n} worker(s): {dt:.1f} s, {tok / dt:,.0f} tokens/s total, "
                f"{tok / dt / n:,.0f} tokens/s per worker, {m.documents / dt:,.0f} docs/s "
                "(includes worker start-up)"
            )


def stage_clock():
    """CPU seconds per stage of `mimir prepare` (one worker, in this process): the stages'
    functions wrapped with process-time accumulators; 'rest' (the loop, the garbage collector) is
    the total less the stages. Returns the accumulators (filled as prepare runs)."""
    import mimir_data_prep.shard_writer as writer

    from mimir_megatron.chat import ChatRenderer

    spent: dict[str, float] = {}

    def clocked(owner, name: str, stage: str, generator: bool = False) -> None:
        inner = getattr(owner, name)

        def call(*args, **kwargs):
            start = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[stage] = spent.get(stage, 0.0) + time.process_time() - start

        def iterate(*args, **kwargs):
            items = inner(*args, **kwargs)
            while True:
                start = time.process_time()
                try:
                    item = next(items)
                except StopIteration:
                    return
                finally:
                    spent[stage] = spent.get(stage, 0.0) + time.process_time() - start
                yield item

        setattr(owner, name, iterate if generator else call)

    clocked(writer, "read_records", "read", generator=True)
    clocked(writer, "screen_text", "screen")
    clocked(writer, "screen_tokens", "screen")
    clocked(writer, "render_texts", "template")
    clocked(ChatRenderer, "encode_batch", "encode")
    for name in ("_accept", "_reject"):
        clocked(writer._ShardFill, name, "write")
    clocked(writer, "fit_document", "write")
    clocked(writer, "sha256_file", "write")
    return spent


def bench_against_tokenizer(documents: int, tokenizer: str | None, split: bool = False,
                            repeat: int = 1) -> None:
    """`mimir prepare` on one worker against the tokenizer's own `encode_batch` of the same texts
    (the rendered prefix and response of every conversation, one thread): the ratio is how close
    preparation comes to tokenizing alone; a second line against `encode_batch_fast` (no offsets,
    the call prepare makes). ``split``: prepare's CPU time per stage, measured in a second run (the
    clocks cost time of their own). ``repeat``: each of the three measured that many times in turn,
    the least wall and CPU time of each kept (the load of a shared machine only adds time)."""
    import json
    import os

    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # encode_batch on one core, as one worker
    from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR
    from mimir_data_prep.prepare import prepare

    from megatron.core.datasets import indexed_dataset  # noqa: F401 (imported before the clock starts)

    from mimir_megatron.chat import ChatRenderer

    tok_dir = tokenizer or DEMO_TOKENIZER_DIR
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        write_corpus(corpus, documents)
        renderer = ChatRenderer(tok_dir)
        texts = []
        for line in corpus.read_text().splitlines():
            prefix, response = renderer.render(json.loads(line)["messages"])
            texts += [prefix, response]
        backend = renderer.tokenizer.backend_tokenizer
        best: dict[str, tuple[float, float]] = {}  # (wall s, CPU s), each the least of the repeats

        def clock(name: str, run):
            start, cpu = time.perf_counter(), time.process_time()
            result = run()
            took = (time.perf_counter() - start, time.process_time() - cpu)
            best[name] = tuple(map(min, zip(best.get(name, took), took)))
            return result

        for i in range(repeat):
            tokens = clock("encode", lambda: sum(
                len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)))
            # the second peer: the offset-free call prepare itself makes (ChatRenderer.encode_batch)
            fast_tokens = clock("fast", lambda: sum(
                len(e.ids) for e in backend.encode_batch_fast(texts, add_special_tokens=False)))
            m = clock("prepare", lambda: prepare([corpus], tok_dir, Path(tmp) / f"out{i}", seq_len=4096,
                                                 workers=1, progress=False))
        (encode_s, encode_cpu), (fast_s, fast_cpu) = best["encode"], best["fast"]
        prepare_s, prepare_cpu = best["prepare"]
        if split:
            spent = stage_clock()
            cpu = time.process_time()
            prepare([corpus], tok_dir, Path(tmp) / "split", seq_len=4096, workers=1, progress=False)
            total = time.process_time() - cpu
            spent["rest"] = total - sum(spent.values())
    assert m.tokens_total == tokens == fast_tokens, (m.tokens_total, tokens, fast_tokens)
    # CPU seconds as well as wall seconds: on a shared machine the load moves the wall-clock ratio.
    print(f"tokenizer encode_batch (1 thread): {tokens / encode_s:,.0f} tokens/s; mimir prepare (1 worker, "
          f"read + screen + render + encode + write): {tokens / prepare_s:,.0f} tokens/s; ratio "
          f"{encode_s / prepare_s:.2f}x wall, {encode_cpu / prepare_cpu:.2f}x CPU "
          f"({encode_cpu:.2f} against {prepare_cpu:.2f} CPU-s; {documents:,} conversations, "
          f"{tokens:,} tokens; the least of {repeat} run(s) each)")
    print(f"second peer, encode_batch_fast (1 thread, no offsets): {tokens / fast_s:,.0f} tokens/s; ratio "
          f"{fast_s / prepare_s:.2f}x wall, {fast_cpu / prepare_cpu:.2f}x CPU ({fast_cpu:.2f} CPU-s)")
    if split:
        print(f"prepare's CPU time by stage ({total:.2f} CPU-s, a second run, clocked): " + ", ".join(
            f"{stage} {100 * s / total:.0f} %" for stage, s in sorted(spent.items(), key=lambda kv: -kv[1])))


def synthetic_mixture(total_tokens: int, seed: int = 0):
    """Per-dataset document lengths (int32) and repeat factors summing to ``total_tokens``."""
    rng = np.random.default_rng(seed)
    shares = rng.dirichlet(np.full(N_DATASETS, 0.7))
    repeats = np.ones(N_DATASETS)
    repeats[rng.choice(N_DATASETS, 12, replace=False)] = rng.choice([4, 10, 20], 12)
    means = rng.uniform(150, 2500, N_DATASETS)
    lengths, counts = [], []
    for share, repeat, mean in zip(shares, repeats, means):
        sigma = 0.9
        mu = np.log(mean) - sigma**2 / 2
        pilot = np.clip(rng.lognormal(mu, sigma, 10_000), 3, 4096).astype(np.int32).mean()
        n = max(1, int(share * total_tokens / repeat / pilot))  # clipping lowers the mean
        lens = np.clip(rng.lognormal(mu, sigma, n), 3, 4096).astype(np.int32)
        lengths.append(lens)
        counts.append(n)
    return np.concatenate(lengths), counts, repeats.tolist()


def bench_index(total_tokens: int, seq_len: int, window: int) -> None:
    from mimir_megatron.data.packing import build_epoch_index, padding_fraction

    print(f"baseline peak RSS: {peak_rss_gib():.2f} GiB")
    start = time.perf_counter()
    lengths, counts, repeats = synthetic_mixture(total_tokens)
    epoch_tokens = sum(
        int(lengths[s : s + c].sum()) * int(r)
        for s, c, r in zip(np.concatenate([[0], np.cumsum(counts)[:-1]]), counts, repeats)
    )
    print(
        f"synthetic mixture: {N_DATASETS} datasets, {len(lengths):,} documents, "
        f"{epoch_tokens:,} tokens per epoch ({time.perf_counter() - start:.1f} s to generate)"
    )
    start, cpu = time.perf_counter(), time.process_time()
    index = build_epoch_index(
        lengths, counts, repeats, seq_len=seq_len, seed=1234, epoch=0, window=window
    )
    dt, cpu = time.perf_counter() - start, time.process_time() - cpu
    pad = padding_fraction(index, lengths, seq_len)
    print(
        f"packing index (seq_len {seq_len}, window {window}): {index.num_contexts:,} contexts, "
        f"{len(index.docs):,} samples, padding {100 * pad:.2f} %, built in {dt:.1f} s ({cpu:.1f} CPU-s, "
        f"{cpu / max(len(index.docs), 1) * 1e6:.2f} µs a sample), "
        f"peak RSS {peak_rss_gib():.2f} GiB, index on disk "
        f"{(index.docs.nbytes + index.offsets.nbytes) / 2**30:.2f} GiB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="1B tokens and a small corpus")
    parser.add_argument("--tokens", type=int, default=None, help="mixture tokens per epoch")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--window", type=int, default=16384)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizer", default=None, help="default: the demo tokenizer")
    parser.add_argument("--skip-prepare", action="store_true")
    parser.add_argument("--skip-index", action="store_true")
    parser.add_argument("--against-tokenizer", action="store_true",
                        help="only: mimir prepare against the tokenizer's encode_batch on the same texts")
    parser.add_argument("--split", action="store_true",
                        help="with --against-tokenizer: prepare's CPU time per stage (read, screen, "
                             "template, encode, write, rest)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="with --against-tokenizer: measure each side this many times, keep the least")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.against_tokenizer:
        bench_against_tokenizer(2000 if args.small else 20000, args.tokenizer, args.split, args.repeat)
        return 0
    if not args.skip_prepare:
        bench_prepare(2000 if args.small else 40000, args.workers, args.tokenizer)
    if not args.skip_index:
        tokens = args.tokens or (1_000_000_000 if args.small else MIMIR_V15_TOKENS)
        bench_index(tokens, args.seq_len, args.window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
