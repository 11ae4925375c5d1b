"""Which prepared datasets an audit covers, and the audit group of each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mimir_megatron.errors import UserError


@dataclass(frozen=True)
class AuditSource:
    """One prepared dataset of the training data, named and grouped for the audit tables."""

    name: str
    path: Path
    category: str
    """The audit group (the mixture's ``audit_category``, else the group the dataset's provenance
    declares, else its ``category``)."""


def resolve_sources(mixture: str | None = None, data: list[str] | None = None) -> list[AuditSource]:
    """Sources from a mixture YAML, or from prepared directories given as ``[CATEGORY=]PATH``.

    Repeats do not matter here: the index holds every document once, however often it is trained.
    """
    from mimir_megatron.data.mixture import load_mixture
    from mimir_megatron.data.manifest import MANIFEST_NAME, Manifest
    from mimir_megatron.data.provenance import provenance_from_record

    if bool(mixture) == bool(data):
        raise UserError("give exactly one of --mixture MIX.yaml or --data [CATEGORY=]PREPARED_DIR ...")
    if mixture:
        mix = load_mixture(mixture)
        sources = [AuditSource(e.name, e.path, e.audit_group_of(
            provenance_from_record(Manifest.read(e.path).provenance,
                                   f"dataset {e.name}: {e.path / MANIFEST_NAME}: provenance")))
            for e in mix.entries]
    else:
        sources, names = [], set()
        for item in data or []:
            category, _, path = item.rpartition("=") if "=" in item else ("uncategorised", "", item)
            p = Path(path).resolve()
            name = p.name
            if name in names:
                raise UserError(f"--data: two datasets named {name!r}; give distinct directory names")
            names.add(name)
            sources.append(AuditSource(name, p, category))
    for s in sources:
        Manifest.read(s.path)  # a clear error for a dataset that is declared but not prepared
    return sources
