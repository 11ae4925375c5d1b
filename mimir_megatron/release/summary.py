"""The training-data summary of a checkpoint, organised after the EU AI Office's public summary
template for general-purpose AI models (Art. 53(1)(d) AI Act; template of 24 July 2025).

Every figure comes from the checkpoint's lineage (what each dataset contributed, counted by the
loader, and each dataset's provenance as its manifest declared it) and, where they are still on
disk, the datasets' manifests (tokenisation and rejects). Nothing is typed in by hand. A model
continued from other weights (``checkpoint.init_from``) includes what those were trained on: the
base models' datasets are listed with the run's (their ``model`` says which), and the tables count
both. Every dataset of the mixture is listed, those not sampled yet with 0 tokens. The three
sections of the template:

1. general information: provider, model, modalities, training data size, languages, base models;
2. the list of data sources by kind: public datasets, private datasets licensed from third
   parties (agreement-supplied data, which this project trains on only through data derived from
   it), crawled data, user data, synthetic data derived from agreement data, other synthetic data
   (and what made it), other (undeclared);
3. relevant processing: the data policy applied, opt-out handling by audit group, personal data,
   tokenisation and rejects, synthetic generation and its audits, decontamination.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mimir_megatron.checkpoint import BaseModel, DatasetLineage, TrainerState
from mimir_megatron.data.manifest import MANIFEST_NAME, Manifest
from mimir_megatron.data.provenance import (
    BASES,
    FORMS,
    UNKNOWN,
    agreement_ancestors,
    effective_terms,
    provenance_from_record,
)
from mimir_megatron.errors import UserError

if TYPE_CHECKING:
    from mimir_megatron.evaluation.contamination import ContaminationReport

TEMPLATE = ("EU AI Office, Template for the Public Summary of Training Content for general-purpose "
            "AI models (24 July 2025)")


THIS_RUN = "this run"
"""The ``model`` of a row the checkpoint's own run trained on (a base model's rows name it)."""


def lineage_problems(state: TrainerState, source: str | Path) -> list[str]:
    """Why the release documents of the checkpoint ``source`` cannot be trusted, one line per
    dataset: its provenance as the lineage records it does not validate, or its manifest, still
    on disk, is no longer the one the run trained on (the lineage pins its digest); or the data
    policy recorded with the checkpoint forbids what the model was trained on, its base models'
    data included (the gate's judgement, made again on the whole lineage)."""
    from mimir_megatron.data.policy import DataPolicy, model_lineage_problems

    problems = []
    for entry in state.lineage:
        where = f"{source}: dataset {entry.name}"
        try:
            provenance_from_record(entry.provenance, f"{where}: lineage provenance")
        except UserError as exc:
            problems.append(str(exc))
        manifest_path = Path(entry.path) / MANIFEST_NAME
        if entry.manifest_digest is None or not manifest_path.is_file():
            continue  # pinned before pins were recorded, or the data is gone: the lineage speaks
        try:
            manifest = Manifest.read(entry.path, verify_digest=False)  # an edit is named below
            now, intact = manifest.digest, manifest.digest_intact
        except UserError:
            now, intact = None, False
        if now != entry.manifest_digest or not intact:
            problems.append(f"{where}: its manifest {manifest_path} changed since this checkpoint was "
                            f"trained on it (digest pinned {entry.manifest_digest[:12]}, now "
                            f"{(now or 'none')[:12]}{'' if intact else ', not matching its content'})")
    if state.data_policy is not None and not problems:
        try:
            policy = DataPolicy(**state.data_policy)
        except TypeError:
            return [f"{source}: its recorded data_policy is not one this version reads: {state.data_policy}"]
        problems += [f"{source}: {line}" for line in model_lineage_problems(
            state.lineage, state.base_model, policy, "lineage")]
    return problems


def _provenance_row(entry: DatasetLineage, total: int, model: str = THIS_RUN) -> dict[str, Any]:
    p = provenance_from_record(entry.provenance, f"dataset {entry.name}: lineage provenance")
    row = {
        "dataset": entry.name, "model": model, "path": entry.path, "category": entry.category,
        "audit_group": entry.audit_group,
        "tokens": entry.tokens, "documents": entry.documents, "response_tokens": entry.response_tokens,
        "share": entry.tokens / total if total else 0.0, "personal_data": entry.personal_data,
    }
    if p is None:
        return row | {"provenance": UNKNOWN, "license": UNKNOWN, "basis": UNKNOWN, "form": UNKNOWN,
                      "languages": [entry.language], "source": UNKNOWN, "agreement_derived": False}
    return row | {
        "provenance": entry.provenance_digest, "id": p.id, "source": p.source, "location": p.location,
        "revision": p.revision, "retrieved": p.retrieved, "license": effective_terms(p), "basis": p.basis,
        "form": p.form, "languages": list(p.languages) or [entry.language], "generator": p.generator,
        "generator_license": p.generator_license,
        "research_organisation": p.research_organisation, "lawful_access": p.lawful_access,
        "derived_from": [{"id": d.id, "source": d.source, "license": d.license, "basis": d.basis,
                          "digest": d.digest} for d in p.derived_from],
        "agreement_sources": [{"id": d.id, "source": d.source, "license": d.license, "basis": d.basis,
                               "digest": d.digest} for d in agreement_ancestors(p)],
        "agreement_derived": p.basis != "agreement" and bool(agreement_ancestors(p)),
    }


def _tally(rows: list[dict[str, Any]], key: str) -> dict[str, int]:
    tally: dict[str, int] = defaultdict(int)
    for row in rows:
        values = row[key] if isinstance(row[key], list) else [row[key]]
        for value in values:  # a bilingual dataset's tokens count under each of its languages
            tally[str(value)] += row["tokens"]
    return dict(sorted(tally.items(), key=lambda kv: -kv[1]))


def _base_models(base: BaseModel | None) -> list[dict[str, Any]]:
    chain = []
    while base is not None:
        tokens = sum(e.tokens for e in base.lineage) if base.lineage is not None else None
        chain.append({"source": base.source, "step": base.step, "mlflow_run_id": base.mlflow_run_id,
                      "tokens": tokens, "lineage": "recorded" if base.lineage is not None else UNKNOWN,
                      "datasets": [e.name for e in base.lineage or () if e.tokens or e.documents]})
        base = base.base_model
    return chain


def _model_entries(state: TrainerState) -> list[tuple[str, DatasetLineage]]:
    """(model, entry) for every dataset of the run's lineage and each base model's that was
    trained on: what the weights were trained on, the run's listed first (its unsampled ones too)."""
    entries = [(THIS_RUN, e) for e in state.lineage]
    base = state.base_model
    while base is not None:
        entries += [(base.source, e) for e in base.lineage or () if e.tokens or e.documents]
        base = base.base_model
    return entries


def _manifest_on_disk(path: str) -> Manifest | None:
    """The dataset's manifest if it is still on disk (checked: an edited one is refused, the
    export stops with its line), None where it is gone."""
    if not (Path(path) / MANIFEST_NAME).is_file():
        return None
    return Manifest.read(path)


def _manifest_processing(entry: DatasetLineage) -> dict[str, Any]:
    manifest = _manifest_on_disk(entry.path)
    if manifest is None:
        return {"dataset": entry.name, "manifest": "not available at export"}
    return {"dataset": entry.name, "lines_read": manifest.lines_read,
            "documents": manifest.documents, "rejected": manifest.rejected,
            "rejects": {k: v for k, v in manifest.rejects.items() if v},
            "tokenizer_sha256": manifest.tokenizer.sha256,
            "seq_len": manifest.seq_len,
            "personal_data": manifest.personal_data.to_dict() if manifest.personal_data is not None else None}


def contamination_summary(report_paths: list[Path],
                          state: TrainerState | None = None) -> dict[str, Any] | None:
    """The decontamination result from ``mimir audit contamination`` reports: per suite and
    benchmark, items checked, items found in the training data and the longest shared span.
    With ``state``, a report is accepted only when it checked this checkpoint's training data
    (:func:`report_mismatch`); otherwise a one-line :class:`UserError` names it."""
    from mimir_megatron.evaluation.contamination import ContaminationReport

    if not report_paths:
        return None
    suites: dict[str, Any] = {}
    for path in report_paths:
        report = ContaminationReport.read(path)
        if state is not None:
            problem = report_mismatch(report, state)
            if problem:
                raise UserError(f"{path}: {problem}")
        benchmarks = {}
        for task, bench in sorted(report.benchmarks.items()):
            if bench.error:
                benchmarks[task] = {"error": bench.error}
                continue
            benchmarks[task] = {"items": bench.items, "contaminated": bench.contaminated,
                                "fraction": bench.fraction, "longest_span_tokens": bench.longest_span.tokens}
        suites[report.suite or path.stem] = {"report": str(path), "ngram": report.ngram,
                                             "benchmarks": benchmarks}
    return {"suites": suites}


def report_mismatch(report: ContaminationReport, state: TrainerState) -> str | None:
    """Why a contamination report does not speak for this checkpoint's training data, or None: it
    must have checked every dataset the run trained on, as its manifest was when trained on (the
    lineage pins the manifests' digests; the report records those of its index's datasets)."""
    if report.datasets is None:
        return ("the report does not record which prepared datasets it checked (written before reports "
                "did); run `mimir audit contamination` again on this run's training data")
    digests = {d.manifest_digest for d in report.datasets}
    missing = [e.name for e in state.lineage
               if (e.tokens or e.documents) and e.manifest_digest not in digests]
    if missing:
        return (f"built on other data than this checkpoint was trained on: its index does not hold "
                f"{', '.join(missing)} as trained (manifest digests differ); index the run's mixture "
                "(`mimir audit index --mixture`) and run `mimir audit contamination` on it")
    return None


def _undeclared_share(rows: list[dict[str, Any]], total: int) -> float:
    return sum(r["tokens"] for r in rows if r["basis"] == UNKNOWN) / total if total else 0.0


def _latest_collection(rows: list[dict[str, Any]]) -> str | None:
    dates = [r["retrieved"] for r in rows if r.get("retrieved")]
    return max(dates) if dates else None


def training_data_summary(state: TrainerState, *, model_name: str, provider: str | None = None,
                          checkpoint: str | None = None, contamination: dict[str, Any] | None = None,
                          provider_contact: str | None = None, model_version: str | None = None,
                          placed_on_market: str | None = None) -> dict[str, Any]:
    """The summary of what the checkpoint in ``state`` was trained on, as a JSON-ready dict."""
    from mimir_megatron.data.licences import licence_category, license_keys
    from mimir_megatron.data.policy import DataPolicy

    entries = _model_entries(state)
    total = sum(e.tokens for _, e in entries)
    rows = [_provenance_row(e, total, model) for model, e in entries]
    run_rows = [r for r in rows if r["model"] == THIS_RUN]
    by_basis: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        kind = "agreement-derived" if row["agreement_derived"] else row["basis"]
        by_basis[kind].append(row)
    # Agreement sources that are only parents (one trained on directly is listed there instead),
    # each once: known by their record's digest (ids are not unique across sources).
    trained = {row["provenance"] for row in rows if row["basis"] == "agreement" and row["tokens"]}
    agreement_sources = {(d["id"], d["digest"]): d for row in rows if row["tokens"]
                         for d in row.get("agreement_sources", []) if d["digest"] not in trained}
    commercial = [r for r in rows if r["license"] != UNKNOWN
                  and any(licence_category(k) == "Commercial" for k in license_keys(r["license"]))]
    undeclared = _undeclared_share(rows, total)
    unknown_note = (f"; provenance was not declared for {100 * undeclared:.1f} % of tokens, for which "
                    "this cannot be said") if undeclared else ""
    policy = state.data_policy
    try:
        policy_kind = "default" if policy is not None and DataPolicy(**policy).is_default else "custom"
    except TypeError:
        policy_kind = "custom"
    tdm = by_basis["tdm-research"]
    bases = _base_models(state.base_model)
    sampled = [r for r in rows if r["tokens"] or r["documents"]]
    return {
        "template": TEMPLATE,
        "general": {
            "provider": provider or UNKNOWN,
            "provider_contact": provider_contact or UNKNOWN,
            "model": model_name,
            "model_version": model_version or f"step {state.step}",
            "placed_on_market": placed_on_market or "not stated",
            "modalities": ["text"],
            "content_types": sorted({str(r["category"]) for r in sampled}),
            "checkpoint": checkpoint, "step": state.step,
            "datasets": len(run_rows),
            "datasets_not_sampled": sum(1 for r in run_rows if not (r["tokens"] or r["documents"])),
            "training_tokens": total,
            "training_documents": sum(r["documents"] for r in rows),
            "supervised_tokens": sum(r["response_tokens"] for r in rows),
            "this_run_tokens": sum(r["tokens"] for r in run_rows),
            "undeclared_token_share": undeclared,
            "latest_data_collection": _latest_collection(sampled) or "not recorded",
            "languages": _tally(sampled, "languages"),
            "base_models": bases,
        },
        "sources": {
            "public_datasets": by_basis["open-licence"] + by_basis["public-domain"],
            "licensed_private_datasets": {
                "trained_on_directly": by_basis["agreement"],
                "commercially_licensed": commercial,
                "used_only_to_derive_synthetic_data": sorted(agreement_sources.values(),
                                                             key=lambda d: (d["id"], d["digest"] or "")),
            },
            "tdm_research_datasets": tdm,
            "crawled_data": "none declared: every dataset's provenance names its source, and none declares "
                            "data crawled or scraped by the provider" + unknown_note,
            "user_data": "none declared: no dataset's provenance declares data from the model's users"
                         + unknown_note,
            "agreement_derived_data": by_basis["agreement-derived"],
            "synthetic_data": by_basis["synthetic"],
            "other_undeclared": by_basis[UNKNOWN],
        },
        "tables": {
            "by_category": _tally(rows, "category"),
            "by_language": _tally(rows, "languages"),
            "by_license": _tally(rows, "license"),
            "by_basis": _tally(rows, "basis"),
            "by_form": _tally(rows, "form"),
            "by_audit_group": _tally(rows, "audit_group"),
        },
        "processing": {
            "data_policy": policy,
            "data_policy_kind": policy_kind,
            "opt_outs": _opt_out_statement(rows, tdm, total),
            "illegal_content": _illegal_content_statement(run_rows),
            "personal_data": _personal_data_handling(rows, policy),
            "tokenisation": [_manifest_processing(e) for model, e in entries if model == THIS_RUN],
            "synthetic_generation": [
                {"dataset": r["dataset"], "form": r["form"], "generator": r.get("generator"),
                 "audited": r["form"] in ("synthetic-audited", "translated-audited")}
                for r in by_basis["synthetic"] + by_basis["agreement-derived"] if r["basis"] == "synthetic"],
            "decontamination": contamination or "no contamination report (mimir audit contamination)",
        },
    }


def _personal_data_handling(rows: list[dict[str, Any]], policy: dict[str, Any] | None) -> dict[str, Any]:
    """What the lineage records of the personal-data screen of every dataset trained on: how
    many were screened and under which policy, and the direct identifiers kept (which the
    default data policy refuses; a custom one may allow them)."""
    from mimir_megatron.data.manifest import PersonalDataScreen

    screened: dict[str, int] = defaultdict(int)
    kept: dict[str, dict[str, int]] = {}
    trained = [r for r in rows if r["tokens"] or r["documents"]]
    for row in trained:
        screen = row.get("personal_data")
        if not isinstance(screen, dict):
            continue
        screened[str(screen.get("policy"))] += 1
        found = PersonalDataScreen(str(screen.get("policy")), dict(screen.get("found") or {}), 0).kept
        if found:
            kept[row["dataset"]] = found
    return {"datasets": len(trained), "screened": dict(screened),
            "not_recorded": len(trained) - sum(screened.values()), "kept": kept,
            "allowed_by_policy": bool((policy or {}).get("allow_personal_data"))}


def _opt_out_statement(rows: list[dict[str, Any]], tdm: list[dict[str, Any]], total: int) -> str:
    """How reservations of rights (TDM opt-outs) bear on the data, from the declared bases."""
    share = {b: sum(r["tokens"] for r in rows if r["basis"] == b) / total if total else 0.0
             for b in ("open-licence", "public-domain", "synthetic", "agreement", "tdm-research", UNKNOWN)}
    parts = [f"{100 * (share['open-licence'] + share['public-domain']):.1f} % of tokens are openly licensed "
             "or in the public domain (their licences permit mining)",
             f"{100 * share['synthetic']:.1f} % synthetic (judged by the terms of the data they derive from)"]
    if share["agreement"]:
        parts.append(f"{100 * share['agreement']:.1f} % supplied under agreement (its terms govern)")
    if tdm:
        orgs = sorted({str(r.get('research_organisation')) for r in tdm})
        parts.append(f"{100 * share['tdm-research']:.1f} % mined under the DSM Directive's Art. 3 research "
                     f"exception by {', '.join(orgs)}, to which opt-outs do not apply")
    if share[UNKNOWN]:
        parts.append(f"{100 * share[UNKNOWN]:.1f} % had no declared provenance: its opt-out status is "
                     "unknown")
    else:  # every basis the project knows is one of the above: none relies on Art. 4
        parts.append("no dataset relies on the general Art. 4 exception, so no machine-readable "
                     "reservation (robots.txt, TDMRep) needed honouring")
    parts.append("audit groups record the opt-out confidence per dataset")
    return "; ".join(parts)


def _illegal_content_statement(rows: list[dict[str, Any]]) -> str:
    """What `mimir prepare` did against unwanted content, from the manifests still on disk."""
    screened, denylisted, seen = 0, 0, 0
    trained = [r for r in rows if r["tokens"] or r["documents"]]
    for row in trained:
        manifest = _manifest_on_disk(row["path"])
        if manifest is None:
            continue
        seen += 1
        screened += manifest.personal_data is not None
        denylisted += bool(manifest.denylist)
    if not seen:
        return "not recorded: the datasets' manifests were not available at export"
    return (f"{seen} of {len(trained)} datasets' manifests read at export: {screened} screened for personal "
            f"data by `mimir prepare`, {denylisted} prepared with a benchmark denylist; every dataset was "
            "checked against the data policy before training; no classifier for other illegal content "
            "was run")


def _table(title: str, tally: dict[str, int], total: int, labels: dict[str, str] | None = None) -> list[str]:
    lines = [f"| {title} | tokens | share |", "| --- | ---: | ---: |"]
    for key, tokens in tally.items():
        lines.append(f"| {(labels or {}).get(key, key)} | {tokens:,} | {100 * tokens / total:.1f} % |"
                     if total else f"| {key} | {tokens:,} | - |")
    return lines


def _personal_data_text(screen: dict[str, Any] | None) -> str:
    if not screen:
        return "not screened for personal data"
    found = ", ".join(f"{n:,} {kind}" for kind, n in screen.get("found", {}).items()) or "none found"
    return (f"personal data ({screen.get('policy')} policy): {found}; "
            f"{screen.get('documents_rejected', 0):,} documents rejected for it")


def personal_data_statement(handling: dict[str, Any]) -> str:
    """One paragraph on the personal-data screen of the data trained on (the summary's and the
    model card's)."""
    screened = handling["screened"]
    done = sum(screened.values())
    policies = ", ".join(f"{n} with policy {policy}" for policy, n in sorted(screened.items()))
    text = (f"{done} of {handling['datasets']} dataset(s) trained on were screened for direct identifiers "
            f"(e-mail addresses, phone numbers, IBANs, payment cards, national ids) by `mimir prepare`"
            + (f" ({policies})" if policies else ""))
    if handling["not_recorded"]:
        text += f"; for {handling['not_recorded']} the lineage records no screen"
    if handling["kept"]:
        kept = "; ".join(f"{dataset}: " + ", ".join(f"{n:,} {kind}" for kind, n in found.items())
                         for dataset, found in handling["kept"].items())
        allowed = ("allowed explicitly by the custom data policy (allow_personal_data)"
                   if handling["allowed_by_policy"] else "not allowed by the data policy recorded")
        text += f"; direct identifiers found and kept in the training data ({kept}), {allowed}"
    else:
        text += "; none found was kept (rejected or redacted)"
    return text + ". Names and postal addresses are not looked for; no screen is complete"


def summary_markdown(summary: dict[str, Any]) -> str:
    """The summary as a Markdown document (the JSON beside it holds the same figures)."""
    g, s, t = summary["general"], summary["sources"], summary["tables"]
    total = g["training_tokens"]
    out = [f"# Training data summary: {g['model']}", "",
           f"Organised after the {summary['template']}. Every figure comes from the checkpoint's data "
           "lineage and the datasets' manifests.", "",
           "## 1. General information", "",
           f"- Provider: {g['provider']} (contact: {g['provider_contact']})",
           f"- Model: {g['model']}, version {g['model_version']} (checkpoint {g['checkpoint']}, "
           f"step {g['step']:,}); placed on the market: {g['placed_on_market']}",
           "- Modalities: text; content types: " + (", ".join(g["content_types"]) or "none"),
           f"- Training data: {total:,} tokens in {g['training_documents']:,} documents as sampled "
           f"(repeats counted), {g['supervised_tokens']:,} of them supervised (responses)"
           + (f", {total - g['this_run_tokens']:,} of them by the base model(s)" if g["base_models"] else "")
           + f"; this run's mixture lists {g['datasets']} dataset(s)"
           + (f" ({g['datasets_not_sampled']} not sampled yet: 0 tokens)"
              if g["datasets_not_sampled"] else "")
           + "; "
           + (f"{100 * g['undeclared_token_share']:.1f} % of tokens had no declared provenance"
              if g["undeclared_token_share"] else "every token's provenance was declared"),
           f"- Latest data collection (the latest retrieval date declared): {g['latest_data_collection']}",
           "- Languages: " + ", ".join(f"{k} ({100 * v / total:.1f} %)" for k, v in g["languages"].items())
           if total else "- Languages: none"]
    for base in g["base_models"]:
        data = ("training data not recorded" if base["tokens"] is None else
                f"{base['tokens']:,} tokens from {', '.join(base['datasets']) or 'no dataset'}, listed below")
        out.append(f"- Continued from the base model {base['source']} (step {base['step']}; {data})")
    out += ["", "## 2. Data sources", ""]
    columns = ["dataset", "source", "license", "basis", "form", "languages", "audit_group", "tokens",
               "share"]
    if g["base_models"]:
        columns.insert(1, "model")
    for title, rows in (("Publicly available datasets", s["public_datasets"]),
                        ("Synthetic data derived from data supplied under agreement",
                         s["agreement_derived_data"]),
                        ("Other synthetic data", s["synthetic_data"]),
                        ("Private datasets licensed from third parties, trained on directly",
                         s["licensed_private_datasets"]["trained_on_directly"]),
                        ("Private datasets commercially licensed (licence category Commercial)",
                         s["licensed_private_datasets"]["commercially_licensed"]),
                        ("Data mined under the text-and-data-mining exception for research (DSM Art. 3)",
                         s["tdm_research_datasets"]),
                        ("Other (provenance not declared)", s["other_undeclared"])):
        out += [f"### {title}", ""]
        if not rows:
            out += ["None.", ""]
            continue
        out += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        for r in rows:
            cells = [r["dataset"], r["source"], r["license"], r["basis"], r["form"],
                     ", ".join(r["languages"]), str(r["audit_group"]), f"{r['tokens']:,}",
                     f"{100 * r['share']:.1f} %"]
            if g["base_models"]:
                cells.insert(1, r["model"])
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    derived = s["licensed_private_datasets"]["used_only_to_derive_synthetic_data"]
    out += ["### Data supplied under agreement, used only to derive synthetic data", ""]
    out += [f"- {d['id']}: {d['source']} ({d['license']})" for d in derived] or ["None."]
    out += ["", f"Crawled or scraped data: {s['crawled_data']}.", "", f"User data: {s['user_data']}.", ""]
    out += ["### Tokens by form (Table 6), language (Table 7), licence, basis and audit group", ""]
    out += _table("form", t["by_form"], total, FORMS) + [""]
    out += _table("language", t["by_language"], total) + [""]
    out += _table("licence", t["by_license"], total) + [""]
    out += _table("basis", t["by_basis"], total, BASES) + [""]
    out += _table("audit group", t["by_audit_group"], total) + [""]
    out += _table("category", t["by_category"], total) + [""]
    p = summary["processing"]
    out += ["## 3. Processing", "",
            f"- Data policy checked before training ({p['data_policy_kind']}): "
            f"`{json.dumps(p['data_policy'])}`",
            f"- Reservations of rights (text-and-data-mining opt-outs): {p['opt_outs']}",
            f"- Illegal and unwanted content: {p['illegal_content']}",
            f"- Personal data: {personal_data_statement(p['personal_data'])}"]
    for step in p["tokenisation"]:
        if "manifest" in step:
            out.append(f"- {step['dataset']}: manifest {step['manifest']}")
        else:
            out.append(f"- {step['dataset']}: {step['documents']:,} documents kept of {step['lines_read']:,} "
                       f"lines, {step['rejected']:,} rejected {step['rejects'] or ''} (tokenizer "
                       f"{str(step['tokenizer_sha256'])[:12]}, seq_len {step['seq_len']}); "
                       + _personal_data_text(step.get("personal_data")))
    for gen in p["synthetic_generation"]:
        made_by = gen["generator"] or UNKNOWN
        out.append(f"- {gen['dataset']}: {FORMS.get(gen['form'], gen['form'])} by {made_by}"
                   + (", audited" if gen["audited"] else ""))
    decontamination = p["decontamination"]
    if isinstance(decontamination, str):
        out.append(f"- Decontamination: {decontamination}")
    else:
        out.append("- Decontamination (benchmark items found in the training data):")
        for suite, checked in decontamination["suites"].items():
            for task, b in checked["benchmarks"].items():
                found = b.get("error") or (f"{b['contaminated']} of {b['items']} items "
                                           f"({100 * b['fraction']:.1f} %), longest shared span "
                                           f"{b['longest_span_tokens']} tokens")
                out.append(f"  - {suite} / {task} ({checked['ngram']}-token n-grams): {found}")
    return "\n".join(out) + "\n"
