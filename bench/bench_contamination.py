"""Contamination audit benchmark: items/s, index lookups per item and CPU per lookup.

    python bench/bench_contamination.py                   # 20M-token index, demo + fixture suites
    python bench/bench_contamination.py --tokens 2e6      # a quick look

Corpus: real token sequences of the demo tokenizer (documents `mimir data demo` generates,
tokenised as `mimir prepare` does), cut into documents of 100-900 tokens at random offsets until
--tokens are reached, so n-gram statistics are those of text and common runs repeat thousands of
times. Suites: the demo's (600 items generated like the training documents: long shared runs, the
contaminated case) and the paper's English, Danish and math/code suites on `mimir eval-fixtures`
rows (made-up text: the clean case). Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def write_corpus(root: Path, tokens: int, seed: int) -> Path:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from mimir_data_prep.demo_data import generate
    from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR

    from mimir_megatron.chat import ChatRenderer, tokenizer_sha256
    from mimir_megatron.data.manifest import write_manifest

    renderer = ChatRenderer(DEMO_TOKENIZER_DIR)
    train, _ = generate(seed)
    pool = []
    for samples in train.values():
        for s in samples[:2000]:
            prefix, response = renderer.tokenize([{"role": "user", "content": s.prompt},
                                                  {"role": "assistant", "content": s.completion}])
            pool += prefix + response
    stream = np.array(pool, dtype=np.uint16)
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(100, 900)))
    starts = rng.integers(0, stream.size - 900, len(lengths))
    out = root / "corpus"
    (out / "shards").mkdir(parents=True)
    builder = IndexedDatasetBuilder(str(out / "shards/00000.bin"), dtype=np.uint16)
    builder.data_file.write(np.concatenate([stream[s:s + n] for s, n in zip(starts, lengths)]).tobytes())
    split = [max(1, n // 4) for n in lengths]
    builder.sequence_lengths.extend([x for s, n in zip(split, lengths) for x in (s, n - s)])
    builder.document_indices.extend(range(2, 2 * len(lengths) + 1, 2))
    builder.finalize(str(out / "shards/00000.idx"))
    tokenizer = {"path": str(DEMO_TOKENIZER_DIR), "sha256": tokenizer_sha256(DEMO_TOKENIZER_DIR)}
    write_manifest(out, {"documents": len(lengths), "tokens": {"total": sum(lengths)}, "tokenizer": tokenizer,
                         "dtype": "uint16", "shards": [{"prefix": "shards/00000", "documents": len(lengths)}],
                         "outputs": {}})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=float, default=20e6)
    p.add_argument("--index", help="reuse this index (built by an earlier run)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--limit", type=int, default=40, help="items per task")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    from mimir_megatron.process import setup_process

    setup_process(megatron=True)
    from mimir_data_prep.demo_data import write_demo
    from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR

    from mimir_megatron.audits import AuditIndex, AuditSource, build_index
    from mimir_megatron.audits.contamination import ContaminationSettings, run_contamination
    from mimir_megatron.evaluation.fixtures import write_fixtures
    from mimir_megatron.evaluation.suite import load_suite

    work = Path(tempfile.mkdtemp(prefix="bench_contamination_"))
    if args.index:
        index = AuditIndex(args.index)
    else:
        started = time.perf_counter()
        corpus = write_corpus(work, int(args.tokens), args.seed)
        index = AuditIndex(build_index([AuditSource("corpus", corpus, "A")], work / "idx", progress=False))
        print(f"index {index.path}: {index.num_documents:,} documents, {index.num_tokens:,} tokens, "
              f"built in {time.perf_counter() - started:.0f} s")
    write_demo(work / "demo", args.seed, 10, 100)
    fixtures = write_fixtures(work / "fixtures", rows_per_split=args.limit)
    suites = [(load_suite(REPO / "configs/eval/demo.yaml"), work / "demo")]
    suites += [(load_suite(REPO / f"configs/eval/{name}.yaml"), fixtures)
               for name in ("mimir_en", "mimir_da", "mimir_math_code")]
    rows = []
    for workers in args.workers:
        for suite, data_dir in suites:
            settings = ContaminationSettings(limit=args.limit, workers=workers)
            cpu, wall = os.times(), time.perf_counter()
            results = run_contamination(index, suite, data_dir, str(DEMO_TOKENIZER_DIR), settings,
                                        progress=False)
            wall, after = time.perf_counter() - wall, os.times()
            cpu_s = (after.user + after.system) - (cpu.user + cpu.system)
            items = [r for b in results for r in b.items]
            lookups = sum(r.lookups for r in items)
            dirty = sum(r.contaminated(settings.ngram) for r in items)
            rows.append({"suite": suite.name, "workers": workers, "items": len(items), "contaminated": dirty,
                         "items/s": round(len(items) / wall, 2), "CPU s/item": round(cpu_s / len(items), 4),
                         "lookups/item": round(lookups / len(items)),
                         "CPU us/lookup": round(1e6 * cpu_s / lookups)})
            print(rows[-1], flush=True)
    print(f"load average {os.getloadavg()}, index {index.num_tokens:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
