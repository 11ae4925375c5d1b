"""Audit index benchmark: build tokens/s and peak memory, longest-match query latency.

    python bench/bench_audit_index.py                 # 200M tokens, Gemma-sized vocabulary
    python bench/bench_audit_index.py --tokens 5e6    # a quick look

Synthetic corpus: documents of 100-900 tokens drawn from a Zipf(1.2) distribution over 262,144
ids (so the two-symbol encoding of the production vocabulary is measured), with 10 % of the
documents verbatim copies of earlier ones (repeated data). Not a test: numbers depend on the
machine. Peak memory is the maximum resident set of this process and, separately, of the
suffix-array builder's subprocesses (ru_maxrss of the children).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PAPER_TOKENS = 70_479_308_606
VOCAB = 262_144


def write_corpus(root: Path, tokens: int, seed: int, docs_per_file: int = 50_000) -> Path:
    """A prepared dataset in `mimir prepare`'s layout, written through megatron's builder (its
    buffers filled a file at a time: per-document calls would dominate the benchmark)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from mimir_megatron.data.manifest import write_manifest

    rng = np.random.default_rng(seed)
    out = root / "corpus"
    (out / "shards").mkdir(parents=True)
    shards, written, n = [], 0, 0
    kept: list[np.ndarray] = []
    while written < tokens:
        prefix = f"shards/{n:05d}"
        builder = IndexedDatasetBuilder(str(out / f"{prefix}.bin"), dtype=np.int32)
        lengths = rng.integers(100, 900, docs_per_file)
        ids = ((rng.zipf(1.2, int(lengths.sum())) - 1) % VOCAB).astype(np.int32)
        docs = np.split(ids, np.cumsum(lengths)[:-1])
        for i in range(len(docs)):
            if kept and rng.random() < 0.1:  # a verbatim repeat of an earlier document
                docs[i] = kept[int(rng.integers(len(kept)))]
            elif len(kept) < 1000:
                kept.append(docs[i])
        lens = np.array([len(d) for d in docs])
        keep = int(np.searchsorted(np.cumsum(lens), tokens - written, side="left")) + 1
        docs, lens = docs[:keep], lens[:keep]
        builder.data_file.write(np.concatenate(docs).tobytes())
        split = np.maximum(1, lens // 4)
        builder.sequence_lengths.extend(np.stack([split, lens - split], axis=1).reshape(-1).tolist())
        builder.document_indices.extend(range(2, 2 * len(docs) + 1, 2))
        builder.finalize(str(out / f"{prefix}.idx"))
        written += int(lens.sum())
        shards.append({"prefix": prefix, "documents": len(docs)})
        n += 1
    write_manifest(out, {"documents": sum(s["documents"] for s in shards), "tokens": {"total": written},
                         "tokenizer": {"sha256": "synthetic"}, "dtype": "int32", "shards": shards,
                         "outputs": {f"{s['prefix']}.bin": f"seed{seed}-{i}" for i, s in enumerate(shards)}})
    return out


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def rss_gib(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 2**20


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values) * 1e3, q))


