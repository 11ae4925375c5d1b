"""Where a dataset came from, under which licence, and on which basis it may be used.

A provenance record is declared once per dataset, when it is prepared (``mimir prepare`` flags, or
the ``provenance:`` section of a dataset in the prepare YAML), and stored in the prepared
dataset's manifest with the sha256 of every input file. A data file that a pipeline wrote
(``mimir synth tools``, ``mimir synth run``) carries its record in a sidecar,
``<file>.provenance.json``, which ``mimir prepare`` takes when nothing is declared. A dataset
made from others names them in ``derived_from``; it inherits their terms (all of them: AND; an
agreement source's ``derived_terms`` where it states them) and the generator's, and languages,
unless it declares its own, which must keep every one of those terms (licences only get stricter
downstream; an OR may narrow them, never reopen one). Its *effective terms*
(:func:`effective_terms`) are its own licence AND every parent's terms AND its generator's: what
the data policy judges. Synthetic data names what it was made from or what generated it; a
generator's terms must be declared (``unknown`` is an explicit answer the default policy refuses).
Each parent is pinned by its record's digest and its path: a parent whose record changed since,
or a lineage that loops, is refused (:func:`ancestry_problems`). Basis, licence and form are
checked against each other. Nothing declared is ``unknown``, visibly, everywhere. A stored record
is validated as strictly as a declaration whenever it is read (:func:`provenance_from_record`): a
hand-edited record with recomputed digests is still refused when it is not one this module would
have written.

Fields (the paper's §2 and Appendix A; Table 6 for the forms)::

    id            how other datasets' derived_from name this one (default: the dataset's name)
    source        the source's name, e.g. "OpenMathInstruct-2"
    location      a URL (https://..., s3://...) or a Hugging Face Hub repo id (owner/name)
    revision      the Hub revision or version retrieved
    retrieved     the retrieval date, YYYY-MM-DD
    license       an SPDX expression (CC-BY-4.0, Apache-2.0 AND MIT, ...), or public-domain,
                  or proprietary-agreement
    basis         open-licence | public-domain | agreement | tdm-research | synthetic
    form          reformatted | curated-reformatted | synthetic-audited | tool-call-formatted |
                  translated-audited | agreement-supplied | derived-task
    audit_group   the memorisation-audit group by opt-out status (the paper's A-D, or your own)
    languages     ISO 639 codes, e.g. [en, da]
    derived_from  prepared datasets or files with a provenance sidecar this one was made from
    generator     the models or programs that generated synthetic data
    notes         free text
    research_organisation, lawful_access
                  basis tdm-research (DSM Directive Art. 3): who mines the data, and how it has
                  lawful access to the works; both required there, refused elsewhere
    derived_terms basis agreement: the licence the agreement lets derived data be used under
    generator_license
                  the generating models' terms; they bind the synthetic data too
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import digest_matches, json_digest, write_json_atomic

from .licences import (  # noqa: F401 - re-exported: callers import them from here
    AGREEMENT,
    EXTRA_LICENCES,
    PUBLIC_DOMAIN,
    combine_licenses,
    dropped_terms,
    imposes_no_terms,
    license_allowed,
    license_keys,
    normalise_license,
)

BASES = {
    "open-licence": "openly licensed",
    "public-domain": "in the public domain",
    "agreement": "made available by agreement (not for public sharing; used only to derive data)",
    "tdm-research": "the EU's text-and-data-mining exception for research organisations (DSM Art. 3)",
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
UNKNOWN = "unknown"
UNKNOWN_RECORD: dict[str, Any] = {"status": UNKNOWN}
"""What a manifest holds where nothing was declared."""
SIDECAR_SUFFIX = ".provenance.json"
SIDECAR_FORMAT = "mimir-provenance-v1"
"""The sidecar's ``format`` entry (sidecars written before it have none: the same record)."""

_LANGUAGE = re.compile(r"^[a-z]{2,3}(-[A-Za-z0-9]{2,8})*$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://\S+$")
_OMITTED_WHEN_UNSET = ("research_organisation", "lawful_access", "derived_terms", "generator_license")
"""Fields added after records were first written: left out of a record while unset, so that the
digest of a record written before them is still its digest."""
_PARENT_OMITTED_WHEN_UNSET = ("derived_terms", "path")


