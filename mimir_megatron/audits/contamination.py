"""`mimir audit contamination`: every item of an evaluation suite against the training data's index.

**What is checked.** Each item's benchmark text as the suite's loader reads it
(:func:`mimir_megatron.evaluation.prompts.benchmark_texts`): the row values its prompt shows (the
template's fields, the options) joined by newlines, and each reference answer of a free-generation
task as the row writes it. The suite's own wording (prompt template, instruction, option letters,
shots) is left out: a training document that shares only that wording is not contaminated. Each
text is tokenised with the training data's tokenizer as `mimir prepare` tokenises text
(:func:`mimir_megatron.chat.encoding`: no special tokens added), so its ids are the ids the index
holds. An item is **contaminated** when a run of at least ``ngram`` consecutive tokens of one of
its texts occurs inside one training document:

- **exactly**: the text's own token ids (the index's matching statistics, <= 2 lookups a token);
- **re-spaced**: the same words with other whitespace between them. Whitespace is part of the
  tokens (byte-level BPE: " brown" is one token; after a newline it is "\\n", "b", "row", "n";
  after two spaces " ", " brown"), so a re-spaced copy shares no token n-gram across any changed
  gap: a paragraph re-wrapped every ten words keeps no 13-token n-gram. This pass walks the text
  word by word (whitespace-separated segments): the next word is tried after each whitespace of
  :data:`WHITESPACE_VARIANTS` (and the text's own), tokenised as prepare would tokenise it, and
  kept while the index holds the run so far (up to :data:`MAX_BRANCHES` spacings at once).
  Its length is counted in the item's own tokens, so re-spacing never changes it.

Every run of n tokens found is an *offending sequence*, as the training data holds it; the
documents that contain one are the documents hit, and the denylist holds exactly these sequences,
so `mimir prepare --denylist` drops exactly the documents the report lists (up to ``max_hits``
listed per sequence).
"""

from __future__ import annotations

import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from mimir_megatron.errors import UserError

from mimir_megatron.evaluation.contamination import (
    MARK,
    BenchmarkCheck,
    CheckedDataset,
    ContaminationReport,
    LongestSpan,
    data_sha256,
)

from .index_query import AuditIndex, Hit

log = logging.getLogger("mimir.audit")

DEFAULT_NGRAM = 13
"""GPT-3's 13 (words there); later work used 8-13. Shorter flags shared boilerplate, longer misses
paraphrase and short items. Counted in tokens of the training data's tokenizer
(docs/contamination.md)."""
WHITESPACE_VARIANTS = (" ", "\n", "  ", "\n\n", " \n", "\t", "\r\n")
"""Whitespace a re-spaced copy may have between two words (besides the item's own)."""
MAX_BRANCHES = 4
"""Spacings of one run followed at once (more than one survives only for short common runs)."""
WHOLE_ITEM_MIN_TOKENS = 6
"""The whole-item rule: a text shorter than ``ngram`` tokens (it can never hold an n-gram) is
contaminated when all of it occurs in one training document, if it has at least this many tokens
(shorter texts, "Yes", "42", a name, occur everywhere by chance)."""
_WORD = re.compile(r"\S+")


@dataclass
class Overlap:
    """A run of an item's text that occurs in a training document."""

    part: str
    """``prompt`` (the row values the prompt shows) or ``reference`` (a reference answer)."""
    tokens: int
    """Length in the item's own tokens."""
    text: str
    """The item's text of the run."""
    exact: bool
    """The item's own token ids (else the same words with other whitespace between them)."""
    sequence: tuple[int, ...]
    """The run as the training data holds it."""


