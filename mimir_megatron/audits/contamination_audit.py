"""`mimir audit contamination` as a function: every check before anything is written, the items
of a suite against an index (:mod:`.contamination`), the report, the denylist, the MLflow run."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mimir_megatron.errors import UserError

from .contamination import (
    ContaminationSettings,
    check_ngram,
    check_tokenizer,
    contamination_report,
    denylist_entries,
    run_contamination,
    write_report,
)
from .index_query import AuditIndex
from .outputs import AuditResult, AuditTracking

if TYPE_CHECKING:
    from mimir_megatron.evaluation.suite import SuiteSpec

log = logging.getLogger("mimir.audit")


def contamination_audit(suite: SuiteSpec | str | Path, index: str | Path | AuditIndex, output: str | Path,
                        settings: ContaminationSettings, *, tasks: Sequence[str] | None = None,
                        data_dir: str | Path | None = None, tokenizer: str | Path | None = None,
                        denylist: str | Path | None = None, tracking: AuditTracking | None = None,
                        params: Mapping[str, Any] | None = None, progress: bool = True) -> AuditResult:
    """Check every item of ``suite`` (a suite YAML or a loaded suite; ``tasks``: a subset, its
    items under ``data_dir``, default the suite's) against ``index`` and write to ``output``
    ``<suite>.json`` (the report `mimir eval`, `sweep` and `export` read), ``.md``, ``.csv`` and
    ``<suite>_items.jsonl``; with ``denylist``, that file for `mimir prepare --denylist`. Items are
    tokenised with ``tokenizer`` (default: the one the index records), checked to be the index's.
    With ``tracking``, one MLflow run named ``contamination-audit`` holds ``params`` (default:
    the settings) and what the audit checked. The result's ``errors`` name the tasks that could
    not be checked (the others are in the report)."""
    from mimir_megatron.evaluation.suite import load_suite

    from .denylist import write_denylist

    if isinstance(suite, (str, Path)):
        suite = load_suite(str(suite))
    if tasks is not None:
        suite = suite.select(list(tasks))
    if not isinstance(index, AuditIndex):
        if not Path(index).is_dir():
            raise UserError(f"index not found: {index}")
        index = AuditIndex(index)
    check_ngram(settings.ngram, index)
    if settings.max_hits < 1:
        raise UserError(f"--max-hits must be >= 1, got {settings.max_hits}")
    if settings.limit is not None and settings.limit < 1:
        raise UserError(f"--limit must be >= 1, got {settings.limit}")
    tokenizer_dir, recorded = check_tokenizer(index, str(tokenizer) if tokenizer else None)
    index.words()  # the word stream the folded pass reads (an index of an older mimir has none)
    # every check above: nothing is written before them
    results = run_contamination(index, suite, Path(data_dir or suite.data_dir), tokenizer_dir, settings,
                                progress=progress)
    report = contamination_report(results, suite, index, recorded, settings)
    files = write_report(report, results, Path(output), index)
    table = files[1]
    if denylist:
        entries = denylist_entries(results, settings.ngram)
        source = {"suite": suite.name, "suite_file": suite.source, "index": str(index.path.resolve()),
                  "report": str(files[0].resolve())}
        files.append(write_denylist(denylist, recorded, settings.ngram, entries, source))
        log.info("denylist %s: %d entries from %d contaminated items", denylist, len(entries),
                 len({(e["benchmark"], e["item"]) for e in entries}))
    metrics = report.metrics()
    run_id = None
    if tracking is not None:
        asked = asdict(settings) if params is None else dict(params)
        run_id = tracking.log("contamination-audit", {
            **asked, "suite_name": suite.name, "tokenizer_sha256": recorded["sha256"],
            "index_documents": index.num_documents, "index_tokens": index.num_tokens}, metrics, files)
    errors = tuple(f"{b.name}: {b.error}" for b in results if b.error)
    return AuditResult(table, files, metrics, run_id=run_id, errors=errors)
