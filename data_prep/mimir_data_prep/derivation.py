"""What `mimir prepare` checks of a declaration against the data it describes.

- **A file's own declaration is its record.** An input that carries a provenance sidecar
  (``mimir data declare``, a pipeline's output) is described by it; a declaration given beside it
  (command line, prepare YAML) must agree: the same basis, and a licence that keeps the sidecar's
  terms (it may add terms, never drop one). Otherwise the dataset is refused, naming both
  (:func:`sidecar_conflicts`).
- **A derivation transforms.** Data derived from agreement-supplied data may be trained on (the
  paper's route: the agreement data itself never is), so a "derived" dataset whose documents are
  largely verbatim copies of its agreement parent's would launder the parent. Each document is
  compared with the parent by word n-grams (the contamination audit's measure, on words: the
  parent may be a raw file in another layout): a document most of whose n-grams occur in the
  parent is a copy, and a dataset most of whose checked documents are copies is refused as a
  derivation (:func:`verbatim_copies`). Only parents of basis ``agreement`` are measured (a copy
  of open data keeps its terms and launders nothing); the parent is read once, up to
  :data:`SAMPLE` of the child's documents are checked.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from mimir_megatron.data.licences import dropped_terms
from mimir_megatron.data.manifest import MANIFEST_NAME, Manifest
from mimir_megatron.data.provenance import UNKNOWN, Provenance, read_provenance, sidecar_path
from mimir_megatron.errors import UserError

from .layouts import decide_layouts
from .read import read_records
from .records import Conversation
from .settings import PrepareSettings
from .shards import ShardTask, plan_shards

log = logging.getLogger(__name__)

NGRAM = 8
"""Words per n-gram (a document of fewer words is one n-gram: the whole of it)."""
COPIED_NGRAMS = 0.5
"""A document is a copy when at least this share of its n-grams occur in the parent."""
COPIED_DOCUMENTS = 0.5
"""A derivation is refused when at least this share of its checked documents are copies."""
SAMPLE = 2000
"""Documents of the derived dataset checked (spread evenly over it)."""

_WORD = re.compile(r"\w+")


def sidecar_conflicts(paths: Iterable[Path], provenance: Provenance | None) -> list[str]:
    """Inputs whose own record (a provenance sidecar) the declaration ``provenance`` contradicts,
    one line each naming both: another basis, or a licence that drops a term of the sidecar's."""
    if provenance is None:
        return []
    problems = []
    for path in paths:
        stored = read_provenance(path)
        own = None if stored is None else stored.provenance
        if own is None:
            continue
        differs = []
        if own.basis != provenance.basis:
            differs.append(f"basis {own.basis}, declared {provenance.basis}")
        dropped = dropped_terms(provenance.license, own.license) if own.license != UNKNOWN else []
        if dropped:
            differs.append(f"licence {own.license}, declared {provenance.license} "
                           f"(drops {', '.join(dropped)})")
        if differs:
            problems.append(f"{path}: its own record {sidecar_path(path)} says {'; '.join(differs)}: a "
                            "file's declaration is its record; prepare it without a declaration (the "
                            "sidecar's is taken), or declare the file again (mimir data declare)")
    return problems