@dataclass(frozen=True)
class Parent:
    """A dataset this one was derived from, as recorded when it was prepared."""

    id: str
    digest: str | None
    """The parent's provenance digest (None: the parent declared nothing)."""
    license: str
    basis: str
    source: str
    derived_terms: str | None = None
    """For an agreement source: the terms its agreement lets derived data be used under."""
    path: str | None = None
    """Where the parent was when this dataset was made from it (its prepared directory or data
    file, absolute): the gate reads it again to check it is still the record pinned by ``digest``
    (None in records written before parents were located)."""

    @property
    def terms(self) -> str:
        """The terms data derived from this parent must keep."""
        return self.derived_terms or self.license

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None or k not in _PARENT_OMITTED_WHEN_UNSET}


@dataclass(frozen=True)
class Provenance:
    """A validated provenance record (see the module docstring for the fields)."""

    id: str
    source: str
    license: str
    """Normalised SPDX expression, an extra licence name, or ``unknown`` (inherited from an
    undeclared parent): the dataset's effective terms, which keep every ancestor's."""
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
    research_organisation: str | None = None
    """Basis tdm-research: the research organisation that mines the data (DSM Art. 3)."""
    lawful_access: str | None = None
    """Basis tdm-research: how it has lawful access to the works (subscription, open web, ...)."""
    derived_terms: str | None = None
    """Basis agreement: the licence its agreement lets data derived from it be used under."""
    generator_license: str | None = None
    """The terms of the models that generated synthetic data (they bind its output too)."""

    def to_dict(self) -> dict[str, Any]:
        record = {k: v for k, v in asdict(self).items() if v is not None or k not in _OMITTED_WHEN_UNSET}
        record["languages"] = list(self.languages)
        record["derived_from"] = [p.to_dict() for p in self.derived_from]
        return record

    @property
    def digest(self) -> str:
        """sha256 of the record: what a checkpoint's lineage and a child's derived_from name."""
        return record_digest(self.to_dict())

    def as_parent(self, path: str | Path | None = None) -> Parent:
        return Parent(self.id, self.digest, self.license, self.basis, self.source, self.derived_terms,
                      str(Path(path).resolve()) if path is not None else None)

    def unknown_ancestors(self) -> list[str]:
        """The ids of parents that declared nothing."""
        return [p.id for p in self.derived_from if p.digest is None]

    @property
    def generator_terms(self) -> str | None:
        """The generator's terms as they bind this data: its declared licence; ``unknown`` for
        synthetic data made by a generator whose licence was not declared (or declared
        ``unknown``); None where nothing generated it."""
        if self.generator_license:
            return self.generator_license
        return UNKNOWN if self.basis == "synthetic" and self.generator else None

    def unknown_terms(self) -> list[str]:
        """Why the effective terms are unknown (empty: they are known)."""
        why = [f"derived from {p.id}, which declared none" for p in self.derived_from if p.terms == UNKNOWN]
        if self.generator_terms == UNKNOWN:
            why.append(f"the generator {self.generator!r} has no declared licence (generator_license)")
        if self.license == UNKNOWN and not why:
            why.append("no licence declared")
        return why


def effective_terms(p: Provenance) -> str:
    """The terms a dataset is used under: its own licence AND every parent's terms AND its
    generator's (a conjunction down the lineage: each parent's licence already holds its own
    ancestors'). ``unknown`` when any of them is."""
    return combine_licenses([p.license, *(parent.terms for parent in p.derived_from),
                             *([p.generator_terms] if p.generator_terms else [])])


def record_digest(record: Mapping[str, Any]) -> str:
    """sha256 of a stored record without its ``digest`` (the project's canonical JSON digest)."""
    return json_digest(record)


def provenance_from_record(record: Mapping[str, Any] | None, where: str = "provenance") -> Provenance | None:
    """The record a manifest or sidecar stores, validated as strictly as a declaration is; None
    where it is unknown. A :class:`UserError` (one line: ``where``, the field, the problem) when
    the record is not one this project would have written."""
    if not record or (isinstance(record, Mapping) and record.get("status") == UNKNOWN):
        return None
    errors: list[str] = []
    provenance = _record_to_provenance(record, where, errors)
    if errors:
        raise UserError("; ".join(errors))
    return provenance


