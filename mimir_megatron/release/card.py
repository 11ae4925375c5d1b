"""The Hugging Face model card (``README.md`` with YAML front matter) that ``mimir export`` writes.

The front matter is written and read back with ``huggingface_hub`` (``ModelCard``/``ModelCardData``):
``license``, ``language``, ``datasets`` (the Hub repo ids among the training data's declared
locations), ``tags``, ``base_model`` (when the run started from other weights), ``library_name``
and ``pipeline_tag``. ``ModelCard.validate()`` asks the Hub's server, so it is not run here; the
card is parsed back instead. The data section's figures are the training-data summary's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mimir_megatron.data.licences import (
    EXTRA_LICENCES,
    base_licence,
    combine_licenses,
    dropped_terms,
    licence_category,
    license_keys,
    normalise_license,
)
from mimir_megatron.data.provenance import UNKNOWN
from mimir_megatron.errors import UserError

from .summary import personal_data_statement

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

_TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

An HRM-Text model (hierarchical recurrent language model) trained with mimir-megatron: two
transformer stacks, L ({{ layers_l }} layers) and H ({{ layers_h }} layers), applied in the
recurrence {{ schedule }}; hidden size {{ hidden }}, {{ parameters }} parameters. Load it with
`transformers` (`AutoModelForCausalLM`, model type `hrm_text`); the prompt (prefix) is marked with
`token_type_ids == 1`.

## Training

{{ training }}

## Training data

{{ data }}

The full summary, organised after the EU AI Office's template for the public summary of training
content, is in `training_data_summary.md` (and `training_data_summary.json`).
"""


# The Hub's licence ids (https://huggingface.co/docs/hub/repositories-licenses): what a card's
# `license` may say; anything else is `other` with license_name and license_link.
HUB_LICENSES = frozenset("""
apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0
bigcode-openrail-m afl-3.0 artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause bsd-3-clause-clear c-uda
cc cc0-1.0 cc-by-2.0 cc-by-2.5 cc-by-3.0 cc-by-4.0 cc-by-sa-3.0 cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0
cc-by-nc-4.0 cc-by-nd-4.0 cc-by-nc-nd-3.0 cc-by-nc-nd-4.0 cc-by-nc-sa-2.0 cc-by-nc-sa-3.0
cc-by-nc-sa-4.0 cdla-sharing-1.0 cdla-permissive-1.0 cdla-permissive-2.0 wtfpl ecl-2.0 epl-1.0
epl-2.0 etalab-2.0 eupl-1.1 eupl-1.2 agpl-3.0 gfdl gpl gpl-2.0 gpl-3.0 lgpl lgpl-2.1 lgpl-3.0 isc
h-research intel-research lppl-1.3c ms-pl apple-ascl apple-amlr mpl-2.0 odc-by odbl openrail++
osl-3.0 postgresql ofl-1.1 ncsa unlicense zlib pddl lgpl-lr deepfloyd-if-license llama2 llama3
llama3.1 llama3.2 llama3.3 llama4 gemma
""".split())
_SPDX_TO_HUB = {"odc-by-1.0": "odc-by", "odbl-1.0": "odbl", "pddl-1.0": "pddl"}


@dataclass(frozen=True)
class CardLicence:
    """The card's licence fields: ``license`` a Hub id, or ``other`` with a name and a link."""

    spdx: str | None
    license: str
    license_name: str | None = None
    license_link: str | None = None


def hf_license(expression: str | None) -> CardLicence:
    """The card's licence fields for the model's licence (an SPDX expression): the Hub's id when
    it has one for it (GPL-3.0-only -> gpl-3.0, ODC-By-1.0 -> odc-by), else ``other`` naming it
    with a link to its SPDX page. None: ``other``, unspecified."""
    if not expression:
        return CardLicence(None, "other", "unspecified", None)
    normalised, problem = normalise_license(expression)
    if problem:
        raise UserError(f"--license: {problem}")
    key = re.sub(r"-(only|or-later)$", "", normalised.lower())
    key = _SPDX_TO_HUB.get(key, key)
    if key in HUB_LICENSES:
        return CardLicence(normalised, key)
    name = re.sub(r"[^a-z0-9.]+", "-", normalised.lower()).strip("-")
    ids = license_keys(normalised)
    single = len(ids) == 1 and ids[0] not in EXTRA_LICENCES
    link = f"https://spdx.org/licenses/{base_licence(ids[0])}.html" if single else "https://spdx.org/licenses/"
    return CardLicence(normalised, "other", name, link)


def data_terms(summary: dict[str, Any] | None) -> str | None:
    """The combined terms of everything the model was trained on, its base models' data included
    (None: not recorded or unknown)."""
    if summary is None:
        return None
    licences = [k for k, tokens in summary["tables"]["by_license"].items() if k != UNKNOWN and tokens]
    return combine_licenses(licences) if licences else None


