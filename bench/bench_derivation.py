"""How much `mimir prepare` spends measuring whether a dataset derived from agreement data copies it
(mimir_data_prep.derivation.verbatim_copies), against reading the same records alone (its peer:
the read stage every measurement needs).

    python bench/bench_derivation.py [--parent-docs 20000] [--child-docs 5000]

Generated documents of 120 words (two 60-word messages over a 5,000-word vocabulary): a parent
file, a child of new documents (no copies) and a child of the parent's first documents, a quarter
of them with one word changed (all copies). Prints CPU seconds for each (this process's: the
check is single-threaded, and a shared machine's wall clock says more about the neighbours), the
ratio to the peer, and the verdicts.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from mimir_data_prep.derivation import _documents, _parent_documents, verbatim_copies
from mimir_data_prep.layouts import decide_layouts
from mimir_data_prep.settings import PrepareSettings
from mimir_data_prep.shards import plan_shards

from mimir_megatron.data.provenance import Parent, Provenance


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _tasks(path: Path):
    tasks = plan_shards([path])
    formats = decide_layouts(tasks, "auto", {})
    return [replace(t, layout=formats[t.path]["format"]) for t in tasks]


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--parent-docs", type=int, default=20000)
    args.add_argument("--child-docs", type=int, default=5000)
    opts = args.parse_args()
    rng = random.Random(0)
    words = [f"w{i}" for i in range(5000)]

    def line() -> str:
        return json.dumps({"prompt": " ".join(rng.choices(words, k=60)),
                           "completion": " ".join(rng.choices(words, k=60))})

    settings = PrepareSettings(tokenizer_dir="", tokenizer_sha256="")
    with tempfile.TemporaryDirectory() as tmp:
        parent = _write(Path(tmp) / "parent.jsonl", [line() for _ in range(opts.parent_docs)])
        copied = [text.replace(" w", " x", 1) if i % 4 == 0 else text
                  for i, text in enumerate(parent.read_text().splitlines()[:opts.child_docs])]
        fresh = [line() for _ in range(opts.child_docs)]
        children = {"new documents": _write(Path(tmp) / "new.jsonl", fresh),
                    "copies": _write(Path(tmp) / "copies.jsonl", copied)}
        record = Provenance(id="child", source="s", license="CC-BY-4.0", basis="synthetic",
                            form="synthetic-audited", derived_from=(Parent(
                                "partner", "0" * 64, "proprietary-agreement", "agreement", "s", "CC-BY-4.0",
                                str(parent.resolve())),))
        print(f"parent: {opts.parent_docs:,} documents, {parent.stat().st_size / 1e6:.1f} MB; "
              f"child: {opts.child_docs:,} documents")
        for name, child in children.items():
            started = time.process_time()
            read = sum(1 for _ in _documents(_tasks(child), settings))
            read += sum(1 for _ in _parent_documents(parent, settings))
            peer = time.process_time() - started
            started = time.process_time()
            verdict = verbatim_copies(_tasks(child), settings, record, opts.child_docs)
            seconds = time.process_time() - started
            print(f"{name}: {seconds:.2f} CPU-s, {seconds / peer:.2f}x reading the {read:,} records alone "
                  f"({peer:.2f} CPU-s); {'refused: ' + verdict[0] if verdict else 'accepted'}")


if __name__ == "__main__":
    main()
