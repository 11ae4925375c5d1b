"""Audit outputs: tables (Markdown, CSV, JSON), the match-length figure, and MLflow logging;
what an audit returns (:class:`AuditResult`) and where its MLflow run goes (:func:`audit_tracking`)."""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mimir_megatron.checkpoint.model_dir import ModelDir
from mimir_megatron.checkpoint.run_directory import RunDirectory

log = logging.getLogger("mimir.audit")

DEFAULT_EXPERIMENT = "mimir-audit"


@dataclass(frozen=True)
class AuditResult:
    """What an audit wrote: the Markdown table (what the command prints), every file (the MLflow
    run's artifacts), the headline metrics, the table's rows and the MLflow run (None: not logged,
    or the store failed)."""

    table: Path
    files: list[Path]
    metrics: dict[str, float]
    rows: list[dict] = field(default_factory=list)
    run_id: str | None = None
    errors: tuple[str, ...] = field(default=())
    """What could not be audited (a contamination check's benchmarks that failed, with why)."""


@dataclass(frozen=True)
class AuditTracking:
    """Where an audit's MLflow run goes: the store, where a new experiment keeps its artifacts,
    the experiment and the training run it is a child of (None: none)."""

    uri: str
    artifact_location: str
    experiment: str = DEFAULT_EXPERIMENT
    parent_run_id: str | None = None

    def log(self, run_name: str, params: Mapping[str, Any], metrics: dict[str, float],
            artifacts: list[Path]) -> str | None:
        """One run of the audit (:func:`log_to_mlflow`); its id, or None with a warning."""
        return log_to_mlflow(self.uri, self.artifact_location, self.experiment, self.parent_run_id, run_name,
                             dict(params), metrics, artifacts)


def audit_tracking(output: str | Path, model: ModelDir | None = None, uri: str | None = None,
                   experiment: str = DEFAULT_EXPERIMENT) -> AuditTracking:
    """Where the MLflow run of an audit writing to ``output`` goes: ``uri``, else for a training
    checkpoint its training run's store and experiment, as a child run of it (its figures and
    tables then sit beside the run's curves), else a sqlite database in the output directory;
    artifacts beside that database, never in ``./mlruns`` of the working directory."""
    from mimir_megatron.evaluation.tracking import tracking_target

    output = Path(output)
    if model is not None and model.record is not None and not uri:
        target = tracking_target(output, record=model.record)
        if target.parent_run_id:
            return AuditTracking(target.uri, target.artifact_root, target.experiment, target.parent_run_id)
    store = RunDirectory(output)
    return AuditTracking(uri or store.mlflow_uri, store.artifact_root, experiment)


def write_table(rows: list[dict], out_dir: Path, stem: str, title: str, json_rows: bool = True,
                notes: list[str] | None = None) -> list[Path]:
    """``stem``.md / .csv / .json with the same rows (no .json when ``json_rows`` is False: the
    caller writes a richer one); ``notes`` are lines under the Markdown table. Returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    columns = list(rows[0]) if rows else []
    md = [f"# {title}", "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        md.append("| " + " | ".join(_fmt(row[c]) for c in columns) + " |")
    if notes:
        md += ["", *notes]
    paths = [out_dir / f"{stem}.md", out_dir / f"{stem}.csv"]
    paths[0].write_text("\n".join(md) + "\n")
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    if json_rows:
        paths.append(out_dir / f"{stem}.json")
        paths[2].write_text(json.dumps(rows, indent=1))
    return paths


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1 else f"{value:.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def match_length_figure(lengths_by_setting: dict[str, list[int]], path: Path, threshold: int) -> Path:
    """Figure 2 layout: distribution of the longest verbatim span per output, one line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    top = max([threshold + 1, *(max(v) for v in lengths_by_setting.values() if v)])
    bins = np.arange(0, top + 2)
    for setting, lengths in lengths_by_setting.items():
        if not lengths:
            continue
        counts, _ = np.histogram(lengths, bins=bins)
        ax.step(bins[:-1], counts / len(lengths), where="post", label=f"{setting} (n={len(lengths)})")
    ax.axvline(threshold, color="grey", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("longest verbatim span in any training document (tokens)")
    ax.set_ylabel("fraction of outputs")
    ax.set_title("Match-length distribution of greedy outputs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def log_to_mlflow(uri: str, artifact_location: str, experiment: str, parent_run_id: str | None, run_name: str,
                  params: dict, metrics: dict[str, float], artifacts: list[Path]) -> str | None:
    """One MLflow run with the audit's parameters, headline metrics and files (a child run of
    ``parent_run_id``, the training run of the audited checkpoint); its id, or None (with a
    warning) when the tracking store cannot be reached: the files on disk are the record.
    A new experiment keeps its artifacts in ``artifact_location`` (MLflow's default would be
    ``./mlruns`` of whatever directory the command runs in)."""
    try:
        from mimir_megatron.mlflow_store import create_run, experiment_id, mlflow_client

        client = mlflow_client(uri, artifact_root=artifact_location)
        exp_id = experiment_id(client, experiment, artifact_location)
        tags = {"mimir.kind": "audit"} | ({"mlflow.parentRunId": parent_run_id} if parent_run_id else {})
        run = create_run(client, exp_id, run_name, tags)
        for key, value in params.items():
            client.log_param(run.info.run_id, key, str(value)[:500])
        for key, value in metrics.items():
            client.log_metric(run.info.run_id, _metric_key(key), float(value))
        for path in artifacts:
            client.log_artifact(run.info.run_id, str(path))
        client.set_terminated(run.info.run_id, "FINISHED")
        return run.info.run_id
    except Exception as exc:  # tracking must not lose a finished audit
        log.warning("MLflow logging to %s failed (%s); results are in the output directory", uri, exc)
        return None


def _metric_key(key: str) -> str:
    key = key.replace(">=", "ge").replace("(%)", "pct").replace("  ", " ").strip()
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./ ")
    return "".join(c if c in allowed else "_" for c in key)