def stored_record(provenance: Provenance | None) -> dict[str, Any]:
    """What a manifest or sidecar stores: the record with its digest, or the unknown marker."""
    if provenance is None:
        return dict(UNKNOWN_RECORD)
    return {**provenance.to_dict(), "digest": provenance.digest}


def record_problem(record: Mapping[str, Any] | None) -> str | None:
    """Why a stored record cannot be trusted (no digest, or one that does not match: edited by
    hand), or None."""
    if not record or record.get("status") == UNKNOWN:
        return None
    if "digest" not in record:
        return "its provenance record has no digest (deleted by hand?); declare and prepare it again"
    if not digest_matches(record):
        return "its provenance record was edited after it was written (digest mismatch)"
    return None


_PARENT_KEYS = {f.name for f in fields(Parent)}
_RECORD_KEYS = {f.name for f in fields(Provenance)} | {"digest"}


def _record_to_provenance(record: Any, where: str, errors: list[str]) -> Provenance | None:
    """The typed record of a stored dict; each problem appends one line to ``errors``."""
    if not isinstance(record, Mapping):
        errors.append(f"{where}: a JSON object expected, got {type(record).__name__}")
        return None
    unknown = sorted(set(record) - _RECORD_KEYS)
    if unknown:
        errors.append(f"{where}.{unknown[0]}: not a provenance field")
    for name in ("id", "source", "license", "basis", "form"):
        if not isinstance(record.get(name), str) or not record[name].strip():
            errors.append(f"{where}.{name}: required (a non-empty string), got {record.get(name)!r}")
    for name in ("location", "revision", "retrieved", "audit_group", "generator", "notes",
                 *_OMITTED_WHEN_UNSET):
        if record.get(name) is not None and not isinstance(record[name], str):
            errors.append(f"{where}.{name}: a string, got {record[name]!r}")
    languages = record.get("languages", [])
    if not isinstance(languages, list) or not all(isinstance(x, str) for x in languages):
        errors.append(f"{where}.languages: a list of ISO 639 codes, got {languages!r}")
        languages = []
    parents: list[Parent] = []
    derived = record.get("derived_from", [])
    if not isinstance(derived, list):
        errors.append(f"{where}.derived_from: a list, got {derived!r}")
        derived = []
    for i, p in enumerate(derived):
        if not isinstance(p, Mapping) or set(p) - _PARENT_KEYS or not {"id", "license", "basis"} <= set(p):
            errors.append(f"{where}.derived_from[{i}]: not a parent record "
                          "(id, digest, license, basis, source)")
            continue
        parents.append(Parent(**{"digest": None, "source": UNKNOWN, **p}))
    if errors:
        return None
    license_ = record["license"]
    if license_ != UNKNOWN:
        normalised, problem = normalise_license(license_)
        if problem:
            errors.append(f"{where}.license: {problem}")
        elif normalised != license_:
            errors.append(f"{where}.license: {license_!r} is not as mimir prepare writes it ({normalised!r})")
    values = {k: record.get(k) for k in _OMITTED_WHEN_UNSET}
    provenance = Provenance(
        id=record["id"], source=record["source"], license=license_, basis=record["basis"],
        form=record["form"],
        location=record.get("location"), revision=record.get("revision"), retrieved=record.get("retrieved"),
        audit_group=record.get("audit_group"), languages=tuple(languages), derived_from=tuple(parents),
        generator=record.get("generator"), notes=record.get("notes"), **values)
    consistency_errors(provenance, where, errors, declared_license=license_ != UNKNOWN)
    return None if errors else provenance


