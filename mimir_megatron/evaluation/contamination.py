"""The contamination report's file, and what `mimir eval` and `mimir sweep` mark from it.

``mimir audit contamination --suite S.yaml --output DIR`` writes ``DIR/<suite name>.json``
(:mod:`mimir_megatron.audits.contamination` writes it with the names defined here). Eval and sweep
take it from ``--contamination PATH`` (the report file, or the directory holding ``<suite
name>.json``); without it, a training checkpoint's run directory is looked in:
``RUN/contamination/<suite name>.json``. A benchmark is marked only when the report checked the
same data (sha256) the evaluation reads; otherwise it is shown as stale and not used.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import (
    directory_sha256,
    read_json_object,
    refuse_if_edited,
    sha256_file,
    with_digest,
    write_json_atomic,
)

from .suite import SuiteSpec

if TYPE_CHECKING:
    from mimir_megatron.checkpoint.run_directory import RunDirectory

log = logging.getLogger(__name__)

FORMAT = "mimir-contamination-v2"
DIGESTLESS_FORMAT = "mimir-contamination-v1"
"""The format before v2: its reports may lack a digest (written before reports carried one)."""
MARK = "‡"
"""Suffix of a contaminated benchmark's name in eval and sweep tables."""


def report_file(output: str | Path, suite_name: str) -> Path:
    return Path(output) / f"{suite_name}.json"


def data_sha256(path: str | Path) -> str | None:
    """sha256 over a benchmark's data: a file's bytes, or a directory's files (names and bytes,
    sorted, as `datasets`' save_to_disk writes them); None when absent."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    return directory_sha256(path) if path.is_dir() else None


@dataclass(frozen=True)
class BenchmarkMark:
    """What an evaluation table says about one benchmark's contamination."""

    items: int
    contaminated: int
    longest_span: int
    ngram: int
    report: str
    stale: bool = False
    """The report checked other data than this evaluation reads (its marks are not used)."""
    contaminated_items: tuple[str, ...] | None = None
    """Ids of the contaminated items (None: the report does not list them)."""
    checked_all: bool = True
    """The report checked every item (no ``--limit``); else only its first ``items``."""
    same_order: bool = False
    """The report shuffled the items with this suite's seed (its first ``items`` are the evaluation's)."""

    def covers(self, scored: int) -> bool:
        """Whether the report checked each of the evaluation's first ``scored`` items, so that its
        scores can be split into clean and contaminated items."""
        if self.stale or self.contaminated_items is None:
            return False
        return self.checked_all or (self.same_order and scored <= self.items)

    @property
    def fraction(self) -> float:
        return self.contaminated / self.items if self.items else 0.0

    @property
    def flagged(self) -> bool:
        return not self.stale and self.contaminated > 0

    def label(self) -> str:
        if self.stale:
            return "stale report"
        share = f" ({100 * self.fraction:.1f} %)" if self.contaminated else ""
        return f"{self.contaminated}/{self.items}{share}"

    def as_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        if self.contaminated_items is not None:
            fields["contaminated_items"] = list(self.contaminated_items)
        return {**fields, "fraction": self.fraction}


@dataclass(frozen=True)
class LongestSpan:
    """The longest span of a benchmark's text found in one training document."""

    tokens: int = 0
    text: str = ""
    item: Any = None
    """The item's id as the benchmark gives it."""
    part: str | None = None


@dataclass(frozen=True)
class BenchmarkCheck:
    """What the audit found for one benchmark (task) of the suite."""

    items: int = 0
    contaminated: int = 0
    longest_span: LongestSpan = LongestSpan()
    error: str | None = None
    """Why the benchmark could not be checked (its counts then mean nothing)."""
    data_sha256: str | None = None
    """sha256 of the benchmark data checked (:func:`data_sha256`): a mark needs the same data."""
    title: str | None = None
    category: str | None = None
    data: str | None = None
    exact: int = 0
    """Contaminated items found with the item's own token ids (not only re-spaced)."""
    documents_hit: int = 0
    documents_truncated: bool = False
    documents: tuple[tuple[str, int], ...] = ()
    """(dataset, document) of every training document holding a contaminated item's span."""
    contaminated_items: tuple[str, ...] | None = None
    """Ids of the contaminated items (None: a report written before they were listed)."""

    @property
    def fraction(self) -> float:
        return self.contaminated / self.items if self.items else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "category": self.category, "data": self.data,
                "data_sha256": self.data_sha256, "error": self.error, "items": self.items,
                "contaminated": self.contaminated, "fraction": self.fraction, "exact": self.exact,
                "longest_span": asdict(self.longest_span), "documents_hit": self.documents_hit,
                "documents_truncated": self.documents_truncated,
                "documents": [list(d) for d in self.documents],
                "contaminated_items": (None if self.contaminated_items is None
                                       else list(self.contaminated_items))}


