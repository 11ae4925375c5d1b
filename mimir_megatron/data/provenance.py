"""Where a dataset came from, under which licence, and on which basis it may be used.

A provenance record is declared once per dataset, when it is prepared (``mimir prepare`` flags, or
the ``provenance:`` section of a dataset in the prepare YAML), and stored in the prepared
dataset's manifest with the sha256 of every input file. A data file that a pipeline wrote
(``mimir synth tools``, ``mimir synth run``) carries its record in a sidecar,
``<file>.provenance.json``, which ``mimir prepare`` takes when nothing is declared. A dataset
made from others names them in ``derived_from``; it inherits their licences (all of them: AND)
and languages unless it declares its own. Nothing declared is ``unknown``, visibly, everywhere.

Fields (the paper's §2 and Appendix A; Table 6 for the forms)::

    id            how other datasets' derived_from name this one (default: the dataset's name)
    source        the source's name, e.g. "OpenMathInstruct-2"
    location      a URL (https://..., s3://...) or a Hugging Face Hub repo id (owner/name)
    revision      the Hub revision or version retrieved
    retrieved     the retrieval date, YYYY-MM-DD
    license       an SPDX expression (CC-BY-4.0, Apache-2.0 AND MIT, ...), or public-domain,
                  or proprietary-agreement
    basis         open-licence | public-domain | agreement | synthetic
    form          reformatted | curated-reformatted | synthetic-audited | tool-call-formatted |
                  translated-audited | agreement-supplied | derived-task
    audit_group   the memorisation-audit group by opt-out status (the paper's A-D, or your own)
    languages     ISO 639 codes, e.g. [en, da]
    derived_from  prepared datasets or files with a provenance sidecar this one was made from
    generator     the models or programs that generated synthetic data
    notes         free text
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping

BASES = {
    "open-licence": "openly licensed",
    "public-domain": "in the public domain",
    "agreement": "made available by agreement (not for public sharing)",
    "synthetic": "synthetic, derived from permissible data or generated",
}
FORMS = {  # Table 6 of the Mimir paper: the form in which a dataset entered the corpus
    "reformatted": "Reformatted",
    "curated-reformatted": "Curated + reformatted",
    "synthetic-audited": "Synthetic + audited",
    "tool-call-formatted": "Tool-call formatted",
    "translated-audited": "Translated + audited",
    "agreement-supplied": "Agreement-supplied",
    "derived-task": "Derived task data",
}
EXTRA_LICENCES = ("public-domain", "proprietary-agreement")
"""Licence names beside the SPDX list: public-domain material, and data supplied under an
agreement whose terms are not an SPDX licence."""
UNKNOWN = "unknown"
UNKNOWN_RECORD: dict[str, Any] = {"status": UNKNOWN}
"""What a manifest holds where nothing was declared."""
SIDECAR_SUFFIX = ".provenance.json"

_LANGUAGE = re.compile(r"^[a-z]{2,3}(-[A-Za-z0-9]{2,8})*$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://\S+$")


@dataclass(frozen=True)
class Parent:
    """A dataset this one was derived from, as recorded when it was prepared."""

    id: str
    digest: str | None
    """The parent's provenance digest (None: the parent declared nothing)."""
    license: str
    basis: str
    source: str


@dataclass(frozen=True)
class Provenance:
    """A validated provenance record (see the module docstring for the fields)."""

    id: str
    source: str
    license: str
    """Normalised SPDX expression, an extra licence name, or ``unknown`` (inherited from an
    undeclared parent)."""
    basis: str
    form: str
    location: str | None = None
    revision: str | None = None
    retrieved: str | None = None
    audit_group: str | None = None
    languages: tuple[str, ...] = ()
    derived_from: tuple[Parent, ...] = ()
    generator: str | None = None
    notes: str | None = None

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["languages"] = list(self.languages)
        record["derived_from"] = [asdict(p) for p in self.derived_from]
        return record

    @property
    def digest(self) -> str:
        """sha256 of the record: what a checkpoint's lineage and a child's derived_from name."""
        return record_digest(self.to_dict())

    def as_parent(self) -> Parent:
        return Parent(self.id, self.digest, self.license, self.basis, self.source)

    def unknown_ancestors(self) -> list[str]:
        """The ids of parents that declared nothing."""
        return [p.id for p in self.derived_from if p.digest is None]


