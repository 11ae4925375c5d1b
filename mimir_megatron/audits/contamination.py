"""`mimir audit contamination`: every item of an evaluation suite against the training data's index.

**What is checked.** Each item's benchmark text as the suite's loader reads it
(:func:`mimir_megatron.evaluation.prompts.benchmark_texts`): the row values its prompt shows (the
template's fields, the options) joined by newlines, and each reference answer of a free-generation
task as the row writes it. The suite's own wording (prompt template, instruction, option letters,
shots) is left out: a training document that shares only that wording is not contaminated. Each
text is tokenised with the training data's tokenizer as `mimir prepare` tokenises text
(:func:`mimir_megatron.chat.encoding`: no special tokens added). An item is **contaminated** when
a run of its text at least ``ngram`` of its own tokens long occurs inside one training document:

- **exactly**: the text's own token ids, in the index's token stream (matching statistics, <= 2
  lookups a token);
- **folded**: the same words, in the index's word stream (:mod:`.normalise`): any whitespace
  between them (re-spaced, re-wrapped, no-break spaces), and each word compared after NFKC,
  deleting format characters (zero-width spaces, joiners, soft hyphens) and punctuation, mapping
  Cyrillic and Greek look-alikes to Latin letters and case folding (Title Case, ALL CAPS, any mix).
  Matching statistics over words, <= 2 lookups a word.

Either way the run's length is counted in the item's own tokens (the tokens of the words it
covers as the suite writes them, in NFKC form for a folded run), never in the form the training
copy took: the verdict on an item depends only on its own text and on the training documents that
hold a run of it, not on how those documents spell other items.

Every run of ``ngram`` tokens found is an *offending sequence*: token ids for an exact run (as the
training data holds them), word numbers for a folded one; the documents that contain one are the
documents hit, and the denylist holds exactly these sequences, so `mimir prepare --denylist` drops
exactly the documents the report lists (up to ``max_hits`` listed per sequence).
"""

from __future__ import annotations

import json
import logging
import time
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
from .normalise import WORD_FORM, document_text, word_spans

log = logging.getLogger("mimir.audit")

DEFAULT_NGRAM = 13
"""GPT-3's 13 (words there); later work used 8-13. Shorter flags shared boilerplate, longer misses
paraphrase and short items. Counted in tokens of the training data's tokenizer
(docs/contamination.md)."""
WHOLE_ITEM_MIN_TOKENS = 6
"""The whole-item rule: a text shorter than ``ngram`` tokens (it can never hold an n-gram) is
contaminated when all of it occurs in one training document, if it has at least this many tokens
(shorter texts, "Yes", "42", a name, occur everywhere by chance)."""


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
    """The item's own token ids (else the same words, folded: :mod:`.normalise`)."""
    sequence: tuple[int, ...]
    """The run as the index holds it: token ids (exact) or word numbers (folded)."""


@dataclass
class ItemResult:
    benchmark: str
    id: str
    longest: Overlap | None
    sequences: list[dict] = field(default_factory=list)
    """Offending sequences: ``{"ids" | "words", "window", "part"}`` (every ``window`` ids or words)."""
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

    def match_lengths(self, ids) -> np.ndarray:
        lengths = self.index.match_lengths(ids)
        self.lookups += 2 * len(ids)  # the bound; the index does not count its own
        return lengths

    def word_match_lengths(self, words: list[int]) -> np.ndarray:
        lengths = self.index.words().match_lengths(words)
        self.lookups += 2 * len(words)
        return lengths


