"""Which benchmarks of an evaluation are contaminated: the report `mimir eval` and `mimir sweep`
mark them from, and the marks.

The report (``mimir audit contamination``, format in :mod:`mimir_megatron.audits.contamination_report`)
is ``--contamination PATH`` (the report file, or the directory holding ``<suite name>.json``); without
it, a training checkpoint's run directory is looked in: ``RUN/contamination/<suite name>.json``.
A benchmark is marked only when the report checked the same data (sha256) the evaluation reads.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mimir_megatron.audits.contamination_report import (
    RUN_SUBDIR,
    BenchmarkMark,
    ContaminationReport,
    report_file,
)

from .suite import SuiteSpec

log = logging.getLogger(__name__)


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
            candidate = report_file(run_directory(*found) / RUN_SUBDIR, suite_name)
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
    marks = {t.name: report.mark(t.name, base / t.data) for t in suite.tasks}
    for name, mark in marks.items():
        if mark is None:
            log.warning("contamination report %s did not check task %s", report.path, name)
        elif mark.stale:
            log.warning("contamination report %s checked other data for task %s than %s; not marked",
                        report.path, name, base)
    return marks