@dataclass(frozen=True)
class CheckedDataset:
    """A prepared dataset the audited index held, with its manifest's digest when the manifest
    still described the files indexed (None otherwise)."""

    name: str
    path: str | None = None
    manifest_digest: str | None = None


@dataclass(frozen=True)
class ContaminationReport:
    """The report of ``mimir audit contamination`` (``<suite>.json``): one record, written by
    :meth:`write` with the digest of its content, read back by :meth:`read` (format, digest, fields
    and types checked, one line naming the file and what is wrong otherwise)."""

    benchmarks: Mapping[str, BenchmarkCheck]
    suite: str = ""
    ngram: int = 0
    seed: int | None = None
    limit: int | None = None
    """``--limit``: only the first ``limit`` items of each benchmark were checked."""
    datasets: tuple[CheckedDataset, ...] | None = None
    """The datasets checked (None: a report written before they were recorded)."""
    suite_file: str | None = None
    normalisation: str | None = None
    """How items and training text were folded before matching (the audit's word form,
    :data:`mimir_megatron.audits.normalise.WORD_FORM`); None: a report written before folding."""
    index: Mapping[str, Any] | None = None
    """The index audited: path, fingerprint, documents, tokens."""
    tokenizer: Mapping[str, Any] | None = None
    created: str | None = None
    path: Path | None = field(default=None, compare=False)
    """Where it was read from (None: built in memory)."""

    @classmethod
    def read(cls, path: str | Path) -> ContaminationReport:
        path = Path(path)
        body = read_json_object(path, "contamination report",
                                missing=f"contamination report not found: {path}")
        migrated = _migrated_report(body, path)
        refuse_if_edited(body, path, "mimir audit contamination", required=body.get("format") == FORMAT)
        return _report_from_dict(migrated, path)

    def write(self, directory: str | Path) -> Path:
        """Write ``<directory>/<suite>.json`` with the digest of its content, atomically; the path
        written."""
        body = {"format": FORMAT, "suite": self.suite, "suite_file": self.suite_file, "seed": self.seed,
                "ngram": self.ngram, "normalisation": self.normalisation,
                "limit": self.limit, "index": dict(self.index or {}),
                "datasets": None if self.datasets is None else [asdict(d) for d in self.datasets],
                "tokenizer": dict(self.tokenizer or {}), "created": self.created,
                "benchmarks": {name: check.to_dict() for name, check in self.benchmarks.items()}}
        Path(directory).mkdir(parents=True, exist_ok=True)
        return write_json_atomic(report_file(directory, self.suite), with_digest(body), indent=1)

    def metrics(self) -> dict[str, float]:
        """Per benchmark checked: contaminated items and fraction, longest span, documents hit
        (what ``mimir audit contamination`` logs to MLflow)."""
        metrics: dict[str, float] = {}
        for name, b in self.benchmarks.items():
            if b.error:
                continue
            metrics.update({f"{name}/contaminated items": b.contaminated,
                            f"{name}/contaminated fraction": b.fraction,
                            f"{name}/longest span": b.longest_span.tokens,
                            f"{name}/documents hit": b.documents_hit})
        return metrics

    def mark(self, task: str, data_path: str | Path, seed: int | None = None) -> BenchmarkMark | None:
        """The benchmark's mark, None when the report did not check it (or failed to); ``seed``:
        the evaluating suite's (whether a limited report checked the evaluation's first items)."""
        bench = self.benchmarks.get(task)
        if bench is None or bench.error:
            return None
        return BenchmarkMark(bench.items, bench.contaminated, bench.longest_span.tokens, self.ngram,
                             str(self.path), bench.data_sha256 != data_sha256(data_path),
                             bench.contaminated_items, checked_all=self.limit is None,
                             same_order=seed is not None and self.seed == seed)


def _migrated_report(body: dict[str, Any], path: Path) -> dict[str, Any]:
    """A report of an older format brought to today's, or a refusal naming its version. A v1 report
    holds today's fields and reads as it is (one written before reports carried a digest has
    nothing to verify); a report of another version (or of none) is refused. A v2 report always
    carries its digest."""
    found = body.get("format")
    if found not in (FORMAT, DIGESTLESS_FORMAT):
        raise UserError(f"{path}: format {found!r} is not one this version of mimir reads (it reads "
                        f"{FORMAT!r}); run `mimir audit contamination` again")
    return body


