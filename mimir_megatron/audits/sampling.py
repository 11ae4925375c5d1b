"""Seeded choice of audit probes: prefixes of training documents, and (prefix, continuation)
windows, per audit category. A document is its prefix followed by its response."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from mimir_megatron.errors import UserError

from .sources import AuditSource


@dataclass(frozen=True)
class Probe:
    """A prompt cut from a training document, and what follows it there."""

    category: str
    source: str
    document: int
    offset: int
    prompt_ids: list[int]
    continuation_ids: list[int]
    prompt_in_document_prompt: int = 0
    """How many leading ``prompt_ids`` lay in the document's prompt (its prefix): the tokens
    that attended bidirectionally in training; the rest of the window was causal there."""


class CategoryDocuments:
    """The documents of every source of one audit category, numbered consecutively."""

    def __init__(self, sources: list[AuditSource], category: str) -> None:
        from mimir_megatron.data.prepared import PreparedDataset

        self.category = category
        self.sources = [s for s in sources if s.category == category]
        if not self.sources:
            known = sorted({s.category for s in sources})
            raise UserError(f"audit category {category!r} has no datasets; known: {', '.join(known)}")
        self.datasets = [PreparedDataset(s.path) for s in self.sources]

    @cached_property
    def lengths(self) -> np.ndarray:
        """Tokens per document, over all sources in order."""
        return np.concatenate([(d.prefix_lengths + d.response_lengths).astype(np.int64)
                               for d in self.datasets])

    @cached_property
    def prompt_lengths(self) -> np.ndarray:
        """Tokens of each document's prompt (prefix), over all sources in order."""
        return np.concatenate([d.prefix_lengths.astype(np.int64) for d in self.datasets])

    def prompt_part(self, index: int, offset: int, length: int) -> int:
        """How many of the ``length`` tokens from ``offset`` of document ``index`` lie in its prompt."""
        return int(min(max(int(self.prompt_lengths[index]) - offset, 0), length))

    @cached_property
    def _starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([d.num_documents for d in self.datasets])])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def tokens(self, index: int) -> tuple[str, int, np.ndarray]:
        """(source name, document within the source, prefix+response ids) of document ``index``."""
        k = int(np.searchsorted(self._starts, index, side="right") - 1)
        local = int(index - self._starts[k])
        prefix, response = self.datasets[k].document(local)
        return self.sources[k].name, local, np.concatenate([prefix, response])


def _rng(seed: int, category: str, protocol: str) -> np.random.Generator:
    # one stream per (seed, category, protocol): adding a category does not move the others
    return np.random.default_rng([seed, zlib.crc32(category.encode()), zlib.crc32(protocol.encode())])


def sample_prefixes(docs: CategoryDocuments, n: int, prefix_len: int, seed: int,
                    position: str = "start") -> list[Probe]:
    """``n`` distinct documents with more than ``prefix_len`` tokens; the prompt is their first
    ``prefix_len`` tokens (``position='start'``) or a seeded window (``'random'``)."""
    rng = _rng(seed, docs.category, "prefix")
    eligible = np.flatnonzero(docs.lengths > prefix_len)
    chosen = np.sort(rng.choice(eligible, size=min(n, eligible.size), replace=False))
    probes = []
    for index in chosen:
        source, local, ids = docs.tokens(int(index))
        offset = 0 if position == "start" else int(rng.integers(0, len(ids) - prefix_len))
        probes.append(Probe(docs.category, source, local, offset, ids[offset:offset + prefix_len].tolist(),
                            ids[offset + prefix_len:].tolist(),
                            docs.prompt_part(int(index), offset, prefix_len)))
    return probes


def sample_windows(docs: CategoryDocuments, n: int, prefix_len: int, continuation_len: int,
                   seed: int) -> list[Probe]:
    """``n`` distinct (document, offset) windows of prefix_len + continuation_len tokens, drawn
    uniformly over every such window in the category (long documents give more windows)."""
    rng = _rng(seed, docs.category, "continuation")
    span = prefix_len + continuation_len
    windows = np.maximum(docs.lengths - span + 1, 0)
    cumulative = np.cumsum(windows)
    total = int(cumulative[-1]) if cumulative.size else 0
    if total == 0:
        return []
    picks = np.sort(rng.choice(total, size=min(n, total), replace=False))
    doc_of = np.searchsorted(cumulative, picks, side="right")
    probes = []
    for pick, index in zip(picks, doc_of):
        offset = int(pick - (cumulative[index] - windows[index]))
        source, local, ids = docs.tokens(int(index))
        probes.append(Probe(docs.category, source, local, offset, ids[offset:offset + prefix_len].tolist(),
                            ids[offset + prefix_len:offset + span].tolist(),
                            docs.prompt_part(int(index), offset, prefix_len)))
    return probes
