"""The provenance flags of ``mimir prepare`` and ``mimir data declare``: their parser group and
their translation into a resolved :class:`~mimir_megatron.data.provenance.Provenance`."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

# --flag -> ProvenanceDeclaration field (docs/data-governance.md explains each).
PROVENANCE_FLAGS = {
    "provenance_id": "id", "source": "source", "source_location": "location",
    "source_revision": "revision", "retrieved": "retrieved", "license": "license", "basis": "basis",
    "form": "form", "audit_group": "audit_group", "language": "languages",
    "derived_from": "derived_from", "generator": "generator", "generator_license": "generator_license",
    "research_organisation": "research_organisation", "lawful_access": "lawful_access",
    "derived_terms": "derived_terms",
}


def add_provenance_flags(p: argparse.ArgumentParser) -> None:
    from mimir_megatron.data.provenance import BASES, FORMS

    g = p.add_argument_group(
        "provenance", "where the data came from and on which basis it may be used (stored in the "
        "manifest; without it the dataset's provenance is 'unknown', which the default data policy "
        "refuses to train on). With --config: a provenance section per dataset instead")
    g.add_argument("--provenance-id",
                   help="the id other datasets' --derived-from name (default: the output name)")
    g.add_argument("--source", help="the source's name, e.g. OpenMathInstruct-2")
    g.add_argument("--source-location", help="a URL, or a Hugging Face Hub repo id (owner/name)")
    g.add_argument("--source-revision", help="the revision or version retrieved")
    g.add_argument("--retrieved", help="the retrieval date, YYYY-MM-DD")
    g.add_argument("--license", help="an SPDX expression (CC-BY-4.0, Apache-2.0 AND MIT), public-domain "
                   "or proprietary-agreement; inherited from --derived-from and --generator-license when "
                   "omitted (an OR may narrow their terms, never drop one)")
    g.add_argument("--basis", choices=tuple(BASES), help="the permission basis")
    g.add_argument("--form", choices=tuple(FORMS), help="the form the data entered the corpus in (Table 6)")
    g.add_argument("--audit-group",
                   help="memorisation-audit group by opt-out status (the paper's A-D, or yours)")
    g.add_argument("--language", action="append", help="an ISO 639 code; repeat for several")
    g.add_argument("--derived-from", action="append", metavar="PATH",
                   help="a prepared dataset, or a file with a provenance sidecar, this data was made from; "
                   "repeat")
    g.add_argument("--generator", help="the models or programs that generated synthetic data")
    g.add_argument("--generator-license",
                   help="the generator models' terms (an SPDX expression, or 'unknown', which the default "
                   "data policy refuses); they bind synthetic data too; required with --generator for "
                   "--basis synthetic")
    g.add_argument("--research-organisation",
                   help="basis tdm-research: the research organisation mining the data (DSM Art. 3)")
    g.add_argument("--lawful-access",
                   help="basis tdm-research: how the organisation has lawful access to the works")
    g.add_argument("--derived-terms",
                   help="basis agreement: the licence the agreement lets derived data be used under "
                   "(synthetic data made from it takes these terms)")


def given_provenance_flags(args: argparse.Namespace) -> list[str]:
    """The provenance flags given on the command line, as typed (``--license``, ...)."""
    return [f"--{flag.replace('_', '-')}" for flag in PROVENANCE_FLAGS if getattr(args, flag)]


def provenance_from_flags(args: argparse.Namespace, default_id: str, output: str | Path | None = None):
    """The resolved provenance of the provenance flags for ``output`` (the dataset or file it
    describes, which its --derived-from may not name); None when none was given."""
    from mimir_megatron.yaml_config import raise_errors
    from mimir_megatron.data.provenance import ProvenanceDeclaration, resolve_declaration

    given = {field: getattr(args, flag) for flag, field in PROVENANCE_FLAGS.items() if getattr(args, flag)}
    if not given:
        return None
    errors: list[str] = []
    provenance = resolve_declaration(ProvenanceDeclaration(**given), "provenance", default_id=default_id,
                                     base=Path.cwd(), output=Path(output) if output else None,
                                     errors=errors)
    # Name the flag a mistake is in: "provenance.license: ..." -> "--license: ...".
    flag_of = {field: f"--{flag.replace('_', '-')}" for flag, field in PROVENANCE_FLAGS.items()}
    raise_errors([re.sub(r"^provenance\.([a-z_]+)", lambda m: flag_of.get(m.group(1), m.group(0)), e)
                  for e in errors], "invalid provenance")
    return provenance
