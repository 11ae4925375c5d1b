"""Audit 1, the prefix attack: greedy outputs from 50-token source prefixes (per category) and
from generic prompts; for each output the longest verbatim span present in any training document.

Table 11 columns, per setting (our reading of the paper's definitions):

- training documents: the documents of the category (all documents for the generic setting);
- matched documents: distinct documents of the setting that contain the longest span of some
  output, counting spans of at least ``min_match`` tokens; match rate = matched / training;
- matches >= 50 tokens: distinct documents that contain a span of >= 50 tokens of some output;
- average longest span: mean over outputs of the longest span (tokens), whether or not it counts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mimir_megatron.checkpoint.model_dir import ModelDir
from mimir_megatron.errors import UserError

from .index_query import AuditIndex
from .model import AuditModel
from .outputs import AuditResult, AuditTracking
from .sampling import CategoryDocuments, Probe, sample_prefixes

log = logging.getLogger("mimir.audit")

GENERIC = "generic"


@dataclass
class PrefixSettings:
    categories: list[str]
    per_category: int = 500
    prefix_tokens: int = 50
    max_new_tokens: int = 128
    min_match: int = 10
    long_match: int = 50
    max_hits: int = 10_000
    position: str = "start"
    seed: int = 0
    batch_size: int = 32


@dataclass
class PrefixOutcome:
    setting: str
    source: str | None
    document: int | None
    offset: int | None
    prompt_ids: list[int]
    output_ids: list[int]
    span_start: int
    span_length: int
    span_hits: int
    reproduces_source: bool
    """The output starts with the probe document's own continuation for >= long_match tokens."""


def prefix_audit(model: ModelDir | AuditModel, index: str | Path | AuditIndex, output: str | Path,
                 settings: PrefixSettings, *, generic: str | Path | list[dict] | None = None,
                 ema: bool = False, tokenizer: str | Path | None = None,
                 tracking: AuditTracking | None = None, params: Mapping[str, Any] | None = None,
                 progress: bool = True) -> AuditResult:
    """`mimir audit prefix`: the audit of ``model`` (a model directory, loaded with ``ema`` and
    ``tokenizer``, or a loaded :class:`AuditModel`) against ``index``, written to ``output``:
    ``table11.md`` / ``.csv`` / ``.json``, ``prefix_outputs.jsonl`` and ``match_lengths.png``.
    ``generic``: generic prompts (a JSONL file, :func:`read_generic_prompts`, or its records).
    With ``tracking``, one MLflow run named ``prefix-audit`` holds ``params`` (default: the
    settings), the table's numbers as metrics and the files."""
    from .outputs import match_length_figure, write_table

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    index = index if isinstance(index, AuditIndex) else AuditIndex(index)
    if isinstance(generic, (str, Path)):
        generic = read_generic_prompts(str(generic))
    if isinstance(model, ModelDir):
        from . import model as audit_model

        model = audit_model.load_audit_model(model, ema=ema, tokenizer=str(tokenizer) if tokenizer else None,
                                             batch_size=settings.batch_size)
    rows, outcomes, lengths = run_prefix_audit(model, index, settings, generic, progress=progress)
    files = write_table(rows, out, "table11", "Prefix audit (Table 11 layout)")
    files.append(write_outcomes(outcomes, out / "prefix_outputs.jsonl", model.decode))
    files.append(match_length_figure(lengths, out / "match_lengths.png", settings.long_match))
    metrics = {f"{r['setting']}/{k}": v for r in rows for k, v in r.items()
               if isinstance(v, (int, float)) and k != "setting"}
    run_id = None
    if tracking is not None:
        asked = asdict(settings) if params is None else dict(params)
        run_id = tracking.log("prefix-audit", {**asked, "model_name": model.name}, metrics, files)
    return AuditResult(out / "table11.md", files, metrics, rows, run_id)


