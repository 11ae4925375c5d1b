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
    audit_category: B              # optional: the memorisation-audit group (`mimir audit`),
                                   # e.g. the paper's A-D by licence status; default: category
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from mimir_megatron.errors import UserError

from .prepared import read_manifest

_KEYS = {"name", "path", "category", "language", "repeat", "tokens", "audit_category"}


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

    @property
    def audit_group(self) -> str:
        return self.audit_category if self.audit_category is not None else self.category


@dataclass(frozen=True)
class Mixture:
    name: str
    source: Path
    entries: tuple[MixtureEntry, ...]


def load_mixture(path: str | Path) -> Mixture:
    """Parse and validate a mixture YAML; UserError naming the file and entry on any mistake."""
    import yaml

    source = Path(path)
    if not source.is_file():
        raise UserError(f"{source}: mixture file not found")
    try:
        data = yaml.safe_load(source.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else str(source)
        raise UserError(f"{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict) or not isinstance(data.get("datasets"), list):
        raise UserError(f"{source}: expected a mapping with a 'datasets' list")
    if not data["datasets"]:
        raise UserError(f"{source}: 'datasets' is empty")
    entries, names = [], set()
    for i, item in enumerate(data["datasets"]):
        where = f"{source}: datasets[{i}]"
        if not isinstance(item, dict):
            raise UserError(f"{where}: expected a mapping")
        unknown = set(item) - _KEYS
        if unknown:
            raise UserError(f"{where}: unknown key(s) {sorted(unknown)}; allowed {sorted(_KEYS)}")
        if not item.get("path"):
            raise UserError(f"{where}: 'path' is required")
        ds_path = Path(item["path"])
        if not ds_path.is_absolute():
            ds_path = (source.parent / ds_path).resolve()
        repeat = item.get("repeat", 1)
        if isinstance(repeat, bool) or not isinstance(repeat, (int, float)) or repeat < 0:
            raise UserError(f"{where}: 'repeat' must be a number >= 0, got {repeat!r}")
        tokens = item.get("tokens")
        if tokens is not None and (not isinstance(tokens, int) or tokens < 0):
            raise UserError(f"{where}: 'tokens' must be a non-negative integer, got {tokens!r}")
        name = str(item.get("name") or ds_path.name)
        if name in names:
            raise UserError(f"{where}: duplicate dataset name {name!r}")
        names.add(name)
        entries.append(
            MixtureEntry(
                name=name,
                path=ds_path,
                category=str(item.get("category", "uncategorised")),
                language=str(item.get("language", "unknown")),
                repeat=float(repeat),
                tokens=tokens,
                audit_category=None if item.get("audit_category") is None else str(item["audit_category"]),
            )
        )
    return Mixture(str(data.get("name") or source.stem), source, tuple(entries))


def mixture_digest(mixture: Mixture, extra: dict | None = None) -> str:
    """sha256 of what decides the sample stream: each dataset's outputs and repeat factor."""
    parts = []
    for e in mixture.entries:
        manifest = read_manifest(e.path)
        parts.append(
            {
                "name": e.name,
                "repeat": e.repeat,
                "documents": manifest["documents"],
                "outputs": manifest["outputs"],
                "tokenizer": manifest["tokenizer"]["sha256"],
            }
        )
    payload = json.dumps({"datasets": parts, **(extra or {})}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()