@dataclass
class ItemResult:
    benchmark: str
    id: str
    longest: Overlap | None
    sequences: list[dict] = field(default_factory=list)
    """Offending sequences: ``{"ids", "window", "part"}`` (every ``window`` ids of ``ids``)."""
    hits: list[Hit] = field(default_factory=list)
    hits_truncated: bool = False
    training_text: str = ""
    """The longest run as the first training document that holds it writes it."""
    exact_tokens: int = 0
    """The longest run of the item's own token ids (the exact pass alone)."""
    whole_item: bool = False
    """A text shorter than the n-gram occurs whole in a training document (the whole-item rule)."""
    lookups: int = 0

    def contaminated(self, ngram: int) -> bool:
        return self.whole_item or (self.longest is not None and self.longest.tokens >= ngram)


@dataclass
class BenchmarkResult:
    name: str
    title: str
    category: str
    data_path: Path
    items: list[ItemResult] = field(default_factory=list)
    error: str | None = None


class _CountingIndex:
    """The index's lookups, counted (the cost measure of the report)."""

    def __init__(self, index: AuditIndex) -> None:
        self.index = index
        self.lookups = 0

    def occurs(self, ids) -> bool:
        self.lookups += 1
        return self.index.occurs(list(ids))

    def match_lengths(self, ids) -> np.ndarray:
        lengths = self.index.match_lengths(ids)
        self.lookups += 2 * len(ids)  # the bound; the index does not count its own
        return lengths


class _Text:
    """One text of an item: its tokens, its words (whitespace-separated segments) and the tokens
    each word takes after each whitespace."""

    def __init__(self, part: str, text: str, encoder: _Encoder) -> None:
        self.part, self.text, self.encoder = part, text, encoder
        enc = encoder.encoding(text)
        self.ids: list[int] = list(enc.ids)
        starts = np.array([o[0] for o in enc.offsets], dtype=np.int64)
        ends = np.array([o[1] for o in enc.offsets], dtype=np.int64)
        self.words = [(m.start(), m.end()) for m in _WORD.finditer(text)]
        # the first and last token of each word (tokens overlapping its characters)
        self.first = [int(np.searchsorted(ends, a, side="right")) for a, _ in self.words]
        self.last = [int(np.searchsorted(starts, b, side="left")) - 1 for _, b in self.words]
        self._offsets = enc.offsets

    def span_tokens(self, i: int, j: int) -> int:
        """Item tokens from the start of word i to the end of word j (inclusive)."""
        return self.last[j] - self.first[i] + 1

    def word(self, k: int) -> str:
        return self.text[self.words[k][0]:self.words[k][1]]

    def starts(self, k: int) -> list[tuple[int, ...]]:
        """Tokens of word k where a run begins: unspaced, or with a space folded into its first token."""
        return _unique([self.encoder.encode(self.word(k)), self.encoder.encode(" " + self.word(k))])

    def joined(self, k: int) -> list[tuple[int, ...]]:
        """Tokens of word k after each possible whitespace, the text's own first."""
        own = self.text[self.words[k - 1][1]:self.words[k][0]]
        return _unique([self.encoder.encode(sep + self.word(k)) for sep in (own, *WHITESPACE_VARIANTS)])

    def char_span(self, token_start: int, tokens: int) -> str:
        return self.text[self._offsets[token_start][0]:self._offsets[token_start + tokens - 1][1]]


class _Encoder:
    """The tokenizer as `mimir prepare` applies it, with a cache of word tokenisations."""

    def __init__(self, tokenizer: Any) -> None:
        from mimir_megatron.chat import encoding

        self.tokenizer = tokenizer
        self._encoding = encoding
        self.encode = lru_cache(maxsize=1 << 18)(lambda text: tuple(encoding(tokenizer, text).ids))
        self._space: dict[int, bool] = {}

    def encoding(self, text: str):
        return self._encoding(self.tokenizer, text)

    def is_space(self, token: int) -> bool:
        if token not in self._space:
            self._space[token] = self.tokenizer.decode([token]).isspace()
        return self._space[token]

    def strip_space(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        """``ids`` without its leading whitespace-only tokens."""
        k = 0
        while k < len(ids) - 1 and self.is_space(ids[k]):
            k += 1
        return ids[k:]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(t) for t in ids])