def verbatim_copies(tasks: list[ShardTask], settings: PrepareSettings, provenance: Provenance | None,
                    lines: int) -> list[str]:
    """Agreement parents of which the dataset (its input ``tasks``, ``lines`` lines in all) is
    largely a verbatim copy, one line each."""
    parents = [p for p in (provenance.derived_from if provenance else ())
               if p.basis == "agreement" and p.path]
    if not parents:
        return []
    stride = max(1, -(-lines // SAMPLE))
    documents = [d for i, d in enumerate(_documents(tasks, settings)) if i % stride == 0]
    sample = _NgramSample(documents)
    problems = []
    for parent in parents:
        texts = _parent_documents(Path(parent.path), settings)
        if texts is None:
            log.warning("derived_from %s: its data is not on disk: whether this dataset copies it is not "
                        "measured", parent.id)
            continue
        copies, checked = sample.copies(texts)
        if checked and copies / checked >= COPIED_DOCUMENTS:
            problems.append(f"derived_from {parent.id}: {copies:,} of {checked:,} documents checked "
                            f"({100 * copies / checked:.0f} %) are verbatim copies of {parent.id}'s "
                            f"({NGRAM}-word n-grams): data derived from agreement data must transform it "
                            "(generated, translated, a derived task), not copy it")
    return problems


def _documents(tasks: list[ShardTask], settings: PrepareSettings) -> Iterator[str]:
    """The text of every readable record of ``tasks`` (their layouts decided)."""
    for task in tasks:
        for _, record, _ in read_records(task, settings):
            if isinstance(record, Conversation):
                yield "\n".join(_strings(record.messages) + _strings(record.tools or []))


def _strings(value: Any) -> list[str]:
    """Every string of a JSON value but the roles (what a copy would keep)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() if k != "role" for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _parent_documents(path: Path, settings: PrepareSettings) -> Iterator[str] | None:
    """The parent's documents as text: a data file's records, or a prepared dataset's input files
    (read in the layout it recorded for each); None where they are not on disk."""
    read = replace(settings, input_format="auto", columns=(), control_chars="strip")
    if path.is_file():
        tasks = plan_shards([path])
        formats = decide_layouts(tasks, "auto", {})
        return _documents([replace(t, layout=formats[t.path]["format"]) for t in tasks], read)
    if not (path / MANIFEST_NAME).is_file():
        return None
    manifest = Manifest.read(path)
    files = [Path(s.path) for s in manifest.sources]
    if not files or not all(f.is_file() for f in files):
        return None
    columns = manifest.content.get("settings", {}).get("columns") or {}
    read = replace(read, columns=tuple(sorted(columns.items())))
    tasks = [replace(t, layout=(manifest.input_formats.get(t.path) or {}).get("format", "messages"))
             for t in plan_shards(files)]
    return _documents(tasks, read)


class _NgramSample:
    """The word n-grams of a sample of documents, and which of them other texts hold. Words are
    numbered by Python's string hash (the same within the process, which is all a comparison
    needs); an n-gram's hash is a weighted sum of its words' (the denylist's rule, on words)."""

    BATCH = 1024
    """Documents hashed together (one numpy pass, one lookup)."""

    def __init__(self, documents: list[str]) -> None:
        rng = np.random.default_rng(0)
        self.weights = rng.integers(1, 2**62, size=NGRAM, dtype=np.uint64) | np.uint64(1)
        flat, self.owner = self._hashes(documents)
        self.hashes, self.index = np.unique(flat, return_inverse=True)
        self.documents = len(documents)
        self.counts = np.bincount(self.owner, minlength=self.documents)

    def _hashes(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(the n-gram hashes of ``texts``, the text each belongs to). A text of fewer than NGRAM
        words is one n-gram: all of it."""
        words = [_WORD.findall(text.casefold()) for text in texts]
        lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(texts))
        total = int(lengths.sum())
        ids = np.fromiter(map(hash, chain.from_iterable(words)), dtype=np.int64, count=total).view(np.uint64)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        hashes, owners = [np.zeros(0, dtype=np.uint64)], [np.zeros(0, dtype=np.int64)]
        if total >= NGRAM:  # every window of the concatenation, then those inside one text
            windows = total - NGRAM + 1
            summed = np.full(windows, NGRAM, dtype=np.uint64)
            for k in range(NGRAM):
                summed += ids[k:k + windows] * self.weights[k]
            owner = np.repeat(np.arange(len(texts)), lengths)[:windows]
            inside = np.arange(windows) + NGRAM <= ends[owner]
            hashes.append(summed[inside])
            owners.append(owner[inside])
        for t in np.nonzero((lengths > 0) & (lengths < NGRAM))[0].tolist():
            n = int(lengths[t])
            whole = (ids[starts[t]:ends[t]] * self.weights[:n]).sum(dtype=np.uint64, keepdims=True)
            hashes.append(whole + np.uint64(n))
            owners.append(np.array([t]))
        return np.concatenate(hashes), np.concatenate(owners)

    def copies(self, texts: Iterable[str]) -> tuple[int, int]:
        """(documents of the sample that are copies of ``texts``, documents with n-grams)."""
        found = np.zeros(len(self.hashes), dtype=bool)
        batch: list[str] = []

        def mark() -> None:
            hashes, _ = self._hashes(batch)
            batch.clear()
            if len(hashes) and len(self.hashes):
                at = np.minimum(np.searchsorted(self.hashes, hashes), len(self.hashes) - 1)
                found[at[self.hashes[at] == hashes]] = True

        for text in texts:
            batch.append(text)
            if len(batch) >= self.BATCH:
                mark()
        if batch:
            mark()
        shared = np.bincount(self.owner, weights=found[self.index], minlength=self.documents)
        measured = self.counts > 0
        copies = int(((shared >= COPIED_NGRAMS * self.counts) & measured).sum())
        return copies, int(measured.sum())


def check_declaration(tasks: list[ShardTask], paths: list[Path], settings: PrepareSettings,
                      provenance: Provenance | None, lines: int) -> None:
    """Refuse (one :class:`UserError` listing every line) a declaration its inputs contradict or
    a derivation that copies its agreement parent."""
    problems = sidecar_conflicts(paths, provenance) + verbatim_copies(tasks, settings, provenance, lines)
    if problems:
        raise UserError("; ".join(problems))
