"""Audit 2, the fixed greedy 64+64 protocol: a 64-token window of a training document as the
prompt, 64 greedy tokens, exact match against the document's true continuation.

``method='score'`` checks all 64 positions in one forward pass (the continuation is greedy iff
each of its tokens is the argmax after the true tokens before it: the same verdict as decoding,
64x fewer model calls); ``method='generate'`` decodes and compares, as a cross-check.

The paper's protocol makes the whole 64-token window a bidirectional prompt. A window cut from a
document's response was causal in training, so that protocol is a lower bound on what the model
reproduces. ``mask='training'`` scores every window a second time with the mask it had in
training (bidirectional only on the tokens that lay in the document's prompt) and reports both.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mimir_megatron.checkpoint.model_dir import ModelDir
from mimir_megatron.errors import UserError

from .index_query import AuditIndex
from .model import AuditModel
from .outputs import AuditResult, AuditTracking
from .sampling import CategoryDocuments, Probe, sample_windows
from .sources import AuditSource

log = logging.getLogger("mimir.audit")


@dataclass
class ContinuationSettings:
    categories: list[str] | None = None
    """None: every category of the sources."""
    samples: int = 1000
    """Windows per category."""
    prefix_tokens: int = 64
    continuation_tokens: int = 64
    method: str = "score"
    mask: str = "prompt"
    """prompt: the paper's protocol only; training: also each window under its training mask."""
    seed: int = 0
    batch_size: int = 32


MASKS = ("prompt", "training")
TRAINING = ", training mask"  # suffix of the training-mask columns


def continuation_audit(model: ModelDir | AuditModel, sources: list[AuditSource] | AuditIndex,
                       output: str | Path, settings: ContinuationSettings, *, ema: bool = False,
                       tokenizer: str | Path | None = None, tracking: AuditTracking | None = None,
                       params: Mapping[str, Any] | None = None, progress: bool = True) -> AuditResult:
    """`mimir audit continuation`: the 64+64 audit of ``model`` (a model directory, loaded with
    ``ema`` and ``tokenizer``, or a loaded :class:`AuditModel`) on ``sources`` (prepared datasets
    with their audit categories, :func:`~.sources.resolve_sources`, or those of an audit index),
    written to ``output``: ``table12.md`` / ``.csv`` / ``.json`` and ``exact_matches.jsonl``
    (with ``mask='training'`` also ``exact_matches_training_mask.jsonl``). With ``tracking``, one
    MLflow run named ``continuation-audit`` holds ``params`` (default: the settings), the table's
    numbers as metrics and the files."""
    from .outputs import write_table

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(sources, AuditIndex):
        sources = sources.audit_sources
    if isinstance(model, ModelDir):
        from . import model as audit_model

        model = audit_model.load_audit_model(model, ema=ema, tokenizer=str(tokenizer) if tokenizer else None,
                                             batch_size=settings.batch_size)
    rows, matches, training_matches = run_continuation_audit(model, sources, settings, progress=progress)
    title = "64+64 exact-continuation audit (Table 12 layout)"
    if settings.mask == "training":
        title += "; columns ending in 'training mask': each window scored with its training mask"
    files = write_table(rows, out, "table12", title)
    files.append(write_matches(matches, out / "exact_matches.jsonl", model.decode))
    if settings.mask == "training":
        files.append(write_matches(training_matches, out / "exact_matches_training_mask.jsonl", model.decode,
                                   mask="training"))
    metrics = {f"{r['category']}/{k}": v for r in rows for k, v in r.items() if isinstance(v, (int, float))}
    run_id = None
    if tracking is not None:
        asked = asdict(settings) if params is None else dict(params)
        run_id = tracking.log("continuation-audit", {**asked, "model_name": model.name}, metrics, files)
    return AuditResult(out / "table12.md", files, metrics, rows, run_id)