def licence_risk(model_licence: str | None, summary: dict[str, Any] | None) -> list[str]:
    """The training data's licence ids the model's licence does not carry and that are more than
    attribution: copyleft, non-commercial, no-derivatives, agreement and unlisted terms. (Attribution
    licences, ScanCode's Permissive and Public Domain categories, are honoured by the card's and
    the summary's attribution of every source.) Empty when the model's licence is not given."""
    terms = data_terms(summary)
    if not model_licence or terms is None:
        return []
    normalised, _ = normalise_license(model_licence)
    return [k for k in dropped_terms(normalised or model_licence, terms)
            if k.startswith("LicenseRef-") or licence_category(k) not in ("Permissive", "Public Domain")]


def model_card(*, model_name: str, model_info: dict[str, Any], summary: dict[str, Any] | None,
               license: str | None = None, base_model: str | None = None,
               tags: list[str] | None = None, accept_licence_risk: bool = False) -> str:
    """The card's text. ``summary`` is the training-data summary (None: no lineage, e.g. weights
    exported from `mimir import` output); ``model_info`` holds ``layers_l``, ``layers_h``,
    ``schedule``, ``hidden``, ``parameters`` and ``training`` (a Markdown paragraph).

    A model licence that drops terms of the training data (:func:`licence_risk`) is refused
    unless ``accept_licence_risk``, and then stated in the card."""
    from huggingface_hub import ModelCard, ModelCardData

    card_licence = hf_license(license)
    risk = licence_risk(license, summary)
    if risk and not accept_licence_risk:
        raise UserError(f"--license {card_licence.spdx} is more permissive than the training data's terms "
                        f"({data_terms(summary)}): it drops {', '.join(risk)}; release under terms that keep "
                        "them, or pass --accept-licence-risk (the card then says so)")
    languages, datasets = [], []
    if summary is not None:
        languages = [k for k in summary["general"]["languages"] if k != UNKNOWN]
        sources = summary["sources"]
        for row in (sources["public_datasets"] + sources["agreement_derived_data"] + sources["synthetic_data"]
                    + sources["tdm_research_datasets"]):
            if row.get("location") and _HUB_ID.match(row["location"]):
                datasets.append(row["location"])
    data = ModelCardData(
        license=card_licence.license, license_name=card_licence.license_name,
        license_link=card_licence.license_link, language=languages or None,
        datasets=sorted(set(datasets)) or None, base_model=base_model,
        tags=["hrm-text", "mimir-megatron", *(tags or [])], library_name="transformers",
        pipeline_tag="text-generation",
    )
    section = _data_section(summary)
    if risk:
        section += (f"\n\n**Licence risk accepted:** the model is released under {card_licence.spdx}, which "
                    f"does not carry these terms of its training data: {', '.join(risk)} (the data's "
                    f"combined terms: {data_terms(summary)}). The provider accepted that risk "
                    "(`--accept-licence-risk`).")
    card = ModelCard.from_template(data, template_str=_TEMPLATE, model_name=model_name, data=section,
                                   **model_info)
    return str(card)


def _share(tokens: int, total: int) -> str:
    return f"{100 * tokens / total:.1f} %" if total else "-"


def _data_section(summary: dict[str, Any] | None) -> str:
    """Every sentence from the lineage: what was declared, under which policy, in which shares."""
    if summary is None:
        return ("Not recorded: these weights were exported without a training checkpoint's data "
                "lineage (for example from `mimir import` output).")
    g, t, s = summary["general"], summary["tables"], summary["sources"]
    total = g["training_tokens"]
    undeclared = s["other_undeclared"]
    if undeclared:
        declared = (f"**{100 * g['undeclared_token_share']:.1f} % of tokens had no declared provenance** "
                    f"({len(undeclared)} dataset(s): {', '.join(r['dataset'] for r in undeclared)}); the "
                    "other datasets' provenance was declared when they were prepared")
    else:
        declared = "every dataset's provenance was declared when it was prepared"
    policy = summary["processing"]
    policy_text = ("the paper's default data policy" if policy["data_policy_kind"] == "default"
                   else "a custom data policy (see the summary)")
    checked = (f"and checked against {policy_text} before training" if policy["data_policy"] is not None
               else "(no data policy was recorded with this checkpoint)")
    unsampled = f" ({g['datasets_not_sampled']} not sampled yet)" if g["datasets_not_sampled"] else ""
    lines = [f"{total:,} tokens ({g['training_documents']:,} documents) as sampled, from "
             f"{g['datasets']} datasets{unsampled}; {declared}, {checked}."]
    for base in g["base_models"]:
        data = ("whose training data is not recorded" if base["tokens"] is None else
                f"trained on {base['tokens']:,} of these tokens, from "
                f"{', '.join(base['datasets']) or 'none'}")
        lines += ["", f"Continued from the base model {base['source']} (step {base['step']}), {data}; the "
                  "tables below count the base model's data with this run's."]
    lines += ["", "| licence | tokens | share |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {v:,} | {_share(v, total)} |" for k, v in t["by_license"].items()]
    lines += ["", "| basis | tokens | share |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {v:,} | {_share(v, total)} |" for k, v in t["by_basis"].items()]
    lines += ["", f"Personal data: {personal_data_statement(policy['personal_data'])}."]
    return "\n".join(lines)
