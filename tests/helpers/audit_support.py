"""Helpers shared by the audit tests: prepared datasets written from explicit token ids."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np


@lru_cache(maxsize=1)
def demo_tokenizer() -> dict:
    """The manifest's tokenizer record of the demo tokenizer (whose 1,024 ids the tests use)."""
    from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR

    from mimir_megatron.chat import tokenizer_sha256

    return {"path": str(DEMO_TOKENIZER_DIR), "sha256": tokenizer_sha256(DEMO_TOKENIZER_DIR)}


def write_prepared(path: Path, docs: list[tuple[list[int], list[int]]], dtype=np.uint16,
                   docs_per_file: int | None = None, tokenizer: dict | None = None) -> Path:
    """A prepared dataset in `mimir prepare`'s layout (one or more shard files) from token ids,
    recorded as prepared with ``tokenizer`` (default: the demo tokenizer, as `mimir data demo`)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    (path / "shards").mkdir(parents=True)
    per_file = docs_per_file or max(1, len(docs))
    shards, outputs = [], {}
    for n, first in enumerate(range(0, len(docs), per_file)):
        part = docs[first:first + per_file]
        prefix = f"shards/{n:05d}"
        builder = IndexedDatasetBuilder(str(path / f"{prefix}.bin"), dtype=dtype)
        for p, r in part:
            builder.add_document(np.array(p + r, dtype=np.int64), lengths=[len(p), len(r)])
        builder.finalize(str(path / f"{prefix}.idx"))
        shards.append({"prefix": prefix, "documents": len(part)})
        outputs[f"{prefix}.bin"] = str(hash(tuple(map(tuple, sum(part, ())))))
    manifest = {
        "format": "mimir-prepared-v1",
        "documents": len(docs),
        "tokens": {"total": sum(len(p) + len(r) for p, r in docs)},
        "tokenizer": tokenizer or demo_tokenizer(),
        "shards": shards,
        "outputs": outputs,
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path
