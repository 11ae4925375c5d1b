"""Mixture YAML: which prepared datasets an epoch contains, and how often.

name: demo
datasets:
  - name: arith-en                 # default: the directory name
    path: ../../data/demo/arith-en # a prepared dataset dir, relative to this YAML file
    category: Arithmetic
    language: en
    repeat: 4                      # copies per epoch; 0.5 = a seeded half of the documents
    tokens: 123456                 # optional: declared size, used by the report when the
                                   # dataset is not prepared (planning a mixture)
    audit_category: B              # optional: overrides the memorisation-audit group the
                                   # dataset's provenance declares (`mimir audit`); default:
                                   # that group, else the category
data_policy:                       # optional: which datasets may be trained on directly
  allow_bases: [open-licence, public-domain, synthetic]   # (mimir_megatron.data.policy)

Every mistake in the file is reported at once, one line each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import Fingerprint, fingerprint

from .policy import DataPolicy, parse_policy
from .manifest import Manifest

_KEYS = {"name", "path", "category", "language", "repeat", "tokens", "audit_category"}
_TOP_KEYS = {"name", "datasets", "data_policy"}


@dataclass(frozen=True)
class MixtureEntry:
    name: str
    path: Path
    category: str
    language: str
    repeat: float = 1.0
    tokens: int | None = None
    audit_category: str | None = None
    """The memorisation-audit group; None means the same as ``category``."""

    def audit_group_of(self, provenance) -> str:
        """The memorisation-audit group: this entry's ``audit_category``, else the one the
        dataset's provenance (a :class:`~.provenance.Provenance` or None) declares, else the
        category."""
        if self.audit_category is not None:
            return self.audit_category
        if provenance is not None and provenance.audit_group:
            return provenance.audit_group
        return self.category


@dataclass(frozen=True)
class Mixture:
    name: str
    source: Path
    entries: tuple[MixtureEntry, ...]
    policy: DataPolicy = field(default_factory=DataPolicy)


def load_mixture(path: str | Path) -> Mixture:
    """Parse and validate a mixture YAML; one UserError listing every mistake, each naming the
    file and the entry."""
    from mimir_megatron.yaml_config import raise_errors, read_yaml

    source = Path(path)
    data = read_yaml(source, "a 'datasets' list", kind="mixture file")
    if not isinstance(data.get("datasets"), list):
        raise UserError(f"{source}: expected a mapping with a 'datasets' list")
    errors: list[str] = []
    unknown = set(data) - _TOP_KEYS
    if unknown:
        errors.append(f"unknown key(s) {sorted(unknown)}; allowed {sorted(_TOP_KEYS)}")
    if not data["datasets"]:
        errors.append("'datasets' is empty")
    policy = parse_policy(data.get("data_policy"), "data_policy", errors)
    entries, names = [], set()
    for i, item in enumerate(data["datasets"]):
        entry = _entry(item, f"datasets[{i}]", source, errors)
        if entry is None:
            continue
        if entry.name in names:
            errors.append(f"datasets[{i}]: duplicate dataset name {entry.name!r}")
        names.add(entry.name)
        entries.append(entry)
    raise_errors(errors, f"invalid mixture {source}")
    return Mixture(str(data.get("name") or source.stem), source, tuple(entries), policy)


def _entry(item, where: str, source: Path, errors: list[str]) -> MixtureEntry | None:
    """One dataset entry; its mistakes go to ``errors`` (then None)."""
    if not isinstance(item, dict):
        errors.append(f"{where}: expected a mapping")
        return None
    before = len(errors)
    unknown = set(item) - _KEYS
    if unknown:
        errors.append(f"{where}: unknown key(s) {sorted(unknown)}; allowed {sorted(_KEYS)}")
    if not item.get("path"):
        errors.append(f"{where}: 'path' is required")
    repeat = item.get("repeat", 1)
    if isinstance(repeat, bool) or not isinstance(repeat, (int, float)) or repeat < 0:
        errors.append(f"{where}: 'repeat' must be a number >= 0, got {repeat!r}")
    tokens = item.get("tokens")
    if tokens is not None and (not isinstance(tokens, int) or tokens < 0):
        errors.append(f"{where}: 'tokens' must be a non-negative integer, got {tokens!r}")
    if len(errors) > before:
        return None
    ds_path = Path(item["path"])
    if not ds_path.is_absolute():
        ds_path = (source.parent / ds_path).resolve()
    return MixtureEntry(
        name=str(item.get("name") or ds_path.name),
        path=ds_path,
        category=str(item.get("category", "uncategorised")),
        language=str(item.get("language", "unknown")),
        repeat=float(repeat),
        tokens=tokens,
        audit_category=None if item.get("audit_category") is None else str(item["audit_category"]),
    )


def mixture_digest(mixture: Mixture, extra: dict | None = None) -> Fingerprint:
    """sha256 of what decides the sample stream: each dataset's outputs and repeat factor."""
    parts = []
    for e in mixture.entries:
        manifest = Manifest.read(e.path)
        parts.append(
            {
                "name": e.name,
                "repeat": e.repeat,
                "documents": manifest.documents,
                "outputs": dict(manifest.outputs),
                "tokenizer": manifest.tokenizer.sha256,
            }
        )
    return fingerprint({"datasets": parts, **(extra or {})})