def consistency_errors(p: Provenance, where: str, errors: list[str], *, declared_license: bool) -> None:
    """The checks a record passes whether it is being declared or read back: known basis and
    form, dates, codes and locations well-formed, basis, licence and form consistent with each
    other, and no licence more permissive than an ancestor's terms. One line per problem."""
    if p.basis not in BASES:
        errors.append(f"{where}.basis: one of {', '.join(BASES)}, got {p.basis!r}")
    if p.form not in FORMS:
        errors.append(f"{where}.form: one of {', '.join(FORMS)}, got {p.form!r}")
    for i, lang in enumerate(p.languages):
        if not _LANGUAGE.match(str(lang)):
            errors.append(f"{where}.languages[{i}]: {lang!r} is not an ISO 639 code (e.g. en, da, en-GB)")
    if p.retrieved:
        try:
            datetime.date.fromisoformat(p.retrieved)
        except ValueError:
            errors.append(f"{where}.retrieved: a date YYYY-MM-DD, got {p.retrieved!r}")
    if p.location and not (_URL.match(p.location) or _HUB_ID.match(p.location)):
        errors.append(f"{where}.location: a URL (https://...) or a Hugging Face Hub id (owner/name), "
                      f"got {p.location!r}")
    for name in ("derived_terms", "generator_license"):
        value = getattr(p, name)
        if value and not (name == "generator_license" and value == UNKNOWN):
            normalised, problem = normalise_license(value)
            if problem:
                errors.append(f"{where}.{name}: {problem}")
            elif normalised != value:
                errors.append(f"{where}.{name}: {value!r} is not as mimir prepare writes it ({normalised!r})")
    if any(e.startswith(f"{where}.") for e in errors):
        return  # the cross-checks below need well-formed values
    keys = [] if p.license == UNKNOWN else license_keys(p.license)
    if p.form == "agreement-supplied" and p.basis != "agreement":
        errors.append(f"{where}.basis: form agreement-supplied is data supplied under an agreement: "
                      f"basis agreement, got {p.basis}")
    if AGREEMENT in keys and p.basis in ("open-licence", "public-domain"):
        errors.append(f"{where}.basis: {p.basis} under the agreement licence {AGREEMENT} (agreement data "
                      "is basis agreement; data derived from it basis synthetic)")
    if p.basis == "public-domain" and keys and not all(imposes_no_terms(k) for k in keys):
        errors.append(f"{where}.license: basis public-domain needs a public-domain licence (public-domain, "
                      f"CC0-1.0, PDDL-1.0, ...), got {p.license}")
    if p.basis == "tdm-research":
        for name in ("research_organisation", "lawful_access"):
            if not getattr(p, name):
                errors.append(f"{where}.{name}: required for basis tdm-research (the DSM Directive's Art. 3 "
                              "covers research organisations mining works they have lawful access to)")
    elif p.research_organisation or p.lawful_access:
        errors.append(f"{where}.research_organisation: only basis tdm-research records it, "
                      f"got basis {p.basis}")
    if p.derived_terms and p.basis != "agreement":
        errors.append(f"{where}.derived_terms: only an agreement source states terms for data derived from "
                      f"it, got basis {p.basis}")
    if p.basis == "synthetic" and not p.derived_from and not p.generator:
        errors.append(f"{where}.basis: synthetic data names what it was made from (derived_from) or what "
                      "generated it (generator, with generator_license)")
    if not declared_license:
        return
    inherited = [(parent.id, parent.terms) for parent in p.derived_from]
    if p.generator_license and p.generator_license != UNKNOWN:
        inherited.append((f"generator {p.generator or ''}".strip(), p.generator_license))
    for name, terms in inherited:
        relaxed = dropped_terms(p.license, terms)
        if relaxed:
            errors.append(f"{where}.license: {p.license} is more permissive than {name}'s terms {terms} "
                          f"(drops {', '.join(relaxed)}); declare {combine_licenses([p.license, terms])}, "
                          "or leave the licence out to inherit")


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
    research_organisation: str | None = None
    lawful_access: str | None = None
    derived_terms: str | None = None
    generator_license: str | None = None

    def is_empty(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))