def run_continuation_audit(model: AuditModel, sources: list[AuditSource], settings: ContinuationSettings,
                           progress: bool = True) -> tuple[list[dict], list[Probe], list[Probe]]:
    """Returns (Table 12 rows with a total row, the probes that matched exactly under the paper's
    protocol, those that matched under their training mask: empty unless ``mask='training'``)."""
    from tqdm import tqdm

    if settings.mask not in MASKS:
        raise UserError(f"mask must be one of {', '.join(MASKS)}, got {settings.mask!r}")
    if settings.mask == "training" and settings.method != "score":
        raise UserError("--mask training needs --method score (decoding prefills the whole window "
                        "as a bidirectional prompt)")
    training = settings.mask == "training"
    categories = settings.categories or sorted({s.category for s in sources})
    windows = {}
    for category in categories:
        docs = CategoryDocuments(sources, category)
        windows[category] = sample_windows(docs, settings.samples, settings.prefix_tokens,
                                           settings.continuation_tokens, settings.seed)
        if len(windows[category]) < settings.samples:
            log.warning("category %s: only %d windows of %d tokens", category, len(windows[category]),
                        settings.prefix_tokens + settings.continuation_tokens)
    bar = tqdm(total=sum(map(len, windows.values())), desc="64+64 audit", unit="window",
               disable=not progress)
    rows, matches, training_matches = [], [], []
    for category, probes in windows.items():
        hits: list[Probe] = []
        training_hits: list[Probe] = []
        for first in range(0, len(probes), settings.batch_size):
            batch = probes[first:first + settings.batch_size]
            hits.extend(p for p, ok in zip(batch, _exact(model, batch, settings)) if ok)
            if training:
                training_hits.extend(p for p, ok in zip(batch, _exact_training(model, batch)) if ok)
            bar.update(len(batch))
        rows.append(_row(category, len(probes), hits, training_hits if training else None))
        matches.extend(hits)
        training_matches.extend(training_hits)
    bar.close()
    rows.append(_row("Total", sum(r["evaluations"] for r in rows), matches,
                     training_matches if training else None))
    return rows, matches, training_matches


def _row(category: str, evaluations: int, hits: list[Probe], training_hits: list[Probe] | None) -> dict:
    """One Table 12 row; with training-mask hits, each count sits beside its training-mask twin."""
    def counts(found: list[Probe]) -> tuple[int, float, int]:
        unique = {(tuple(p.prompt_ids), tuple(p.continuation_ids)) for p in found}
        return len(found), 100.0 * len(found) / evaluations if evaluations else 0.0, len(unique)

    row: dict = {"category": category, "evaluations": evaluations}
    names = ("exact matches{}", "rate{} (%)", "unique pairs{}")
    for name, value, training in zip(names, counts(hits), counts(training_hits or [])):
        row[name.format("")] = value
        if training_hits is not None:
            row[name.format(TRAINING)] = training
    return row


def _exact(model: AuditModel, batch: list[Probe], settings: ContinuationSettings) -> list[bool]:
    if settings.method == "score":
        return model.greedy_reproduces([(p.prompt_ids, p.continuation_ids) for p in batch])
    outputs = model.greedy([p.prompt_ids for p in batch], settings.continuation_tokens, stop=False)
    return [out[:settings.continuation_tokens] == p.continuation_ids for out, p in zip(outputs, batch)]


def _exact_training(model: AuditModel, batch: list[Probe]) -> list[bool]:
    return model.greedy_reproduces([(p.prompt_ids, p.continuation_ids) for p in batch],
                                   bidirectional_tokens=[p.prompt_in_document_prompt for p in batch])


def write_matches(matches: list[Probe], path: Path, decode, mask: str = "prompt") -> Path:
    """One JSON line per exact match, for adjudication by a person or an LLM."""
    with path.open("w") as f:
        for p in matches:
            f.write(json.dumps({
                "dataset": p.source, "category": p.category, "document": p.document, "offset": p.offset,
                "mask": mask, "bidirectional_tokens": len(p.prompt_ids) if mask == "prompt"
                else p.prompt_in_document_prompt,
                "prefix_text": decode(p.prompt_ids), "continuation_text": decode(p.continuation_ids),
                "prefix_ids": p.prompt_ids, "continuation_ids": p.continuation_ids,
            }, ensure_ascii=False) + "\n")
    return path