def run_prefix_audit(model: AuditModel, index: AuditIndex, settings: PrefixSettings,
                     generic: list[dict] | None = None, progress: bool = True):
    """Returns (Table 11 rows, outcomes, longest-span lengths per setting)."""
    from tqdm import tqdm

    sources = index.audit_sources
    probes: dict[str, list[Probe | None]] = {}
    prompts: dict[str, list[list[int]]] = {}
    for category in settings.categories:
        docs = CategoryDocuments(sources, category)
        found = sample_prefixes(docs, settings.per_category, settings.prefix_tokens, settings.seed,
                                settings.position)
        if len(found) < settings.per_category:
            log.warning("category %s: %d documents longer than %d tokens, fewer than %d asked",
                        category, len(found), settings.prefix_tokens, settings.per_category)
        probes[category] = list(found)
        prompts[category] = [p.prompt_ids for p in found]
    if generic:
        if GENERIC in probes:
            raise UserError(f"a category may not be named {GENERIC!r} when --generic is given")
        probes[GENERIC] = [None] * len(generic)
        prompts[GENERIC] = [model.prompt_ids(r) for r in generic]

    total = sum(map(len, prompts.values()))
    bar = tqdm(total=total, desc="prefix audit", unit="prompt", disable=not progress)
    per_category_docs = index.documents_per_category()
    rows, outcomes, lengths = [], [], {}
    for setting, setting_prompts in prompts.items():
        matched: set[tuple[str, int]] = set()
        long: set[tuple[str, int]] = set()
        spans = []
        for first in range(0, len(setting_prompts), settings.batch_size):
            batch = setting_prompts[first:first + settings.batch_size]
            outputs = model.greedy(batch, settings.max_new_tokens)
            longest = index.longest_matches(outputs)
            for k, (prompt, output) in enumerate(zip(batch, outputs)):
                probe = probes[setting][first + k]
                start, length = longest[k]
                span = output[start:start + length]
                hits = index.locate(span, settings.max_hits) if length >= settings.min_match else []
                in_setting = [h for h in hits if setting == GENERIC or h.category == setting]
                matched.update((h.source, h.document) for h in in_setting)
                if length >= settings.long_match:
                    long.update((h.source, h.document) for h in in_setting)
                reproduces = probe is not None and len(probe.continuation_ids) >= settings.long_match and (
                    output[:settings.long_match] == probe.continuation_ids[:settings.long_match])
                spans.append(length)
                outcomes.append(PrefixOutcome(
                    setting, probe.source if probe else None, probe.document if probe else None,
                    probe.offset if probe else None, list(prompt), list(output), start, length,
                    index.count(span) if length else 0, bool(reproduces)))
            bar.update(len(batch))
        training = index.num_documents if setting == GENERIC else per_category_docs.get(setting, 0)
        rows.append({
            "setting": "Generic" if setting == GENERIC else f"Prefix {setting}",
            "prompts": len(setting_prompts),
            "training documents": training,
            "matched documents": len(matched),
            "match rate (%)": 100.0 * len(matched) / training if training else 0.0,
            f"matches >= {settings.long_match} tokens": len(long),
            f">= {settings.long_match}-token rate (%)": 100.0 * len(long) / training if training else 0.0,
            f"outputs with a >= {settings.long_match}-token span":
                int(sum(s >= settings.long_match for s in spans)),
            "average longest span": float(np.mean(spans)) if spans else 0.0,
        })
        lengths[rows[-1]["setting"]] = spans
    bar.close()
    return rows, outcomes, lengths


def write_outcomes(outcomes: list[PrefixOutcome], path: Path, decode) -> Path:
    with path.open("w") as f:
        for o in outcomes:
            record = asdict(o)
            record["prompt_text"] = decode(o.prompt_ids)
            record["output_text"] = decode(o.output_ids)
            record["span_text"] = decode(o.output_ids[o.span_start:o.span_start + o.span_length])
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def read_generic_prompts(path: str) -> list[dict]:
    """JSONL, one prompt per line: {"prompt_ids": [...]}, {"messages": [...]} or {"prompt": "..."}."""
    records = []
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--generic {path}: file not found")
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not ({"prompt_ids", "messages", "prompt"} & set(record)):
            raise UserError(f"{path}:{n}: expected an object with prompt_ids, messages or prompt")
        records.append(record)
    if not records:
        raise UserError(f"--generic {path}: no prompts")
    return records