def declaration_from_mapping(values: Any, where: str, errors: list[str]) -> ProvenanceDeclaration:
    """A typed declaration from a YAML mapping; each mistake appends one line to ``errors``."""
    from mimir_megatron.yaml_config import typed_section

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
    output: Path | None = None,
    errors: list[str],
) -> Provenance | None:
    """The validated record of a declaration; each mistake appends one line to ``errors``
    (naming ``where`` and the field) and the result is then None.

    ``derived_from`` entries are prepared dataset directories or files with a provenance sidecar
    (relative paths resolve against ``base``), or the names of ``siblings`` (datasets of the same
    prepare file, name -> output directory, prepared before this one). Names in ``pending`` are
    siblings not prepared yet (checking a whole file before preparing it): accepted unresolved.
    ``output``: the dataset being prepared; a parent that is it, or descends from it, is refused
    (a lineage may not loop), as is a parent whose own parents changed since it was made.
    """
    before = len(errors)
    pending = set(pending)
    parents: list[Parent] = []
    inherited_languages: dict[str, None] = {}
    own = str(Path(output).resolve()) if output is not None else None
    for i, ref in enumerate(decl.derived_from):
        if ref in pending:
            parents.append(Parent(id=ref, digest=None, license=UNKNOWN, basis=UNKNOWN, source=UNKNOWN))
            continue
        try:
            resolved = _resolve_parent(ref, base, siblings or {})
        except UserError as exc:  # the parent's stored record does not validate
            errors.append(f"{where}.derived_from[{i}]: {exc}")
            continue
        if resolved is None:
            errors.append(f"{where}.derived_from[{i}]: {ref!r} is neither a prepared dataset, a file with a "
                          f"{SIDECAR_SUFFIX} sidecar, nor a dataset prepared earlier in this file")
            continue
        parent, languages, found = resolved
        if own is not None and parent.path == own:
            errors.append(f"{where}.derived_from[{i}]: {ref!r} is the dataset being prepared: a dataset "
                          "cannot be derived from itself")
            continue
        if found is not None:
            errors += [f"{where}.derived_from[{i}]: {line}"
                       for line in ancestry_problems(found, parent.path, parent.id, [own] if own else [])]
        parents.append(parent)
        inherited_languages.update(dict.fromkeys(languages))
    for name in ("source", "basis", "form"):
        if not (getattr(decl, name) or "").strip():
            errors.append(f"{where}.{name}: required")
    if decl.basis == "synthetic" and decl.generator and not decl.generator_license:
        errors.append(f"{where}.generator_license: required for data a generator made (the generating "
                      "models' terms bind their output): an SPDX expression, or 'unknown' (which the "
                      "default data policy refuses to train on)")
    license_, declared = None, bool(decl.license)
    if decl.license:
        license_, problem = normalise_license(decl.license)
        if problem:
            errors.append(f"{where}.license: {problem}")
    elif not decl.derived_from and not decl.generator_license:
        errors.append(f"{where}.license: required (an SPDX expression, or {' / '.join(EXTRA_LICENCES)}); "
                      "only a dataset with derived_from or a generator_license inherits one")
    else:  # inherited: every parent's terms, and the generator's
        generator_terms = [_normalised(decl.generator_license)] if decl.generator_license else []
        license_ = combine_licenses([*(p.terms for p in parents), *generator_terms])
    languages = tuple(decl.languages) or tuple(inherited_languages)
    provenance = Provenance(
        id=decl.id or default_id, source=str(decl.source), license=str(license_ or UNKNOWN),
        basis=str(decl.basis), form=str(decl.form), location=decl.location, revision=decl.revision,
        retrieved=decl.retrieved, audit_group=decl.audit_group, languages=languages,
        derived_from=tuple(parents), generator=decl.generator, notes=decl.notes,
        research_organisation=decl.research_organisation, lawful_access=decl.lawful_access,
        derived_terms=_normalised(decl.derived_terms), generator_license=_normalised(decl.generator_license),
    )
    checks: list[str] = []
    consistency_errors(provenance, where, checks, declared_license=declared and license_ is not None)
    # A field already reported (a missing basis) is not reported twice.
    said = {e.split(":")[0] for e in errors[before:]}
    errors += [e for e in checks if e.split(":")[0] not in said]
    return None if len(errors) > before else provenance


def _normalised(expression: str | None) -> str | None:
    """The normalised form of an optional licence expression (as given when it is invalid: the
    record's checks then name it)."""
    if not expression:
        return None
    return normalise_license(expression)[0] or expression


