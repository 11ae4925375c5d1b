"""A small two-dataset mixture of prepared token files (data loader and epoch tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from audit_support import write_prepared


def documents_by_epoch(stream, epochs: int) -> list[list[tuple[int, ...]]]:
    """Per epoch, the document ids of each context of ``stream`` (a PackedMixture), walked
    through the global sample stream."""
    out: list[list[tuple[int, ...]]] = [[] for _ in range(epochs)]
    sample = 0
    while (epoch := stream.locate(sample)[0]) < epochs:
        out[epoch].append(tuple(int(d) for d in stream.context_documents(sample)))
        sample += 1
    return out


def make_mixture(tmp_path: Path, n_docs: int = 60, repeat_b: float = 2) -> Path:
    rng = np.random.default_rng(0)
    datasets = {}
    for name, base in (("a", 100), ("b", 500)):
        docs = []
        for i in range(n_docs):
            p, r = int(rng.integers(1, 12)), int(rng.integers(2, 10))
            # Token ids encode (dataset, document) so tests can tell samples apart.
            docs.append(([base + i] * p, [base + i] * r))
        datasets[name] = write_prepared(tmp_path / name, docs)
    mixture = tmp_path / "mix.yaml"
    mixture.write_text(
        "name: t\ndatasets:\n"
        "  - {path: a, category: A, language: en, repeat: 1}\n"
        f"  - {{path: b, category: B, language: da, repeat: {repeat_b}}}\n"
    )
    return mixture
