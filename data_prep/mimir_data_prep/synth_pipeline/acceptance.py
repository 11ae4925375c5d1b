"""Outputs derived from the state file, and the acceptance report (logged to MLflow).

For every row of the current source whose latest record matches its input hash:
``accepted.jsonl`` gets the chat record (kept and accepted rows, in source order, with a
``synth`` block naming the row), ``verdicts.jsonl`` one line with status and reasons. Both are
written under a temporary name and renamed, so they are never half-written.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

from .source import iter_source
from .state import StateFile

log = logging.getLogger(__name__)

ACCEPTED_NAME = "accepted.jsonl"
VERDICTS_NAME = "verdicts.jsonl"
REPORT_NAME = "report.json"
MLFLOW_RUN_NAME = "mlflow_run.json"
_METRIC_KEY = re.compile(r"[^A-Za-z0-9_.\-/ ]")


class _AtomicLines:
    def __init__(self, path: Path):
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self.f = self.tmp.open("w", encoding="utf-8")

    def write(self, obj: Any) -> None:
        self.f.write(json.dumps(obj, ensure_ascii=False) + "\n")

    def commit(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)


def finalize(pipeline: Any, state: StateFile, out: Path, stopped: str | None = None) -> dict[str, Any]:
    cfg = pipeline.config
    status: Counter = Counter()
    discard_reasons: Counter = Counter()
    error_reasons: Counter = Counter()
    regenerate_reasons: Counter = Counter()
    check_failures: Counter = Counter()
    generations: Counter = Counter()
    calls = {"generator": 0, "auditor": 0, "retries": 0}
    source_rows = 0
    accepted = _AtomicLines(out / ACCEPTED_NAME)
    verdicts = _AtomicLines(out / VERDICTS_NAME)
    src = cfg.source
    for row in iter_source(pipeline.source_path, src.format, src.id_field, src.limit):
        source_rows += 1
        entry = state.index.get(row.row_id)
        if entry is None or entry.sha256 != row.sha256:
            continue
        rec = state.read(entry)
        status[rec["status"]] += 1
        codes = [r["code"] for r in rec["reasons"]]
        if rec["status"] == "discarded":
            discard_reasons.update(codes)
        elif rec["status"] == "error":
            error_reasons.update(codes)
        n_gen = 0
        for attempt in rec["attempts"]:
            for stage in ("generator", "auditor"):
                if attempt.get(stage):
                    calls[stage] += 1
                    calls["retries"] += len(attempt[stage]["retries"])
            n_gen += bool(attempt.get("generator"))
            check_failures.update(c["name"] for c in attempt.get("checks", []) if not c["passed"])
            verdict = attempt.get("verdict") or {}
            if verdict.get("verdict") == "regenerate":
                regenerate_reasons.update(r["code"] for r in verdict.get("reasons", []))
        generations[n_gen] += 1
        verdicts.write({"row_id": rec["row_id"], "status": rec["status"], "reasons": codes,
                        "attempts": len(rec["attempts"]), "generations": n_gen})
        if rec["status"] in ("kept", "accepted"):
            accepted.write(rec["output"] | {"synth": {"pipeline": cfg.name, "row_id": rec["row_id"],
                                                      "status": rec["status"],
                                                      "input_sha256": rec["input_sha256"]}})
    accepted.commit()
    verdicts.commit()
    _write_provenance(pipeline, out / ACCEPTED_NAME)
    decided = sum(status.values())
    kept_or_accepted = status["kept"] + status["accepted"]
    report = {
        "pipeline": cfg.name,
        "fingerprint": pipeline.fingerprint(),
        "source_rows": source_rows,
        "decided": decided,
        "pending": source_rows - decided,
        "status": {s: status[s] for s in ("kept", "accepted", "discarded", "error")},
        "acceptance_rate": kept_or_accepted / decided if decided else 0.0,
        "discard_reasons": dict(discard_reasons.most_common()),
        "error_reasons": dict(error_reasons.most_common()),
        "regenerate_reasons": dict(regenerate_reasons.most_common()),
        "check_failures": dict(check_failures.most_common()),
        "generations_per_row": {str(k): v for k, v in sorted(generations.items())},
        "calls": calls,
        "models": {name: ep.model for name, ep in cfg.endpoints.items()},
        "stopped": stopped,
    }
    tmp = out / (REPORT_NAME + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out / REPORT_NAME)
    log.info("%s", format_report(report))
    if cfg.tracking.enabled:
        log_to_mlflow(report, pipeline, out)
    return report


def format_report(report: dict[str, Any]) -> str:
    s = report["status"]
    lines = [f"acceptance report for {report['pipeline']}: {report['decided']} of {report['source_rows']} "
             f"rows decided, acceptance {100 * report['acceptance_rate']:.1f} %",
             f"  kept {s['kept']}  accepted {s['accepted']}  discarded {s['discarded']}  error {s['error']}"]
    for title, key in (("discarded", "discard_reasons"), ("error", "error_reasons"),
                       ("regenerated", "regenerate_reasons")):
        if report[key]:
            lines.append(f"  {title}: " + ", ".join(f"{k} {v}" for k, v in report[key].items()))
    return "\n".join(lines)


def _metrics(report: dict[str, Any]) -> dict[str, float]:
    m = {"source_rows": report["source_rows"], "decided": report["decided"],
         "acceptance_rate": report["acceptance_rate"]}
    m |= {f"status.{k}": v for k, v in report["status"].items()}
    for prefix, key in (("discard_reason", "discard_reasons"), ("error_reason", "error_reasons"),
                        ("regenerate_reason", "regenerate_reasons"), ("check_failure", "check_failures")):
        m |= {f"{prefix}.{_METRIC_KEY.sub('_', k)}": v for k, v in report[key].items()}
    m |= {f"calls.{k}": v for k, v in report["calls"].items()}
    return {k: float(v) for k, v in m.items()}


def log_to_mlflow(report: dict[str, Any], pipeline: Any, out: Path) -> str | None:
    """One MLflow run per output directory (resumed by later invocations); never fails the run."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    cfg = pipeline.config
    try:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        from mimir_megatron.mlflow_store import create_run

        uri = cfg.tracking.uri or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        client = MlflowClient(tracking_uri=uri)
        run_file = out / MLFLOW_RUN_NAME
        run_id = json.loads(run_file.read_text())["run_id"] if run_file.exists() else None
        if run_id is None:
            exp = client.get_experiment_by_name(cfg.tracking.experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(
                cfg.tracking.experiment, artifact_location=(out / "mlartifacts").resolve().as_uri())
            run = create_run(client, exp_id, cfg.name, {"mimir.kind": "synth"})
            run_id = run.info.run_id
            params = {"pipeline": cfg.name, "fingerprint": report["fingerprint"],
                      "source": str(pipeline.source_path), "max_generations": cfg.max_generations}
            params |= {f"model.{k}": v for k, v in report["models"].items()}
            client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
            run_file.write_text(json.dumps({"run_id": run_id, "tracking_uri": uri}))
        import time

        now = int(time.time() * 1000)
        step = report["decided"]
        client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in _metrics(report).items()])
        client.log_artifact(run_id, str(out / REPORT_NAME))
        client.set_terminated(run_id, "FINISHED" if not report["stopped"] else "KILLED")
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
