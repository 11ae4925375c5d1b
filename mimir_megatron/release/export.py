"""`mimir export` as a function: a model written as a transformers directory with its model card
and, from a training checkpoint, its training-data summary, logged to the training run's MLflow."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mimir_megatron.checkpoint import TrainingRecord
from mimir_megatron.errors import UserError


@dataclass(frozen=True)
class ReleaseDetails:
    """What the model card and the training-data summary say beyond the weights."""

    name: str | None = None
    """The model's name (default: the output directory's name)."""
    license: str | None = None
    """An SPDX licence expression (default: 'other', unspecified)."""
    provider: str | None = None
    provider_contact: str | None = None
    model_version: str | None = None
    placed_on_market: str | None = None
    """YYYY-MM-DD."""
    base_model: str | None = None
    """Hub id of the weights training started from (default: the init_from path recorded)."""
    accept_licence_risk: bool = False
    contamination: Sequence[str | Path] | None = None
    """`mimir audit contamination` reports, files or directories (default: the run's own)."""


def export_model(model, output: str | Path, details: ReleaseDetails = ReleaseDetails(), *,  # noqa: ANN001
                 record: TrainingRecord | None = None, origin: str = "", ema: bool = False,
                 tokenizer: str | Path | None = None, register: str | None = None,
                 mlflow: bool = True) -> Path:
    """Write ``model`` to ``output`` (transformers ``hrm_text``, ``tokenizer`` copied alongside)
    with ``README.md`` (the model card) and, when it comes from the training checkpoint
    ``record``, ``training_data_summary.md/.json``; a checkpoint's export is then logged to its
    training run as a LoggedModel (``mlflow``), registered as ``register``. ``origin`` says where
    weights without a record came from; ``ema``: they are the checkpoint's EMA."""
    from mimir_megatron.interop import export_hf

    if register and (record is None or not mlflow):
        raise UserError("--register needs a training checkpoint's export logged to MLflow (not --no-mlflow)")
    files = release_files(model, output, details, record=record, origin=origin, ema=ema)
    export_hf(model, str(output), tokenizer_dir=str(tokenizer) if tokenizer else None, extra_files=files)
    if record is not None and mlflow:
        from .tracking import log_exported_model

        log_exported_model(Path(output), record, details.name or Path(output).resolve().name,
                           register=register, reports=contamination_reports(details.contamination, record))
    return Path(output)


def release_files(model, output: str | Path, details: ReleaseDetails, *,  # noqa: ANN001
                  record: TrainingRecord | None = None, origin: str = "",
                  ema: bool = False) -> dict[str, str]:
    """The model card and the training-data summary (from the checkpoint's lineage, if any), by
    file name; a bad licence or date, or a lineage that no longer matches its data, is refused."""
    from mimir_megatron.model import count_parameters

    from .card import hf_license, model_card
    from .summary import contamination_summary, summary_markdown, training_data_summary

    hf_license(details.license)  # a bad --license is refused before anything is written
    date = details.placed_on_market
    if date:
        import datetime

        try:
            datetime.date.fromisoformat(date)
        except ValueError:
            raise UserError(f"--placed-on-market: a date YYYY-MM-DD, got {date!r}") from None
    name = details.name or Path(output).resolve().name
    cfg = model.cfg
    info = {"layers_l": cfg.num_layers_L, "layers_h": cfg.num_layers_H, "hidden": cfg.hidden_size,
            "schedule": "".join(("L" * cfg.l_cycles + "H") * cfg.h_cycles),
            "parameters": f"{count_parameters(model).total:,}"}
    files: dict[str, str] = {}
    summary, base_model = None, details.base_model
    if record is None:
        info["training"] = f"Not recorded: exported from {origin}."
    else:
        path, state = record.checkpoint, record.state
        from mimir_megatron.yaml_config import raise_errors

        from .summary import lineage_problems

        raise_errors(lineage_problems(state, path), f"refusing to export {path}'s release documents")
        contamination = contamination_summary(contamination_reports(details.contamination, record), state)
        summary = training_data_summary(state, model_name=name, provider=details.provider,
                                        checkpoint=str(path), contamination=contamination,
                                        provider_contact=details.provider_contact,
                                        model_version=details.model_version, placed_on_market=date)
        files["training_data_summary.json"] = json.dumps(summary, indent=2, ensure_ascii=False) + "\n"
        files["training_data_summary.md"] = summary_markdown(summary)
        if base_model is None and state.base_model is not None:
            base_model = state.base_model.source
        weights = "the EMA of the weights" if ema else "the trained weights"
        info["training"] = (f"{state.step:,} optimizer steps ({state.consumed_samples:,} packed contexts); "
                            f"exported from {path.name} ({weights}).")
    files["README.md"] = model_card(model_name=name, model_info=info, summary=summary,
                                    license=details.license, base_model=base_model,
                                    accept_licence_risk=details.accept_licence_risk)
    return files


def contamination_reports(given: Sequence[str | Path] | None, record: TrainingRecord) -> list[Path]:
    """The reports named (a directory: its ``*.json``), else the training run's own
    (``RUN/contamination/*.json``)."""
    if not given:
        return sorted(record.run_directory.contamination.glob("*.json"))
    reports: list[Path] = []
    for item in map(Path, given):
        if not item.exists():
            raise UserError(f"contamination report not found: {item}")
        reports += sorted(item.glob("*.json")) if item.is_dir() else [item]
    return reports