def _resolve_parent(ref: str, base: Path, siblings: Mapping[str, Path]
                    ) -> tuple[Parent, tuple[str, ...], Provenance | None] | None:
    """The parent record ``ref`` names, its languages and its own record (None: undeclared);
    None where it names nothing."""
    path = siblings.get(ref)
    if path is None:
        path = Path(ref).expanduser()
        path = path if path.is_absolute() else base / path
    stored = read_provenance(path)
    if stored is None:
        return None
    found = stored.provenance
    if found is None:  # it exists but declared nothing: kept, visibly unknown
        return Parent(id=str(ref), digest=None, license=UNKNOWN, basis=UNKNOWN, source=UNKNOWN,
                      path=str(Path(path).resolve())), (), None
    return found.as_parent(path), found.languages, found


def ancestry_problems(provenance: Provenance, path: str | Path | None, name: str,
                      descendants: Iterable[str] = ()) -> list[str]:
    """Why the lineage above ``provenance`` (the record of ``name``, stored at ``path``) cannot be
    trusted, one line each: a parent, still where it was, whose record is no longer the one this
    dataset pinned (re-prepared or re-declared since: its terms may have changed), or a lineage
    that loops (a dataset among its own ancestors). Parents that are gone, or recorded before
    parents were located, are taken as pinned. ``descendants``: paths below ``path`` (a dataset
    being prepared from it), which may not appear above it either."""
    problems: list[str] = []

    def walk(child: Provenance, child_name: str, chain: list[str]) -> None:
        for parent in child.derived_from:
            if parent.path is None or parent.digest is None:
                continue
            if parent.path in chain:
                loop = " -> ".join([*_names(chain, parent.path), names.get(parent.path, parent.id)])
                problems.append(f"{name}: its lineage loops ({loop}): a dataset cannot be derived from "
                                "itself")
                continue
            try:
                stored = read_provenance(parent.path)
            except UserError as exc:
                problems.append(f"{name}: parent {parent.id} of {child_name}: {exc}")
                continue
            if stored is None:
                continue  # gone: the record pinned in the child is what there is
            found, now = stored.provenance, stored.digest
            if now != parent.digest:
                terms = found.license if found is not None else UNKNOWN
                whose = "it" if child is provenance else f"its ancestor {child_name}"
                problems.append(f"{name}: {whose} was derived from {parent.id} ({parent.path}), which "
                                f"changed since (the record pinned {parent.digest[:12]}, now "
                                f"{(now or UNKNOWN)[:12]}, licence {terms}); prepare {child_name} again "
                                f"from {parent.id} as it is")
                continue
            walk(found, parent.id, [*chain, parent.path])

    names: dict[str, str] = {}

    def _names(chain: list[str], start: str) -> list[str]:
        return [names.get(p, Path(p).name) for p in chain[chain.index(start):]]

    start = [*descendants, *([str(Path(path).resolve())] if path is not None else [])]
    if path is not None:
        names[str(Path(path).resolve())] = provenance.id
    walk(provenance, provenance.id, start)
    return problems


def agreement_ancestors(provenance: Provenance) -> list[Parent]:
    """The agreement sources a dataset was derived from, directly or through parents that are
    still where they were recorded (a parent's own parents are read from its record on disk; one
    that is gone, or changed since, ends the walk there)."""
    found: dict[tuple[str, str | None], Parent] = {}
    seen: set[str] = set()

    def walk(record: Provenance) -> None:
        for parent in record.derived_from:
            if parent.basis == "agreement":
                found.setdefault((parent.id, parent.digest), parent)
                continue
            if not parent.path or parent.path in seen or parent.digest is None:
                continue
            seen.add(parent.path)
            try:
                stored = read_provenance(parent.path)
                above = None if stored is None else stored.provenance
            except UserError:
                continue  # a damaged parent: the gate names it
            if above is not None and above.digest == parent.digest:
                walk(above)

    walk(provenance)
    return list(found.values())


# -- where records live ---------------------------------------------------------------------------


def sidecar_path(data_file: str | Path) -> Path:
    data_file = Path(data_file)
    return data_file.with_name(data_file.name + SIDECAR_SUFFIX)


@dataclass(frozen=True)
class StoredProvenance:
    """The provenance recorded for a prepared dataset (in its manifest) or a data file (in its
    sidecar), read and checked: its format, its digest and every field."""

    path: Path
    """The dataset or data file."""
    where: Path
    """The file that holds the record: the manifest, or the sidecar (which may not exist)."""
    provenance: Provenance | None
    """None where nothing is declared (provenance unknown)."""

    @property
    def digest(self) -> str | None:
        """The record's digest (what a child pins); None where nothing is declared."""
        return None if self.provenance is None else self.provenance.digest

    @property
    def record(self) -> dict[str, Any]:
        """The record as a manifest or sidecar stores it (the unknown marker where undeclared)."""
        return stored_record(self.provenance)