def _report_from_dict(body: dict[str, Any], path: Path) -> ContaminationReport:
    def wrong(where: str, what: str, value: Any) -> UserError:
        return UserError(f"{path}: {where}: {what} expected, got {value!r}")

    def typed(values: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str, where: str = "",
              default: Any = None) -> Any:
        value = values.get(name, default)
        if value is not None and (not isinstance(value, kind) or (isinstance(value, bool) and kind is int)):
            raise wrong(where + name, what, value)
        return value

    benchmarks = body.get("benchmarks")
    if not isinstance(benchmarks, dict):
        raise UserError(f"{path}: benchmarks: missing, or not a JSON object (a report `mimir audit "
                        "contamination` wrote has one entry per benchmark)")
    checks = {}
    for task, bench in benchmarks.items():
        where = f"benchmarks.{task}."
        if not isinstance(bench, dict):
            raise wrong(f"benchmarks.{task}", "a benchmark result (a JSON object)", bench)
        error = typed(bench, "error", str, "a string", where)
        span = bench.get("longest_span")
        if not error and (not isinstance(span, dict) or "items" not in bench or "contaminated" not in bench
                          or "tokens" not in span):
            raise UserError(f"{path}: benchmarks.{task}: items, contaminated and longest_span.tokens are "
                            "required (a report `mimir audit contamination` wrote)")
        span, in_span = (span if isinstance(span, dict) else {}), f"{where}longest_span."
        listed = typed(bench, "contaminated_items", list, "a list of item ids", where)
        documents = typed(bench, "documents", list, "a list of [dataset, document]", where, [])
        checks[task] = BenchmarkCheck(
            items=typed(bench, "items", int, "an integer", where, 0),
            contaminated=typed(bench, "contaminated", int, "an integer", where, 0),
            longest_span=LongestSpan(tokens=typed(span, "tokens", int, "an integer", in_span, 0),
                                     text=typed(span, "text", str, "a string", in_span, ""),
                                     item=span.get("item"),
                                     part=typed(span, "part", str, "a string", in_span)),
            error=error, data_sha256=typed(bench, "data_sha256", str, "a string", where),
            title=typed(bench, "title", str, "a string", where),
            category=typed(bench, "category", str, "a string", where),
            data=typed(bench, "data", str, "a string", where),
            exact=typed(bench, "exact", int, "an integer", where, 0),
            documents_hit=typed(bench, "documents_hit", int, "an integer", where, 0),
            documents_truncated=bool(bench.get("documents_truncated", False)),
            documents=tuple((str(d[0]), int(d[1])) for d in documents if isinstance(d, list) and len(d) == 2),
            contaminated_items=None if listed is None else tuple(str(i) for i in listed))
    datasets = typed(body, "datasets", list, "a list of the datasets checked")
    checked = None
    if datasets is not None:
        checked = []
        for i, d in enumerate(datasets):
            if not isinstance(d, dict):
                raise wrong(f"datasets[{i}]", "a JSON object", d)
            checked.append(CheckedDataset(name=str(d.get("name", "")), path=d.get("path"),
                                          manifest_digest=typed(d, "manifest_digest", str, "a string",
                                                                f"datasets[{i}].")))
        checked = tuple(checked)
    return ContaminationReport(
        benchmarks=checks, suite=typed(body, "suite", str, "a string", default=""),
        ngram=typed(body, "ngram", int, "an integer", default=0),
        seed=typed(body, "seed", int, "an integer"), limit=typed(body, "limit", int, "an integer"),
        datasets=checked, suite_file=typed(body, "suite_file", str, "a string"),
        normalisation=typed(body, "normalisation", str, "a string"),
        index=typed(body, "index", dict, "a JSON object"),
        tokenizer=typed(body, "tokenizer", dict, "a JSON object"),
        created=typed(body, "created", str, "a string"), path=path)


def find_report(explicit: str | None, suite_name: str,
                run_dir: RunDirectory | None = None) -> ContaminationReport | None:
    """``explicit`` (a missing one is an error), else the report of the training run ``run_dir``
    (:func:`mimir_megatron.checkpoint.model_dir.run_directory`) if there is one."""
    if explicit:
        path = Path(explicit)
        return ContaminationReport.read(report_file(path, suite_name) if path.is_dir() else path)
    if run_dir is not None:
        candidate = report_file(run_dir.contamination, suite_name)
        if candidate.is_file():
            log.info("contamination report of the training run: %s", candidate)
            return ContaminationReport.read(candidate)
    return None


def benchmark_marks(report: ContaminationReport | None, suite: SuiteSpec,
                    data_dir: str | Path | None = None) -> dict[str, BenchmarkMark | None] | None:
    """Per task of ``suite``: its mark (None: the report did not check it); None without a report."""
    if report is None:
        return None
    if report.suite and report.suite != suite.name:
        log.warning("contamination report %s is for suite %s, this is %s: matched by task name",
                    report.path, report.suite, suite.name)
    base = Path(data_dir or suite.data_dir)
    marks = {t.name: report.mark(t.name, base / t.data, suite.seed) for t in suite.tasks}
    for name, mark in marks.items():
        if mark is None:
            log.warning("contamination report %s did not check task %s", report.path, name)
        elif mark.stale:
            log.warning("contamination report %s checked other data for task %s than %s; not marked",
                        report.path, name, base)
    return marks
