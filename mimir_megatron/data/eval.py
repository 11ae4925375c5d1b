"""Held-out samples for exact-match evaluation, as token ids rendered by `mimir prepare`."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from .prepared import PreparedDataset


class EvalSample(NamedTuple):
    """``prompt_ids`` ends with the generation prompt; ``completion_ids`` is the expected
    response including its end-of-turn token, so greedy decoding can stop on that token and
    compare the whole sequence."""

    prompt_ids: list[int]
    completion_ids: list[int]


def load_eval_samples(path: str | Path, limit: int | None = None) -> list[EvalSample]:
    """The documents of a prepared dataset (e.g. the demo's held-out split), in input order."""
    dataset = PreparedDataset(path)
    n = dataset.num_documents if limit is None else min(limit, dataset.num_documents)
    samples = []
    for i in range(n):
        prefix, response = dataset.document(i)
        samples.append(EvalSample(prefix.tolist(), response.tolist()))
    return samples