def read_provenance(path: str | Path) -> StoredProvenance | None:
    """The provenance recorded for ``path``, a prepared dataset (its manifest's record) or a data
    file (its sidecar's; declared by nothing where it has none); None where ``path`` is neither.
    A one-line :class:`UserError` naming the manifest or sidecar when its record is damaged (not
    JSON, of another format, edited after its digest, or not one this project would write)."""
    from .manifest import MANIFEST_NAME, Manifest

    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        record, where = Manifest.read(path).provenance, path / MANIFEST_NAME
    elif path.is_file():
        where = sidecar_path(path)
        record = _sidecar_record(where) if where.is_file() else None
    else:
        return None
    if record:
        problem = record_problem(record)
        if problem:
            raise UserError(f"{where}: {problem}")
    return StoredProvenance(path, where, provenance_from_record(record, f"{where}: provenance"))


def _sidecar_record(sidecar: Path) -> dict[str, Any]:
    """The stored record of a sidecar file (without its ``format``), of today's format."""
    try:
        record = json.loads(sidecar.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{sidecar}: not a provenance record ({exc})") from None
    if not isinstance(record, dict):
        raise UserError(f"{sidecar}: not a provenance record (a JSON object expected)")
    return _migrated_sidecar(record, sidecar)


def _migrated_sidecar(record: dict[str, Any], sidecar: Path) -> dict[str, Any]:
    """A sidecar of an older format brought to today's: one without ``format`` (written before it
    was recorded) holds today's record; another version is refused, naming it."""
    found = record.get("format", SIDECAR_FORMAT)
    if found != SIDECAR_FORMAT:
        raise UserError(f"{sidecar}: format {found!r} is not one this version of mimir reads "
                        f"(it reads {SIDECAR_FORMAT!r}); declare the file's provenance again "
                        "(mimir data declare)")
    return {k: v for k, v in record.items() if k != "format"}


def write_sidecar(data_file: str | Path, provenance: Provenance | None) -> Path:
    """Record ``provenance`` beside a data file a pipeline wrote (atomically)."""
    return write_json_atomic(sidecar_path(data_file), {"format": SIDECAR_FORMAT, **stored_record(provenance)})


def derived_provenance(
    inputs: Iterable[str | Path], *, id: str, source: str, form: str, basis: str | None = None,
    generator: str | None = None, generator_license: str | None = None, notes: str | None = None,
) -> Provenance:
    """The record of data a pipeline made from ``inputs`` (files or prepared datasets): their
    licences (AND) and languages; ``basis`` defaults to the inputs' own when they agree (a
    conversion keeps it), else synthetic. ``generator_license``: the generating models' terms
    (None with a ``generator``: ``unknown``, which the default data policy refuses)."""
    parents, languages = [], {}
    for path in inputs:
        stored = read_provenance(path)
        found = None if stored is None else stored.provenance
        if found is None:
            parents.append(Parent(id=Path(path).name, digest=None, license=UNKNOWN, basis=UNKNOWN,
                                  source=UNKNOWN, path=str(Path(path).resolve())))
        else:
            parents.append(found.as_parent(path))
            languages.update(dict.fromkeys(found.languages))
    if basis is None:
        bases = {p.basis for p in parents}
        basis = bases.pop() if len(bases) == 1 and UNKNOWN not in bases else "synthetic"
    # A conversion keeps its inputs' licences; data generated from them takes the terms they
    # pass on (an agreement's terms for derived data).
    terms = [p.terms if basis == "synthetic" else p.license for p in parents]
    if generator and basis == "synthetic":
        generator_license = generator_license or UNKNOWN
        terms.append(generator_license)
    return Provenance(id=id, source=source, license=combine_licenses(terms),
                      basis=basis, form=form, languages=tuple(languages), derived_from=tuple(parents),
                      generator=generator, notes=notes, generator_license=generator_license)
