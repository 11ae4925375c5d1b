"""The contamination report's file, and what `mimir eval` and `mimir sweep` mark from it.

``mimir audit contamination --suite S.yaml --output DIR`` writes ``DIR/<suite name>.json``
(:mod:`mimir_megatron.audits.contamination` writes it with the names defined here). Eval and sweep
take it from ``--contamination PATH`` (the report file, or the directory holding ``<suite
name>.json``); without it, a training checkpoint's run directory is looked in:
``RUN/contamination/<suite name>.json``. A benchmark is marked only when the report checked the
same data (sha256) the evaluation reads; otherwise it is shown as stale and not used.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mimir_megatron.errors import UserError

from .suite import SuiteSpec

log = logging.getLogger(__name__)

FORMAT = "mimir-contamination-v1"
RUN_SUBDIR = "contamination"
"""The folder of a training run's directory that eval and sweep look in by default."""
MARK = "‡"
"""Suffix of a contaminated benchmark's name in eval and sweep tables."""


def report_file(output: str | Path, suite_name: str) -> Path:
    return Path(output) / f"{suite_name}.json"


def data_sha256(path: str | Path) -> str | None:
    """sha256 over a benchmark's data: a file's bytes, or a directory's files (names and bytes,
    sorted, as `datasets`' save_to_disk writes them); None when absent."""
    path = Path(path)
    digest = hashlib.sha256()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        return None
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


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


class ContaminationReport:
    """A report read back: per benchmark (task name) its counts and the data it checked."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            body = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise UserError(f"contamination report not found: {self.path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{self.path}: not a contamination report (invalid JSON: {exc})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise UserError(f"{self.path}: format: expected {FORMAT!r} (from `mimir audit contamination`)")
        self.body = body
        self.suite: str = body.get("suite", "")
        self.ngram: int = body.get("ngram", 0)

    def mark(self, task: str, data_path: str | Path, seed: int | None = None) -> BenchmarkMark | None:
        """The benchmark's mark, None when the report did not check it (or failed to); ``seed``:
        the evaluating suite's (whether a limited report checked the evaluation's first items)."""
        bench = self.body.get("benchmarks", {}).get(task)
        if not bench or bench.get("error"):
            return None
        stale = bench.get("data_sha256") != data_sha256(data_path)
        listed = bench.get("contaminated_items")
        return BenchmarkMark(bench["items"], bench["contaminated"], bench["longest_span"]["tokens"],
                             self.ngram, str(self.path), stale,
                             tuple(str(i) for i in listed) if isinstance(listed, list) else None,
                             checked_all=self.body.get("limit") is None,
                             same_order=seed is not None and self.body.get("seed") == seed)


def find_report(explicit: str | None, suite_name: str,
                checkpoint: str | None = None) -> ContaminationReport | None:
    """``explicit`` (a missing one is an error), else the training run's report if there is one."""
    if explicit:
        path = Path(explicit)
        return ContaminationReport(report_file(path, suite_name) if path.is_dir() else path)
    if checkpoint:
        from mimir_megatron.checkpoint import find

        from .tracking import run_directory

        found = find(checkpoint)
        if found:
            path, state = found
            candidate = report_file(run_directory(path, state.config) / RUN_SUBDIR, suite_name)
            if candidate.is_file():
                log.info("contamination report of the training run: %s", candidate)
                return ContaminationReport(candidate)
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
