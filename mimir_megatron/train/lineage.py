"""The data lineage of a run: what of each dataset went into the weights, counted from the batches.

Each dataset's entry also pins the digest its manifest carried when the run trained on it, so
that a manifest rewritten later (a licence changed and both digests recomputed) is named at
export (:func:`mimir_megatron.release.summary.lineage_problems`).

Every batch of the training loader carries the counts of the documents packed into it, per
dataset of the mixture (``Batch.sources``). Each rank adds up the micro-batches it trains on; a
checkpoint sums them over the data-parallel group (tensor-parallel peers see the same batches and
are not added twice) onto the counts the run resumed with. A resume after a kill therefore
continues from the checkpoint's counts, and the steps replayed after it are counted once.

A model's lineage includes what it started from: a run continued from other weights
(``checkpoint.init_from``) records the base checkpoint's lineage, and a resumed run carries the
lineage of the steps before (perhaps trained under another configuration). Before step 1 the gate
judges all of it by this run's data policy (:func:`earlier_training_problems`), as export does.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mimir_megatron.checkpoint import BaseModel, DatasetLineage
from mimir_megatron.data.manifest import Manifest
from mimir_megatron.data.mixture import Mixture
from mimir_megatron.data.policy import DataPolicy, model_lineage_problems
from mimir_megatron.data.provenance import UNKNOWN_RECORD, provenance_from_record
from mimir_megatron.errors import UserError


def mixture_lineage(mixture: Mixture) -> list[DatasetLineage]:
    """One zero-count entry per dataset of ``mixture``, in its order, with its provenance."""
    entries = []
    for entry in mixture.entries:
        manifest = Manifest.read(entry.path)
        record = dict(manifest.provenance or UNKNOWN_RECORD)
        provenance = provenance_from_record(record, f"dataset {entry.name}: {entry.path}: provenance")
        entries.append(DatasetLineage(
            name=entry.name, path=str(entry.path), category=entry.category, language=entry.language,
            audit_group=entry.audit_group_of(provenance), provenance=record,
            provenance_digest=provenance.digest if provenance else None,
            manifest_digest=manifest.digest,
            personal_data=manifest.personal_data.to_dict() if manifest.personal_data is not None else None,
        ))
    return entries


def earlier_training_problems(resume_from: Path | None, init_from: str | None,
                              policy: DataPolicy) -> list[str]:
    """What the weights a run starts from were trained on, judged by this run's ``policy``: the
    checkpoint it resumes (its own steps, and its base), else the ``checkpoint.init_from`` weights
    (their lineage and theirs). Read from the trainer states alone (no tensors)."""
    from mimir_megatron import checkpoint as ckpt
    from mimir_megatron.interop import CONFIG_FILE

    if resume_from is not None:
        try:
            state = ckpt.read_trainer_state(resume_from)
        except UserError:
            return []  # damaged: the resume's verification names it (or falls back to an older one)
        return model_lineage_problems(state.lineage, state.base_model, policy,
                                      f"checkpoint {resume_from} (resumed)")
    if not init_from:
        return []
    source = Path(init_from)
    if (source / CONFIG_FILE).is_file():  # `mimir import` weights: no lineage
        return model_lineage_problems(None, BaseModel(source=str(source.resolve())), policy, "")
    path = ckpt.resolve(source)
    state = ckpt.read_trainer_state(path)
    base = BaseModel(source=str(path.resolve()), step=state.step, lineage=state.lineage,
                     base_model=state.base_model)
    return model_lineage_problems(None, base, policy, "")


class LineageCounter:
    """Per-dataset documents, tokens and response tokens consumed, for one rank."""

    def __init__(self, mixture: Mixture, resumed: tuple[DatasetLineage, ...] = ()) -> None:
        self.entries = mixture_lineage(mixture)
        self.policy = asdict(mixture.policy)
        before = {e.name: e for e in resumed}
        self.base = np.array([[getattr(before[e.name], k, 0) if e.name in before else 0
                               for k in ("documents", "tokens", "response_tokens")]
                              for e in self.entries], dtype=np.int64).reshape(-1, 3)
        # Datasets the run trained on before and no longer has in its mixture stay on record.
        current = {e.name for e in self.entries}
        self.retired = tuple(e for e in resumed if e.name not in current)
        self.local = np.zeros_like(self.base)

    def add(self, sources: np.ndarray | None) -> None:
        """Count one micro-batch's ``Batch.sources``."""
        if sources is None:
            raise ValueError("a training batch without its source counts (Batch.sources)")
        self.local += sources

    def snapshot(self, dp_group) -> tuple[DatasetLineage, ...]:
        """The run's lineage so far; collective over ``dp_group``."""
        summed = torch.from_numpy(self.local.copy())
        dist.all_reduce(summed, group=dp_group)
        totals = self.base + summed.numpy()
        return tuple(replace(e, documents=int(d), tokens=int(t), response_tokens=int(r))
                     for e, (d, t, r) in zip(self.entries, totals)) + self.retired
