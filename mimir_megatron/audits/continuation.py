"""Audit 2, the fixed greedy 64+64 protocol: a 64-token window of a training document as the
prompt, 64 greedy tokens, exact match against the document's true continuation.

``method='score'`` checks all 64 positions in one forward pass (the continuation is greedy iff
each of its tokens is the argmax after the true tokens before it: the same verdict as decoding,
64x fewer model calls); ``method='generate'`` decodes and compares, as a cross-check.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from .model import AuditModel
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
    seed: int = 0
    batch_size: int = 32


def run_continuation_audit(model: AuditModel, sources: list[AuditSource], settings: ContinuationSettings,
                           progress: bool = True) -> tuple[list[dict], list[Probe]]:
    """Returns (Table 12 rows with a total row, the probes that matched exactly)."""
    from tqdm import tqdm

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
    rows, matches = [], []
    for category, probes in windows.items():
        hits: list[Probe] = []
        for first in range(0, len(probes), settings.batch_size):
            batch = probes[first:first + settings.batch_size]
            hits.extend(p for p, ok in zip(batch, _exact(model, batch, settings)) if ok)
            bar.update(len(batch))
        unique = {(tuple(p.prompt_ids), tuple(p.continuation_ids)) for p in hits}
        rows.append({"category": category, "evaluations": len(probes), "exact matches": len(hits),
                     "rate (%)": 100.0 * len(hits) / len(probes) if probes else 0.0,
                     "unique pairs": len(unique)})
        matches.extend(hits)
    bar.close()
    evaluations = sum(r["evaluations"] for r in rows)
    unique_all = {(tuple(p.prompt_ids), tuple(p.continuation_ids)) for p in matches}
    rows.append({"category": "Total", "evaluations": evaluations, "exact matches": len(matches),
                 "rate (%)": 100.0 * len(matches) / evaluations if evaluations else 0.0,
                 "unique pairs": len(unique_all)})
    return rows, matches


def _exact(model: AuditModel, batch: list[Probe], settings: ContinuationSettings) -> list[bool]:
    if settings.method == "score":
        return model.greedy_reproduces([(p.prompt_ids, p.continuation_ids) for p in batch])
    outputs = model.greedy([p.prompt_ids for p in batch], settings.continuation_tokens, stop=False)
    return [out[:settings.continuation_tokens] == p.continuation_ids for out, p in zip(outputs, batch)]


def write_matches(matches: list[Probe], path: Path, decode) -> Path:
    """One JSON line per exact match, for adjudication by a person or an LLM."""
    with path.open("w") as f:
        for p in matches:
            f.write(json.dumps({
                "dataset": p.source, "category": p.category, "document": p.document, "offset": p.offset,
                "prefix_text": decode(p.prompt_ids), "continuation_text": decode(p.continuation_ids),
                "prefix_ids": p.prompt_ids, "continuation_ids": p.continuation_ids,
            }, ensure_ascii=False) + "\n")
    return path
