"""The Hugging Face model card (``README.md`` with YAML front matter) that ``mimir export`` writes.

The front matter is written and read back with ``huggingface_hub`` (``ModelCard``/``ModelCardData``):
``license``, ``language``, ``datasets`` (the Hub repo ids among the training data's declared
locations), ``tags``, ``base_model`` (when the run started from other weights), ``library_name``
and ``pipeline_tag``. ``ModelCard.validate()`` asks the Hub's server, so it is not run here; the
card is parsed back instead. The data section's figures are the training-data summary's.
"""

from __future__ import annotations

import re
from typing import Any

from mimir_megatron.data.provenance import UNKNOWN, normalise_license

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


def hf_license(expression: str | None) -> tuple[str, str | None]:
    """(the card's ``license``, its ``license_name`` when it is ``other``): a single SPDX id in the
    Hub's lower-case spelling, else ``other`` naming the expression."""
    if not expression:
        return "other", "unspecified"
    normalised, problem = normalise_license(expression)
    if problem:
        from mimir_megatron.errors import UserError

        raise UserError(f"--license: {problem}")
    if re.fullmatch(r"[A-Za-z0-9.+-]+", normalised):
        return normalised.lower(), None
    return "other", normalised


def model_card(*, model_name: str, model_info: dict[str, Any], summary: dict[str, Any] | None,
               license: str | None = None, base_model: str | None = None,
               tags: list[str] | None = None) -> str:
    """The card's text. ``summary`` is the training-data summary (None: no lineage, e.g. weights
    exported from `mimir import` output); ``model_info`` holds ``layers_l``, ``layers_h``,
    ``schedule``, ``hidden``, ``parameters`` and ``training`` (a Markdown paragraph)."""
    from huggingface_hub import ModelCard, ModelCardData

    card_license, license_name = hf_license(license)
    languages, datasets = [], []
    if summary is not None:
        languages = [k for k in summary["general"]["languages"] if k != UNKNOWN]
        sources = summary["sources"]
        for row in sources["public_datasets"] + sources["synthetic_data"]:
            if row.get("location") and _HUB_ID.match(row["location"]):
                datasets.append(row["location"])
    data = ModelCardData(
        license=card_license, license_name=license_name, language=languages or None,
        datasets=sorted(set(datasets)) or None, base_model=base_model,
        tags=["hrm-text", "mimir-megatron", *(tags or [])], library_name="transformers",
        pipeline_tag="text-generation",
    )
    card = ModelCard.from_template(data, template_str=_TEMPLATE, model_name=model_name,
                                   data=_data_section(summary), **model_info)
    return str(card)


def _data_section(summary: dict[str, Any] | None) -> str:
    if summary is None:
        return ("Not recorded: these weights were exported without a training checkpoint's data "
                "lineage (for example from `mimir import` output).")
    g, t = summary["general"], summary["tables"]
    total = g["training_tokens"]
    lines = [f"{total:,} tokens ({g['training_documents']:,} documents) as sampled, from "
             f"{g['datasets']} datasets; "
             "each dataset's provenance was declared when it was prepared and checked against the data "
             "policy before training.", "",
             "| licence | tokens | share |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {v:,} | {100 * v / total:.1f} % |" for k, v in t["by_license"].items()]
    lines += ["", "| basis | tokens | share |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {v:,} | {100 * v / total:.1f} % |" for k, v in t["by_basis"].items()]
    undeclared = summary["sources"]["other_undeclared"]
    if undeclared:
        lines += ["", f"**{len(undeclared)} dataset(s) had no declared provenance (unknown):** "
                  + ", ".join(r["dataset"] for r in undeclared)]
    return "\n".join(lines)