class _Text:
    """One text of an item: its tokens, its words (those that fold to something, :mod:`.normalise`)
    and the item tokens each word covers."""

    def __init__(self, part: str, text: str, encoder: _Encoder) -> None:
        self.part, self.text = part, text
        enc = encoder.encoding(text)
        self.ids: list[int] = list(enc.ids)
        self._offsets = enc.offsets
        spans = word_spans(text)
        self.words = [(a, b) for a, b, _ in spans]
        self.numbers = [n for _, _, n in spans]
        starts = np.array([o[0] for o in enc.offsets], dtype=np.int64)
        ends = np.array([o[1] for o in enc.offsets], dtype=np.int64)
        # the first and last token of each word (tokens overlapping its characters)
        self.first = [int(np.searchsorted(ends, a, side="right")) for a, _ in self.words]
        self.last = [int(np.searchsorted(starts, b, side="left")) - 1 for _, b in self.words]

    def span_tokens(self, i: int, j: int) -> int:
        """Item tokens from the start of word i to the end of word j (inclusive)."""
        return self.last[j] - self.first[i] + 1

    def char_span(self, token_start: int, tokens: int) -> str:
        return self.text[self._offsets[token_start][0]:self._offsets[token_start + tokens - 1][1]]


class _Encoder:
    """The tokenizer as `mimir prepare` applies it."""

    def __init__(self, tokenizer: Any) -> None:
        from mimir_megatron.chat import encoding

        self.tokenizer = tokenizer
        self._encoding = encoding

    def encoding(self, text: str):
        return self._encoding(self.tokenizer, text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(t) for t in ids])

    def document_text(self, ids) -> str:
        """A training document's text as the index's word stream read it."""
        return document_text(self.tokenizer.backend_tokenizer, ids)


def _runs(lengths: np.ndarray, window) -> list[tuple[int, int, int]]:
    """Maximal runs ``(p, q, w)`` of consecutive positions p..q whose offending window ``window(i)``
    is the same ``w`` (None: no n-gram starts at i): one denylist entry each."""
    runs: list[tuple[int, int, int]] = []
    for i in range(len(lengths)):
        w = window(i)
        if w is None:
            continue
        if runs and runs[-1][1] == i - 1 and runs[-1][2] == w:
            runs[-1] = (runs[-1][0], i, w)
        else:
            runs.append((i, i, w))
    return runs


def _exact(index: _CountingIndex, text: _Text, ngram: int) -> tuple[Overlap | None, list[dict]]:
    """Runs of the text's own ids: the longest, and every n-gram found (as runs of windows)."""
    if not text.ids:
        return None, []
    lengths = index.match_lengths(text.ids)
    start = int(np.argmax(lengths))
    best = int(lengths[start])
    longest = Overlap(text.part, best, text.char_span(start, best), True,
                      tuple(text.ids[start:start + best])) if best else None
    # consecutive positions p..q whose n-grams all occur: one entry, ids[p:q+n], window n
    runs = _runs(lengths, lambda i: ngram if lengths[i] >= ngram else None)
    return longest, [{"ids": text.ids[p:q + w], "window": w, "part": text.part} for p, q, w in runs]


def _folded(index: _CountingIndex, text: _Text, ngram: int) -> tuple[Overlap | None, list[dict], bool]:
    """Runs of the text's folded words in the word stream: the longest (in the item's own tokens),
    every offending sequence (at each start, the fewest words that cover ``ngram`` item tokens),
    and whether all of the text's words occur as one run (the whole-item rule)."""
    n = len(text.numbers)
    if not n:
        return None, [], False
    lengths = index.word_match_lengths(text.numbers)
    tokens = [text.span_tokens(i, i + int(lengths[i]) - 1) if lengths[i] else 0 for i in range(n)]
    start = int(np.argmax(tokens))
    longest = None
    if tokens[start]:
        end = start + int(lengths[start]) - 1
        longest = Overlap(text.part, tokens[start], text.text[text.words[start][0]:text.words[end][1]], False,
                          tuple(text.numbers[start:end + 1]))

    def window(i: int) -> int | None:
        if tokens[i] < ngram:
            return None
        return next(r for r in range(1, int(lengths[i]) + 1) if text.span_tokens(i, i + r - 1) >= ngram)

    sequences = [{"words": text.numbers[p:q + w], "window": w, "part": text.part}
                 for p, q, w in _runs(lengths, window)]
    return longest, sequences, int(lengths[0]) == n