def build_and_query(root: Path, args) -> dict:
    from mimir_megatron.audits import AuditIndex, AuditSource, build_index

    t0 = time.perf_counter()
    corpus = write_corpus(root, int(args.tokens), seed=0)
    t_corpus = time.perf_counter() - t0
    baseline = rss_gib(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    cpu0 = cpu_seconds()
    build_index([AuditSource("corpus", corpus, "all")], root / "idx", shard_tokens=int(args.shard_tokens),
                mem_bytes=int(args.mem_gib * 2**30))
    t_build = time.perf_counter() - t0
    cpu_build = cpu_seconds() - cpu0
    index = AuditIndex(root / "idx")
    n_tokens = index.num_tokens
    index_bytes = sum(p.stat().st_size for p in (root / "idx").iterdir())
    tokens_per_s = n_tokens / t_build
    return {
        "tokens": n_tokens,
        "documents": index.num_documents,
        "encoding": index.encoding,
        "shards": len(index.metadata.shards),
        "corpus_write_s": round(t_corpus, 1),
        "build_s": round(t_build, 1),
        "build_tokens_per_s": round(tokens_per_s),
        "build_cpu_s": round(cpu_build, 1),
        "build_tokens_per_cpu_s": round(n_tokens / cpu_build),
        "index_bytes_per_token": round(index_bytes / n_tokens, 2),
        "rss_before_build_gib": round(baseline, 2),
        "peak_rss_self_gib": round(rss_gib(resource.RUSAGE_SELF), 2),
        "peak_rss_builder_gib": round(rss_gib(resource.RUSAGE_CHILDREN), 2),
        "paper_corpus_build_hours_at_this_rate": round(PAPER_TOKENS / tokens_per_s / 3600, 1),
        "paper_corpus_index_tb": round(PAPER_TOKENS * index_bytes / n_tokens / 1e12, 2),
        **query_latency(index, corpus, args),
    }


def query_latency(index, corpus: Path, args) -> dict:
    """Longest-match latency of single outputs, and the throughput of a batch on all cores."""
    from mimir_megatron.data.prepared import PreparedDataset

    rng = np.random.default_rng(1)
    ds = PreparedDataset(corpus)
    queries = []
    for i in range(args.queries):
        if i % 2:  # from the corpus: long matches (a memorised output)
            p, r = ds.document(int(rng.integers(ds.num_documents)))
            doc = np.concatenate([p, r])
            start = int(rng.integers(0, max(1, len(doc) - args.query_len)))
            queries.append(doc[start:start + args.query_len].tolist())
        else:  # fresh text from the same distribution: short matches
            queries.append(((rng.zipf(1.2, args.query_len) - 1) % VOCAB).tolist())
    index.match_lengths(queries[0])  # warm the page cache for the first pages
    latencies, cpu_latencies, longest = [], [], []
    for q in queries:
        t0, c0 = time.perf_counter(), time.process_time()
        _, length = index.longest_match(q)
        latencies.append(time.perf_counter() - t0)
        cpu_latencies.append(time.process_time() - c0)
        longest.append(length)
    t0 = time.perf_counter()
    index.longest_matches(queries)
    batch_s = time.perf_counter() - t0
    locate_lat = []
    for q in queries[1::2][:50]:
        t0 = time.perf_counter()
        index.locate(q[:50], limit=100)
        locate_lat.append(time.perf_counter() - t0)
    return {
        "query_len": args.query_len,
        "longest_match_p50_ms": round(percentile_ms(latencies, 50), 2),
        "longest_match_p99_ms": round(percentile_ms(latencies, 99), 2),
        "longest_match_cpu_p50_ms": round(percentile_ms(cpu_latencies, 50), 2),
        "longest_match_cpu_p99_ms": round(percentile_ms(cpu_latencies, 99), 2),
        "longest_matches_thread_pool_per_output_ms": round(1e3 * batch_s / len(queries), 2),
        "locate_p50_ms": round(percentile_ms(locate_lat, 50), 2),
        "median_longest_span": {"fresh": float(np.median(longest[0::2])),
                                "corpus": float(np.median(longest[1::2]))},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=200e6)
    parser.add_argument("--shard-tokens", type=float, default=1 << 30)
    parser.add_argument("--mem-gib", type=float, default=8)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--query-len", type=int, default=128)
    parser.add_argument("--dir", help="work directory (default: a temporary one)")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--index", help="only query this existing index (with --corpus)")
    parser.add_argument("--corpus", help="the prepared corpus of --index")
    args = parser.parse_args()

    from mimir_megatron.audits import AuditIndex

    if args.index:  # query an index built earlier (with its corpus)
        results = query_latency(AuditIndex(args.index), Path(args.corpus), args)
    else:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            results = build_and_query(Path(tmp), args)
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