def _unique(items) -> list:
    return list(dict.fromkeys(items))


def _flat(parts: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    return tuple(t for part in parts for t in part)


def _is_slice(ids: list[int], sequence: tuple[int, ...]) -> bool:
    n = len(sequence)
    return any(tuple(ids[p:p + n]) == sequence for p in range(len(ids) - n + 1) if ids[p] == sequence[0])


def _exact(index: _CountingIndex, text: _Text, ngram: int) -> tuple[Overlap | None, list[dict]]:
    """Runs of the text's own ids: the longest, and every n-gram found (as runs of windows)."""
    if not text.ids:
        return None, []
    lengths = index.match_lengths(text.ids)
    start = int(np.argmax(lengths))
    best = int(lengths[start])
    longest = Overlap(text.part, best, text.char_span(start, best), True,
                      tuple(text.ids[start:start + best])) if best else None
    sequences = []
    found = np.nonzero(lengths >= ngram)[0]
    if found.size:
        # consecutive positions p..q whose n-grams all occur: one entry, ids[p:q+n], window n
        breaks = np.nonzero(np.diff(found) > 1)[0]
        for lo, hi in zip(np.concatenate([[0], breaks + 1]), np.concatenate([breaks, [found.size - 1]])):
            p, q = int(found[lo]), int(found[hi])
            sequences.append({"ids": text.ids[p:q + ngram], "window": ngram, "part": text.part})
    return longest, sequences


def _respaced(index: _CountingIndex, text: _Text, ngram: int) -> tuple[Overlap | None, list[dict]]:
    """Runs of whole words with any whitespace of WHITESPACE_VARIANTS between them (module
    docstring). Matching statistics over words: the end never moves back, and the spacings that
    reached it are kept, each run trimmed of its first word as the start moves on."""
    encoder = text.encoder
    longest: Overlap | None = None
    sequences: dict[tuple[int, ...], None] = {}
    live: list[tuple[tuple[int, ...], ...]] = []  # spacings of words i..j-1 that occur
    j = 0
    for i in range(len(text.words)):
        live = _unique((encoder.strip_space(b[1]), *b[2:]) for b in live if len(b) > 1)
        if not live:
            live = [(alt,) for alt in text.starts(i) if index.occurs(alt)]
            if not live:
                continue
            j = i + 1
        while j < len(text.words):
            grown = _unique(b + (alt,) for b in live for alt in text.joined(j)
                            if index.occurs(_flat(b) + alt))
            if not grown:
                break
            live, j = grown[:MAX_BRANCHES], j + 1
        tokens = text.span_tokens(i, j - 1)
        if longest is None or tokens > longest.tokens:
            a, b = text.words[i][0], text.words[j - 1][1]
            longest = Overlap(text.part, tokens, text.text[a:b], False, _flat(live[0]))
        if tokens >= ngram:
            # the shortest prefix of each spacing that covers n of the item's tokens
            r = next(r for r in range(1, j - i + 1) if text.span_tokens(i, i + r - 1) >= ngram)
            for branch in live:
                sequence = encoder.strip_space(_flat(branch[:r]))
                if not _is_slice(text.ids, sequence):  # else the exact pass has it
                    sequences[sequence] = None
    if longest is not None and _is_slice(text.ids, longest.sequence):
        longest.exact = True
    return longest, [{"ids": list(s), "window": len(s), "part": text.part} for s in sequences]


_PUNCTUATION = re.compile(r"[^\w\s]+")


def normalised_variants(text: str) -> list[tuple[str, bool]]:
    """The forms of a text looked up: itself (``False``: not normalised), then NFKC-normalised,
    lower-cased, upper-cased, and without punctuation (as is and lower-cased), whitespace collapsed
    where punctuation went; each distinct form once. A training copy that changed case or dropped
    punctuation throughout, or wrote compatibility characters (full-width letters, ligatures) in
    their plain form, is found; one that mixes changes (title case, punctuation changed not
    dropped) is not (docs/contamination.md)."""
    import unicodedata

    nfkc = unicodedata.normalize("NFKC", text)
    bare = " ".join(_PUNCTUATION.sub(" ", nfkc).split())
    forms = {text: False}
    for form in (nfkc, nfkc.lower(), nfkc.upper(), bare, bare.lower()):
        if form.strip():
            forms.setdefault(form, True)
    return list(forms.items())


def check_item(index: AuditIndex, encoder: _Encoder, benchmark: str, item_id: str,
               texts: list[tuple[str, str]], ngram: int, max_hits: int) -> ItemResult:
    """One item: its longest run in the training data, its offending sequences and their hits."""
    counting = _CountingIndex(index)
    result = ItemResult(benchmark, item_id, None)
    for part, raw in texts:
        if not raw.strip():
            continue
        for variant, normalised in normalised_variants(raw):
            text = _Text(part, variant, encoder)
            exact = _exact(counting, text, ngram)
            if not normalised:
                result.exact_tokens = max(result.exact_tokens, exact[0].tokens if exact[0] else 0)
            for longest, sequences in (exact, _respaced(counting, text, ngram)):
                result.sequences += sequences
                if longest is None:
                    continue
                if normalised:
                    longest.exact = False
                if WHOLE_ITEM_MIN_TOKENS <= len(text.ids) < ngram and longest.tokens >= len(text.ids):
                    result.whole_item = True
                    result.sequences.append({"ids": list(longest.sequence), "window": len(longest.sequence),
                                             "part": part})
                if (result.longest is None or longest.tokens > result.longest.tokens
                        or (longest.tokens == result.longest.tokens and longest.exact
                            and not result.longest.exact)):
                    result.longest = longest
    seen: dict[tuple[str, int], Hit] = {}
    for entry in result.sequences:
        ids, window = entry["ids"], entry["window"]
        for p in range(len(ids) - window + 1):
            hits = index.locate(ids[p:p + window], limit=max_hits)
            result.hits_truncated |= len(hits) >= max_hits
            for hit in hits:
                seen.setdefault((hit.source, hit.document), hit)
    result.hits = sorted(seen.values(), key=lambda h: (h.source, h.document))
    if result.contaminated(ngram):
        first = index.locate(list(result.longest.sequence), limit=1)
        if first:
            doc = index.document_tokens(first[0].source, first[0].document)
            start = first[0].offset
            result.training_text = encoder.decode(doc[start:start + len(result.longest.sequence)])
    result.lookups = counting.lookups
    return result


@dataclass
class ContaminationSettings:
    ngram: int = DEFAULT_NGRAM
    max_hits: int = 1000
    """Documents listed per offending sequence, at most (the denylist drops them all)."""
    limit: int | None = None
    """First N items of each task after the suite's seeded shuffle (default: all)."""
    workers: int = 1


def check_ngram(ngram: int, index: AuditIndex) -> None:
    """A one-line UserError for an n-gram length the index cannot answer."""
    if ngram < 1:
        raise UserError(f"--ngram must be >= 1 token, got {ngram}")
    longest = index.longest_document
    if ngram > longest:
        raise UserError(f"--ngram {ngram} is longer than the index's longest document ({longest} tokens): "
                        "no run that long can be found")


def check_tokenizer(index: AuditIndex, tokenizer_dir: str | None) -> tuple[str, dict]:
    """The tokenizer directory to tokenise items with, checked to be the one the index's datasets
    were prepared with: (directory, {"sha256", "path"})."""
    from mimir_megatron.chat import tokenizer_sha256

    recorded = index.tokenizer
    if recorded is None:
        raise UserError(f"{index.path}: the index records no tokenizer (its datasets' manifests name none), "
                        "so items cannot be tokenised as its documents were")
    directory = tokenizer_dir or recorded.get("path")
    if not directory or not (Path(directory) / "tokenizer.json").is_file():
        raise UserError(f"the index's tokenizer {recorded.get('path')} is not here; pass --tokenizer DIR "
                        f"(the tokenizer with sha256 {recorded['sha256'][:12]}...)")
    sha = tokenizer_sha256(directory)
    if sha != recorded["sha256"]:
        raise UserError(f"tokenizer {directory} (sha256 {sha[:12]}...) is not the tokenizer the index's "
                        f"datasets were prepared with (sha256 {recorded['sha256'][:12]}...)")
    return str(directory), {"sha256": sha, "path": str(Path(directory).resolve())}


def run_contamination(index: AuditIndex, suite, data_dir: Path, tokenizer_dir: str,
                      settings: ContaminationSettings, progress: bool = True) -> list[BenchmarkResult]:
    """Every task of ``suite`` (its items under ``data_dir``) against ``index``."""
    from tqdm import tqdm

    from mimir_megatron.chat import load_tokenizer
    from mimir_megatron.evaluation.prompts import benchmark_texts

    encoder = _Encoder(load_tokenizer(tokenizer_dir))
    results, work = [], []
    for task in suite.tasks:
        bench = BenchmarkResult(task.name, task.header, task.category, data_dir / task.data)
        results.append(bench)
        try:
            items = benchmark_texts(task, data_dir, suite.seed, settings.limit)
        except UserError as exc:
            bench.error = str(exc)
            log.error("%s", exc)
            continue
        for item in items:
            texts = [("prompt", "\n".join(item.prompt))] + [("reference", r) for r in item.references]
            work.append((bench, item.id, texts))
    started = time.perf_counter()
    bar = tqdm(total=len(work), unit="item", desc="contamination", disable=not progress)

    def one(job):
        bench, item_id, texts = job
        result = check_item(index, encoder, bench.name, item_id, texts, settings.ngram, settings.max_hits)
        bar.update(1)
        return bench, result

    with ThreadPoolExecutor(max(1, settings.workers)) as pool:
        for bench, result in pool.map(one, work):
            bench.items.append(result)
    bar.close()
    seconds = time.perf_counter() - started
    lookups = sum(r.lookups for b in results for r in b.items)
    log.info("%d items in %.1f s (%.1f items/s, %d lookups) against %d documents, %d tokens", len(work),
             seconds, len(work) / max(seconds, 1e-9), lookups, index.num_documents, index.num_tokens)
    return results


# --- the report ------------------------------------------------------------------------------


def _summary(bench: BenchmarkResult, ngram: int) -> BenchmarkCheck:
    dirty = [r for r in bench.items if r.contaminated(ngram)]
    longest = max((r for r in bench.items if r.longest), key=lambda r: r.longest.tokens, default=None)
    documents = sorted({(h.source, h.document) for r in dirty for h in r.hits})
    return BenchmarkCheck(
        title=bench.title, category=bench.category, data=str(bench.data_path),
        data_sha256=data_sha256(bench.data_path), error=bench.error,
        items=len(bench.items), contaminated=len(dirty),
        exact=sum(1 for r in dirty if r.exact_tokens >= ngram),
        longest_span=(LongestSpan(longest.longest.tokens, longest.longest.text, longest.id,
                                  longest.longest.part) if longest else LongestSpan()),
        documents_hit=len(documents),
        documents_truncated=any(r.hits_truncated for r in dirty),
        documents=tuple(documents),
        contaminated_items=tuple(r.id for r in dirty),
    )


def _item_line(r: ItemResult) -> dict[str, Any]:
    o = r.longest
    return {"benchmark": r.benchmark, "item": r.id, "tokens": o.tokens, "part": o.part, "exact": o.exact,
            "exact_tokens": r.exact_tokens,
            "text": o.text, "training_text": r.training_text,
            "documents": [{"dataset": h.source, "category": h.category, "document": h.document,
                           "offset": h.offset} for h in r.hits],
            "documents_truncated": r.hits_truncated, "sequences": r.sequences}


def indexed_datasets(index: AuditIndex) -> tuple[CheckedDataset, ...]:
    """The prepared datasets the index holds, each with its manifest's digest when the manifest
    still describes the files indexed (what `mimir export` matches against a checkpoint's lineage
    before it accepts the report); None where it no longer does or is gone."""
    from mimir_megatron.data.manifest import Manifest

    datasets = []
    for source in index.metadata.sources:
        try:
            manifest: Manifest | None = Manifest.read(source.path)
        except UserError:
            manifest = None
        same = manifest is not None and dict(manifest.outputs) == source.outputs
        datasets.append(CheckedDataset(name=source.name, path=source.path,
                                       manifest_digest=manifest.digest if same and manifest else None))
    return tuple(datasets)


def contamination_report(results: list[BenchmarkResult], suite, index: AuditIndex, tokenizer: dict,
                         settings: ContaminationSettings) -> ContaminationReport:
    """The report record of an audit's ``results`` (what :func:`write_report` writes)."""
    return ContaminationReport(
        benchmarks={b.name: _summary(b, settings.ngram) for b in results}, suite=suite.name,
        suite_file=suite.source, seed=suite.seed, ngram=settings.ngram,
        whitespace_variants=tuple(WHITESPACE_VARIANTS), limit=settings.limit,
        index={"path": str(index.path.resolve()), "fingerprint": index.metadata.fingerprint,
               "documents": index.num_documents, "tokens": index.num_tokens},
        datasets=indexed_datasets(index), tokenizer=tokenizer, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def write_report(report: ContaminationReport, results: list[BenchmarkResult], out: Path,
                 index: AuditIndex) -> list[Path]:
    """``<suite>.json`` (``report``: what eval, sweep and export read), ``<suite>.md`` / ``.csv``
    (the table) and ``<suite>_items.jsonl`` (every contaminated item: its run, the training text,
    the documents)."""
    from .report import write_table

    n, suite = report.ngram, report.suite
    paths = [report.write(out)]
    rows = []
    for b in results:
        s = report.benchmarks[b.name]
        text = s.longest_span.text.replace("\n", " ").replace("|", "/")
        rows.append({"benchmark": b.title + (MARK if s.contaminated else ""), "task": b.name,
                     "items": s.items, "contaminated": s.contaminated,
                     "contaminated (%)": round(100 * s.fraction, 2), "exact": s.exact,
                     "longest span (tokens)": s.longest_span.tokens,
                     "longest span": (text[:77] + "...") if len(text) > 80 else text,
                     "documents hit": f"{s.documents_hit}" + ("+" if s.documents_truncated else ""),
                     "note": b.error or ""})
    notes = [f"An item is contaminated ({MARK}) when {n} consecutive tokens of its benchmark text occur in "
             "one training document, exactly or re-spaced; `exact` counts those found with the item's own "
             f"token ids. Index: {index.num_documents:,} documents, {index.num_tokens:,} tokens."]
    paths += write_table(rows, out, suite, f"Contamination of {suite} ({n}-token overlap)",
                         json_rows=False, notes=notes)
    items = out / f"{suite}_items.jsonl"
    with items.open("w", encoding="utf-8") as f:
        for b in results:
            for r in b.items:
                if r.contaminated(n):
                    f.write(json.dumps(_item_line(r), ensure_ascii=False) + "\n")
    paths.append(items)
    return paths


def denylist_entries(results: list[BenchmarkResult], ngram: int) -> list[dict]:
    """The offending sequences of every contaminated item, labelled with benchmark and item."""
    return [{**entry, "benchmark": r.benchmark, "item": r.id}
            for b in results for r in b.items if r.contaminated(ngram) for entry in r.sequences]