def check_item(index: AuditIndex, encoder: _Encoder, benchmark: str, item_id: str,
               texts: list[tuple[str, str]], ngram: int, max_hits: int) -> ItemResult:
    """One item: its longest run in the training data, its offending sequences and their hits."""
    counting = _CountingIndex(index)
    result = ItemResult(benchmark, item_id, None)
    for part, raw in texts:
        if not raw.strip():
            continue
        text = _Text(part, raw, encoder)
        # folded runs count the tokens of the item's NFKC form: as written for ordinary text, and
        # not a dozen byte tokens per word for full-width letters
        standard = unicodedata.normalize("NFKC", raw)
        plain = text if standard == raw else _Text(part, standard, encoder)
        exact, exact_sequences = _exact(counting, text, ngram)
        folded, folded_sequences, whole = _folded(counting, plain, ngram)
        result.exact_tokens = max(result.exact_tokens, exact.tokens if exact else 0)
        result.sequences += exact_sequences + folded_sequences
        short = WHOLE_ITEM_MIN_TOKENS <= len(text.ids) < ngram
        if short and exact is not None and exact.tokens >= len(text.ids):
            result.whole_item = True
            result.sequences.append({"ids": list(exact.sequence), "window": len(exact.sequence),
                                     "part": part})
        elif whole and WHOLE_ITEM_MIN_TOKENS <= len(plain.ids) < ngram:
            result.whole_item = True
            result.sequences.append({"words": list(plain.numbers), "window": len(plain.numbers),
                                     "part": part})
        for longest in (exact, folded):  # the exact run first: it wins a tie
            if longest is not None and (result.longest is None or longest.tokens > result.longest.tokens):
                result.longest = longest
    seen: dict[tuple[str, int], Hit] = {}
    for entry in result.sequences:
        words = "words" in entry
        sequence, window = entry["words" if words else "ids"], entry["window"]
        locate = index.words().locate if words else index.locate
        for p in range(len(sequence) - window + 1):
            hits = locate(sequence[p:p + window], limit=max_hits)
            result.hits_truncated |= len(hits) >= max_hits
            for hit in hits:
                seen.setdefault((hit.source, hit.document), hit)
    result.hits = sorted(seen.values(), key=lambda h: (h.source, h.document))
    if result.contaminated(ngram):
        result.training_text = _training_text(index, encoder, result.longest)
    result.lookups = counting.lookups
    return result


def _training_text(index: AuditIndex, encoder: _Encoder, run: Overlap) -> str:
    """The run as the first training document holding it writes it."""
    if run.exact:
        first = index.locate(list(run.sequence), limit=1)
        if not first:
            return ""
        doc = index.document_tokens(first[0].source, first[0].document)
        return encoder.decode(doc[first[0].offset:first[0].offset + len(run.sequence)])
    first = index.words().locate(list(run.sequence), limit=1)
    if not first:
        return ""
    text = encoder.document_text(index.document_tokens(first[0].source, first[0].document))
    spans = word_spans(text)[first[0].offset:first[0].offset + len(run.sequence)]
    return text[spans[0][0]:spans[-1][1]] if spans else ""


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
                           "offset": h.offset, "offset_unit": h.unit} for h in r.hits],
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
        normalisation=WORD_FORM, limit=settings.limit,
        index={"path": str(index.path.resolve()), "fingerprint": index.metadata.fingerprint,
               "documents": index.num_documents, "tokens": index.num_tokens},
        datasets=indexed_datasets(index), tokenizer=tokenizer, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def write_report(report: ContaminationReport, results: list[BenchmarkResult], out: Path,
                 index: AuditIndex) -> list[Path]:
    """``<suite>.json`` (``report``: what eval, sweep and export read), ``<suite>.md`` / ``.csv``
    (the table) and ``<suite>_items.jsonl`` (every contaminated item: its run, the training text,
    the documents)."""
    from .outputs import write_table

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
             "one training document, exactly or as the same words folded (spacing, case, Unicode forms, "
             "look-alike letters, punctuation); `exact` counts those found with the item's own "
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
