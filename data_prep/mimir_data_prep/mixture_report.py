"""`mimir data report`: token accounting of a mixture in the layout of the paper's Tables 1, 6, 7
and 8 (categories, forms, languages, top datasets), with licences, permission bases and audit
groups from each dataset's provenance, and the data policy's verdict.

Tokens per epoch of a dataset = its prepared tokens (prefix + response, from the manifest) times
its repeat factor. A dataset that is not prepared yet may declare ``tokens`` in the YAML instead,
which lets a planned mixture be reported before any data is tokenized. A dataset prepared without
a provenance declaration shows ``unknown`` in every provenance table. The personal-data screen of
each prepared dataset (policy, identifiers found by kind, documents rejected) is listed from its
manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from mimir_megatron.data.manifest import MANIFEST_NAME, Manifest, PersonalDataScreen
from mimir_megatron.data.mixture import Mixture, MixtureEntry, load_mixture
from mimir_megatron.data.provenance import FORMS, UNKNOWN, effective_terms, provenance_from_record
from mimir_megatron.errors import UserError


@dataclass(frozen=True)
class DatasetRow:
    name: str
    category: str
    language: str
    repeat: float
    tokens: int  # one copy
    tokens_per_epoch: int
    declared: bool  # size taken from the YAML, not from a manifest
    form: str = UNKNOWN
    license: str = UNKNOWN
    basis: str = UNKNOWN
    audit_group: str = UNKNOWN
    personal_data: PersonalDataScreen | None = None  # None: not prepared, or prepared before the screen


@dataclass(frozen=True)
class GroupRow:
    key: str
    tokens_per_epoch: int
    share: float  # percent
    datasets: int
    avg_tokens_per_dataset: float


def dataset_rows(mixture: Mixture) -> list[DatasetRow]:
    rows = []
    for e in mixture.entries:
        manifest = Manifest.read(e.path) if (Path(e.path) / MANIFEST_NAME).is_file() else None
        tokens, declared = _tokens(e, manifest)
        provenance = None if manifest is None else provenance_from_record(
            manifest.provenance, f"dataset {e.name}: {e.path / 'manifest.json'}: provenance")
        known = {}
        if provenance is not None:
            known = {"form": FORMS[provenance.form], "license": effective_terms(provenance),
                     "basis": provenance.basis}
        rows.append(
            DatasetRow(
                e.name,
                e.category,
                e.language,
                e.repeat,
                tokens,
                int(round(tokens * e.repeat)),
                declared,
                audit_group=e.audit_group_of(provenance),
                personal_data=None if manifest is None else manifest.personal_data,
                **known,
            )
        )
    return rows


def _tokens(entry: MixtureEntry, manifest: Manifest | None) -> tuple[int, bool]:
    if manifest is not None:
        return manifest.tokens_total, False
    if entry.tokens is not None:
        return entry.tokens, True
    raise UserError(
        f"dataset {entry.name!r}: {entry.path} is not prepared and the mixture declares no "
        "'tokens' for it; run `mimir prepare` (or `mimir data demo`) first"
    )


def group_rows(rows: list[DatasetRow], by: str) -> list[GroupRow]:
    """Rows grouped by a field (``category``, ``language``, ``form``, ...), largest first."""
    total = sum(r.tokens_per_epoch for r in rows)
    groups: dict[str, list[DatasetRow]] = {}
    for r in rows:
        groups.setdefault(getattr(r, by), []).append(r)
    out = []
    for key, members in groups.items():
        tokens = sum(m.tokens_per_epoch for m in members)
        out.append(
            GroupRow(
                key,
                tokens,
                100.0 * tokens / total if total else 0.0,
                len(members),
                tokens / len(members),
            )
        )
    return sorted(out, key=lambda g: (-g.tokens_per_epoch, g.key))


def _group_table(title: str, groups: list[GroupRow], rows: list[DatasetRow]) -> list[str]:
    width = max([len(title)] + [len(g.key) for g in groups])
    lines = [
        f"{title:<{width}}  {'Tokens/epoch':>16}  {'Share':>7}  {'Datasets':>8}  "
        f"{'Avg tokens/dataset':>18}"
    ]
    for g in groups:
        lines.append(
            f"{g.key:<{width}}  {g.tokens_per_epoch:>16,}  {g.share:>6.2f}%  "
            f"{g.datasets:>8}  {g.avg_tokens_per_dataset:>18,.0f}"
        )
    total = sum(g.tokens_per_epoch for g in groups)
    lines.append(
        f"{'Total':<{width}}  {total:>16,}  {100.0 if total else 0.0:>6.2f}%  "
        f"{len(rows):>8}  {total / max(len(rows), 1):>18,.0f}"
    )
    return lines


def format_report(mixture: Mixture, top: int = 10) -> str:
    rows = dataset_rows(mixture)
    total = sum(r.tokens_per_epoch for r in rows)
    out = [
        f"Mixture {mixture.name} ({mixture.source}): {len(rows)} datasets, "
        f"{total:,} tokens per epoch",
        "",
    ]
    out += _group_table("Category", group_rows(rows, "category"), rows) + [""]
    out += _group_table("Form", group_rows(rows, "form"), rows) + [""]
    out += _group_table("Language", group_rows(rows, "language"), rows) + [""]
    out += _group_table("Licence", group_rows(rows, "license"), rows) + [""]
    out += _group_table("Basis", group_rows(rows, "basis"), rows) + [""]
    out += _group_table("Audit group", group_rows(rows, "audit_group"), rows) + [""]
    ranked = sorted(rows, key=lambda r: (-r.tokens_per_epoch, r.name))[:top]
    width = max([7] + [len(r.name) for r in ranked])
    cat_w = max([8] + [len(r.category) for r in ranked])
    out.append(f"Top {len(ranked)} datasets by tokens per epoch")
    out.append(
        f"{'#':>3}  {'Dataset':<{width}}  {'Category':<{cat_w}}  {'Lang':<6}  "
        f"{'Repeat':>6}  {'Tokens/epoch':>16}  {'Share':>7}"
    )
    for i, r in enumerate(ranked, 1):
        share = 100.0 * r.tokens_per_epoch / total if total else 0.0
        mark = "*" if r.declared else " "
        out.append(
            f"{i:>3}  {r.name:<{width}}  {r.category:<{cat_w}}  {r.language:<6}  "
            f"{r.repeat:>5g}x  {r.tokens_per_epoch:>16,}{mark} {share:>6.2f}%"
        )
    if any(r.declared for r in rows):
        out += ["", "* size declared in the mixture file (dataset not prepared yet)"]
    out += ["", *_personal_data_lines(rows)]
    out += ["", *_policy_lines(mixture, rows)]
    return "\n".join(out)


def _personal_data_lines(rows: list[DatasetRow]) -> list[str]:
    """Each prepared dataset's personal-data screen: policy, documents rejected, what was found."""
    prepared = [r for r in rows if not r.declared]
    width = max([7] + [len(r.name) for r in prepared])
    lines = ["Personal data (the screen of `mimir prepare`: direct identifiers found, documents rejected)",
             f"{'Dataset':<{width}}  {'Policy':<14}  {'Rejected':>8}  Found"]
    for r in prepared:
        screen = r.personal_data
        if screen is None:
            lines.append(f"{r.name:<{width}}  {'not screened':<14}  {'-':>8}  (prepared before the screen)")
            continue
        found = ", ".join(f"{n:,} {kind}" for kind, n in screen.found.items() if n) or "none"
        lines.append(f"{r.name:<{width}}  {screen.policy:<14}  {screen.documents_rejected:>8,}  {found}")
    return lines


def _policy_lines(mixture: Mixture, rows: list[DatasetRow]) -> list[str]:
    """The data policy's verdict on the prepared datasets (what `mimir train` checks first)."""
    from mimir_megatron.data.policy import training_data_problems

    unknown = [r.name for r in rows if r.basis == UNKNOWN and not r.declared]
    lines = [f"Provenance unknown (prepared without a declaration): {', '.join(unknown)}"] if unknown else []
    prepared = [e for e, r in zip(mixture.entries, rows) if not r.declared]
    problems = training_data_problems(replace(mixture, entries=tuple(prepared)))
    if problems:
        lines += [f"Data policy: {len(problems)} problem(s); `mimir train` refuses this mixture:"]
        lines += [f"  - {p}" for p in problems]
    else:
        lines.append(f"Data policy: the {len(prepared)} prepared dataset(s) may be trained on")
    return lines


def report(mixture_path: str | Path, top: int = 10) -> str:
    return format_report(load_mixture(mixture_path), top)