def record_digest(record: Mapping[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def provenance_from_record(record: Mapping[str, Any] | None) -> Provenance | None:
    """The record a manifest or sidecar stores; None where it is unknown."""
    if not record or record.get("status") == UNKNOWN:
        return None
    values = {k: v for k, v in record.items() if k in {f.name for f in fields(Provenance)}}
    values["languages"] = tuple(values.get("languages", ()))
    values["derived_from"] = tuple(Parent(**p) for p in values.get("derived_from", ()))
    return Provenance(**values)


def stored_record(provenance: Provenance | None) -> dict[str, Any]:
    """What a manifest or sidecar stores: the record with its digest, or the unknown marker."""
    if provenance is None:
        return dict(UNKNOWN_RECORD)
    return {**provenance.to_dict(), "digest": provenance.digest}


def record_problem(record: Mapping[str, Any] | None) -> str | None:
    """Why a stored record cannot be trusted (its digest does not match: edited by hand), or None."""
    if not record or record.get("status") == UNKNOWN:
        return None
    if record.get("digest") != record_digest(record):
        return "its provenance record was edited after it was written (digest mismatch)"
    return None


# -- licences -----------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _licensing():
    """The SPDX licence list (the license-expression package ships it) plus EXTRA_LICENCES."""
    from license_expression import LicenseSymbol, Licensing, get_spdx_licensing

    spdx = get_spdx_licensing()
    return Licensing(list(spdx.known_symbols.values()) + [LicenseSymbol(k) for k in EXTRA_LICENCES])


def normalise_license(expression: str) -> tuple[str | None, str | None]:
    """(normalised expression, None) for a valid SPDX expression or extra licence name, else
    (None, the reason)."""
    if expression.strip().lower() == UNKNOWN:
        return None, "'unknown' is what an undeclared dataset is; declare the licence"
    try:
        info = _licensing().validate(expression)
    except Exception as exc:  # noqa: BLE001 - the parser raises on malformed expressions
        return None, f"not a licence expression: {exc}"
    if info.invalid_symbols:
        return None, (f"unknown licence id(s) {', '.join(map(repr, info.invalid_symbols))} (not on the SPDX "
                      f"list; or use {' / '.join(EXTRA_LICENCES)})")
    if info.errors or not info.normalized_expression:
        return None, f"not a licence expression: {'; '.join(info.errors) or expression!r}"
    return str(info.normalized_expression), None


def license_keys(expression: str) -> list[str]:
    """The licence ids an expression names (``unknown`` for an unknown one)."""
    if expression == UNKNOWN:
        return [UNKNOWN]
    licensing = _licensing()
    return licensing.license_keys(licensing.parse(expression))


def license_allowed(expression: str, allowed: set[str] | None, denied: set[str]) -> bool:
    """Whether the expression can be complied with using allowed, not denied licences: every
    operand of an AND must be, one operand of an OR suffices. ``allowed`` None allows any."""
    if expression == UNKNOWN:
        return False
    from license_expression import AND, OR

    def ok(node) -> bool:
        if isinstance(node, AND):
            return all(ok(arg) for arg in node.args)
        if isinstance(node, OR):
            return any(ok(arg) for arg in node.args)
        key = node.key
        return key not in denied and (allowed is None or key in allowed)

    return ok(_licensing().parse(expression))


def combine_licenses(expressions: Iterable[str]) -> str:
    """The licence of data made from several inputs: all their terms apply (AND), deduplicated;
    ``unknown`` when any input's is."""
    expressions = list(dict.fromkeys(expressions))
    if not expressions:
        return UNKNOWN
    if UNKNOWN in expressions:
        return UNKNOWN
    if len(expressions) == 1:
        return expressions[0]
    licensing = _licensing()
    joined = " AND ".join(f"({e})" for e in expressions)
    return str(licensing.dedup(licensing.parse(joined)))


# -- declarations -------------------------------------------------------------------------------


@dataclass
class ProvenanceDeclaration:
    """What a user declares (YAML section or command-line flags); every field optional here,
    :func:`resolve_declaration` says what is missing."""

    id: str | None = None
    source: str | None = None
    location: str | None = None
    revision: str | None = None
    retrieved: str | None = None
    license: str | None = None
    basis: str | None = None
    form: str | None = None
    audit_group: str | None = None
    languages: list[str] = field(default_factory=list)
    derived_from: list[str] = field(default_factory=list)
    generator: str | None = None
    notes: str | None = None

    def is_empty(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))


def declaration_from_mapping(values: Any, where: str, errors: list[str]) -> ProvenanceDeclaration:
    """A typed declaration from a YAML mapping; each mistake appends one line to ``errors``."""
    from mimir_megatron.config import typed_section

    if isinstance(values, dict):
        values = {k: (v.isoformat() if isinstance(v, datetime.date) else v) for k, v in values.items()}
        for key in ("languages", "derived_from"):
            if isinstance(values.get(key), str):  # one item written without a list
                values[key] = [values[key]]
    return typed_section(ProvenanceDeclaration, values, where, errors)


def resolve_declaration(
    decl: ProvenanceDeclaration,
    where: str,
    *,
    default_id: str,
    base: Path,
    siblings: Mapping[str, Path] | None = None,
    pending: Iterable[str] = (),
    errors: list[str],
) -> Provenance | None:
    """The validated record of a declaration; each mistake appends one line to ``errors``
    (naming ``where`` and the field) and the result is then None.

    ``derived_from`` entries are prepared dataset directories or files with a provenance sidecar
    (relative paths resolve against ``base``), or the names of ``siblings`` (datasets of the same
    prepare file, name -> output directory, prepared before this one). Names in ``pending`` are
    siblings not prepared yet (checking a whole file before preparing it): accepted unresolved.
    """
    before = len(errors)
    pending = set(pending)
    parents: list[Parent] = []
    for i, ref in enumerate(decl.derived_from):
        if ref in pending:
            parents.append(Parent(id=ref, digest=None, license=UNKNOWN, basis=UNKNOWN, source=UNKNOWN))
            continue
        parent = _resolve_parent(ref, base, siblings or {})
        if parent is None:
            errors.append(f"{where}.derived_from[{i}]: {ref!r} is neither a prepared dataset, a file with a "
                          f"{SIDECAR_SUFFIX} sidecar, nor a dataset prepared earlier in this file")
        else:
            parents.append(parent)
    for name in ("source", "basis", "form"):
        if not getattr(decl, name):
            errors.append(f"{where}.{name}: required")
    if decl.basis and decl.basis not in BASES:
        errors.append(f"{where}.basis: one of {', '.join(BASES)}, got {decl.basis!r}")
    if decl.form and decl.form not in FORMS:
        errors.append(f"{where}.form: one of {', '.join(FORMS)}, got {decl.form!r}")
    if decl.form == "agreement-supplied" and decl.basis in BASES and decl.basis != "agreement":
        errors.append(f"{where}.basis: form agreement-supplied is data supplied under an agreement: "
                      f"basis agreement, got {decl.basis}")
    license_ = None
    if decl.license:
        license_, problem = normalise_license(decl.license)
        if problem:
            errors.append(f"{where}.license: {problem}")
    elif not decl.derived_from:
        errors.append(f"{where}.license: required (an SPDX expression, or {' / '.join(EXTRA_LICENCES)}); "
                      "only a dataset with derived_from inherits one")
    else:
        license_ = combine_licenses(p.license for p in parents)
    for i, lang in enumerate(decl.languages):
        if not _LANGUAGE.match(str(lang)):
            errors.append(f"{where}.languages[{i}]: {lang!r} is not an ISO 639 code (e.g. en, da, en-GB)")
    if decl.retrieved:
        try:
            datetime.date.fromisoformat(decl.retrieved)
        except ValueError:
            errors.append(f"{where}.retrieved: a date YYYY-MM-DD, got {decl.retrieved!r}")
    if decl.location and not (_URL.match(decl.location) or _HUB_ID.match(decl.location)):
        errors.append(f"{where}.location: a URL (https://...) or a Hugging Face Hub id (owner/name), "
                      f"got {decl.location!r}")
    if len(errors) > before:
        return None
    languages = tuple(decl.languages) or _inherited_languages(decl.derived_from, base, siblings or {})
    return Provenance(
        id=decl.id or default_id, source=str(decl.source), license=str(license_), basis=str(decl.basis),
        form=str(decl.form), location=decl.location, revision=decl.revision, retrieved=decl.retrieved,
        audit_group=decl.audit_group, languages=languages, derived_from=tuple(parents),
        generator=decl.generator, notes=decl.notes,
    )


def _resolve_parent(ref: str, base: Path, siblings: Mapping[str, Path]) -> Parent | None:
    path = siblings.get(ref)
    if path is None:
        path = Path(ref).expanduser()
        path = path if path.is_absolute() else base / path
    record = read_provenance(path)
    if record is False:
        return None
    found = provenance_from_record(record)
    if found is None:  # it exists but declared nothing: kept, visibly unknown
        return Parent(id=str(ref), digest=None, license=UNKNOWN, basis=UNKNOWN, source=UNKNOWN)
    return found.as_parent()


def _inherited_languages(refs: list[str], base: Path, siblings: Mapping[str, Path]) -> tuple[str, ...]:
    languages: dict[str, None] = {}
    for ref in refs:
        path = siblings.get(ref) or (Path(ref) if Path(ref).is_absolute() else base / ref)
        found = provenance_from_record(read_provenance(path) or None)
        if found:
            languages.update(dict.fromkeys(found.languages))
    return tuple(languages)


# -- where records live ---------------------------------------------------------------------------


def sidecar_path(data_file: str | Path) -> Path:
    data_file = Path(data_file)
    return data_file.with_name(data_file.name + SIDECAR_SUFFIX)


def read_provenance(path: str | Path) -> dict[str, Any] | bool:
    """The stored record of a prepared dataset (its manifest's ``provenance``) or of a data file
    (its sidecar); ``UNKNOWN_RECORD`` where it exists but declares nothing; False where ``path``
    is neither."""
    from .prepared import MANIFEST_NAME, read_manifest

    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        return read_manifest(path).get("provenance") or dict(UNKNOWN_RECORD)
    if path.is_file():
        sidecar = sidecar_path(path)
        if sidecar.is_file():
            return json.loads(sidecar.read_text())
        return dict(UNKNOWN_RECORD)
    return False


def write_sidecar(data_file: str | Path, provenance: Provenance | None) -> Path:
    """Record ``provenance`` beside a data file a pipeline wrote (atomically)."""
    sidecar = sidecar_path(data_file)
    tmp = sidecar.with_name(sidecar.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(stored_record(provenance), indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, sidecar)
    return sidecar


def derived_provenance(
    inputs: Iterable[str | Path], *, id: str, source: str, form: str, basis: str | None = None,
    generator: str | None = None, notes: str | None = None,
) -> Provenance:
    """The record of data a pipeline made from ``inputs`` (files or prepared datasets): their
    licences (AND) and languages; ``basis`` defaults to the inputs' own when they agree (a
    conversion keeps it), else synthetic."""
    parents, languages = [], {}
    for path in inputs:
        record = read_provenance(path)
        found = provenance_from_record(record or None)
        if found is None:
            parents.append(Parent(id=Path(path).name, digest=None, license=UNKNOWN, basis=UNKNOWN,
                                  source=UNKNOWN))
        else:
            parents.append(found.as_parent())
            languages.update(dict.fromkeys(found.languages))
    if basis is None:
        bases = {p.basis for p in parents}
        basis = bases.pop() if len(bases) == 1 and UNKNOWN not in bases else "synthetic"
    return Provenance(id=id, source=source, license=combine_licenses(p.license for p in parents),
                      basis=basis, form=form, languages=tuple(languages), derived_from=tuple(parents),
                      generator=generator, notes=notes)
