"""Outputs derived from the state file, and the acceptance report (logged to MLflow).

For every row of the current source whose latest record matches its input hash:
``accepted.jsonl`` gets the chat record (kept and accepted rows, in source order, with a
``synth`` block naming the row), ``verdicts.jsonl`` one line with status and reasons. Both are
written under a temporary name and renamed (:func:`~mimir_megatron.integrity.atomic_files`), so
they are never half-written. The report and the MLflow pointer are records of
:mod:`.run_records`; the local MLflow store is the output directory's
(:class:`~mimir_megatron.checkpoint.run_directory.RunDirectory`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

from mimir_megatron.checkpoint.run_directory import RunDirectory
from mimir_megatron.integrity import atomic_files

from .run_records import REPORT_NAME, STATUSES, AcceptanceReport, EvidenceRow, MlflowPointer
from .source import iter_source
from .evidence_file import StateFile

log = logging.getLogger(__name__)

ACCEPTED_NAME = "accepted.jsonl"
VERDICTS_NAME = "verdicts.jsonl"
_METRIC_KEY = re.compile(r"[^A-Za-z0-9_.\-/ ]")


class _Tally:
    """The counts of the acceptance report, row by row."""

    def __init__(self) -> None:
        self.status: Counter = Counter()
        self.discard_reasons: Counter = Counter()
        self.error_reasons: Counter = Counter()
        self.regenerate_reasons: Counter = Counter()
        self.check_failures: Counter = Counter()
        self.generations: Counter = Counter()
        self.calls = {"generator": 0, "auditor": 0, "retries": 0}

    def add(self, row: EvidenceRow) -> int:
        """Count ``row``; its generator calls."""
        self.status[row.status] += 1
        if row.status == "discarded":
            self.discard_reasons.update(row.reasons)
        elif row.status == "error":
            self.error_reasons.update(row.reasons)
        generations = 0
        for attempt in row.attempts:
            for stage, call in (("generator", attempt.generator), ("auditor", attempt.auditor)):
                if call is not None:
                    self.calls[stage] += 1
                    self.calls["retries"] += call.retries
            generations += attempt.generator is not None
            self.check_failures.update(attempt.failed_checks)
            if attempt.verdict == "regenerate":
                self.regenerate_reasons.update(attempt.verdict_reasons)
        self.generations[generations] += 1
        return generations


def finalize(pipeline: Any, state: StateFile, out: Path, stopped: str | None = None) -> AcceptanceReport:
    cfg = pipeline.config
    tally = _Tally()
    source_rows = 0
    src = cfg.source
    with (atomic_files(out / ACCEPTED_NAME, out / VERDICTS_NAME) as (accepted_tmp, verdicts_tmp),
          accepted_tmp.open("w", encoding="utf-8") as accepted,
          verdicts_tmp.open("w", encoding="utf-8") as verdicts):
        for source_row in iter_source(pipeline.source_path, src.format, src.id_field, src.limit):
            source_rows += 1
            entry = state.index.get(source_row.row_id)
            if entry is None or entry.sha256 != source_row.sha256:
                continue
            row = state.read(entry)
            generations = tally.add(row)
            _line(verdicts, {"row_id": row.row_id, "status": row.status, "reasons": list(row.reasons),
                             "attempts": len(row.attempts), "generations": generations})
            if row.status in ("kept", "accepted"):
                _line(accepted, dict(row.output or {}) | {"synth": {
                    "pipeline": cfg.name, "row_id": row.row_id, "status": row.status,
                    "input_sha256": row.input_sha256}})
    _write_provenance(pipeline, out / ACCEPTED_NAME)
    decided = sum(tally.status.values())
    report = AcceptanceReport(
        pipeline=cfg.name, fingerprint=str(pipeline.fingerprint()), source_rows=source_rows, decided=decided,
        pending=source_rows - decided, status={s: tally.status[s] for s in STATUSES},
        acceptance_rate=(tally.status["kept"] + tally.status["accepted"]) / decided if decided else 0.0,
        discard_reasons=dict(tally.discard_reasons.most_common()),
        error_reasons=dict(tally.error_reasons.most_common()),
        regenerate_reasons=dict(tally.regenerate_reasons.most_common()),
        check_failures=dict(tally.check_failures.most_common()),
        generations_per_row={str(k): v for k, v in sorted(tally.generations.items())},
        calls=tally.calls, models={name: ep.model for name, ep in cfg.endpoints.items()}, stopped=stopped)
    report.write(out)
    log.info("%s", format_report(report))
    if cfg.tracking.enabled:
        log_to_mlflow(report, pipeline, out)
    return report


def _line(f: Any, obj: Any) -> None:
    f.write(json.dumps(obj, ensure_ascii=False) + "\n")


def format_report(report: AcceptanceReport) -> str:
    s = report.status
    lines = [f"acceptance report for {report.pipeline}: {report.decided} of {report.source_rows} "
             f"rows decided, acceptance {100 * report.acceptance_rate:.1f} %",
             f"  kept {s['kept']}  accepted {s['accepted']}  discarded {s['discarded']}  error {s['error']}"]
    for title, reasons in (("discarded", report.discard_reasons), ("error", report.error_reasons),
                           ("regenerated", report.regenerate_reasons)):
        if reasons:
            lines.append(f"  {title}: " + ", ".join(f"{k} {v}" for k, v in reasons.items()))
    return "\n".join(lines)


def _metrics(report: AcceptanceReport) -> dict[str, float]:
    m = {"source_rows": report.source_rows, "decided": report.decided,
         "acceptance_rate": report.acceptance_rate}
    m |= {f"status.{k}": v for k, v in report.status.items()}
    for prefix, reasons in (("discard_reason", report.discard_reasons),
                            ("error_reason", report.error_reasons),
                            ("regenerate_reason", report.regenerate_reasons),
                            ("check_failure", report.check_failures)):
        m |= {f"{prefix}.{_METRIC_KEY.sub('_', k)}": v for k, v in reasons.items()}
    m |= {f"calls.{k}": v for k, v in report.calls.items()}
    return {k: float(v) for k, v in m.items()}


def log_to_mlflow(report: AcceptanceReport, pipeline: Any, out: Path) -> str | None:
    """One MLflow run per output directory (resumed by later invocations); never fails the run."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    cfg = pipeline.config
    try:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        from mimir_megatron.mlflow_store import create_run

        store = RunDirectory(out)
        uri = cfg.tracking.uri or store.mlflow_uri
        client = MlflowClient(tracking_uri=uri)
        pointer = MlflowPointer.read(out)
        run_id = pointer.run_id if pointer is not None else None
        if run_id is None:
            exp = client.get_experiment_by_name(cfg.tracking.experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(
                cfg.tracking.experiment, artifact_location=store.artifact_root)
            run = create_run(client, exp_id, cfg.name, {"mimir.kind": "synth"})
            run_id = run.info.run_id
            params = {"pipeline": cfg.name, "fingerprint": report.fingerprint,
                      "source": str(pipeline.source_path), "max_generations": cfg.max_generations}
            params |= {f"model.{k}": v for k, v in report.models.items()}
            client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
            MlflowPointer(run_id, uri).write(out)
        import time

        now = int(time.time() * 1000)
        step = report.decided
        client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in _metrics(report).items()])
        client.log_artifact(run_id, str(out / REPORT_NAME))
        client.set_terminated(run_id, "FINISHED" if not report.stopped else "KILLED")
        log.info("acceptance report logged to MLflow run %s (%s)", run_id, uri)
        return run_id
    except Exception as exc:  # noqa: BLE001 - tracking must never lose the produced rows
        log.warning("could not log the acceptance report to MLflow: %s", exc)
        return None


def _write_provenance(pipeline: Any, accepted: Path) -> None:
    """The accepted rows' provenance sidecar: derived from the source file's record (its licence
    and languages inherited), synthetic, made by the generator and auditor models."""
    from mimir_megatron.data.provenance import derived_provenance, normalise_license, write_sidecar

    cfg = pipeline.config
    endpoints = {stage: cfg.endpoints[getattr(cfg, stage).endpoint] for stage in ("generate", "audit")}
    generator = endpoints["generate"]
    if not generator.license:
        log.warning("endpoints: the generator's license is not set: the accepted rows' terms are "
                    "'unknown', which the default data policy refuses to train on")
    write_sidecar(accepted, derived_provenance(
        [pipeline.source_path], id=cfg.name, source=f"mimir synth run {cfg.name}", form=cfg.output.form,
        basis="synthetic", generator=f"generator {generator.model}, auditor {endpoints['audit'].model}",
        generator_license=normalise_license(generator.license)[0] if generator.license else None))
