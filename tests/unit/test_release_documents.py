"""The model card and the training-data summary say only what the lineage shows
(mimir_megatron.release): shares over tokens, undeclared provenance stated, Hub licence ids, a
model licence that drops the data's terms refused unless the risk is accepted, agreement sources
listed once, contamination reports accepted only for this checkpoint's training data.

Checkpoints are built in memory (a TrainerState with hand-made lineage whose token and document
counts differ in ratio), so every figure is checked against hand-computed values."""

from __future__ import annotations


import pytest

from mimir_megatron.checkpoint import DatasetLineage, TrainerState
from mimir_megatron.data.policy import DataPolicy
from mimir_megatron.errors import UserError
from mimir_megatron.release.card import hf_license, licence_risk, model_card
from mimir_megatron.release.summary import report_mismatch, summary_markdown, training_data_summary
from provenance_data import declared as _record

INFO = {"layers_l": 1, "layers_h": 1, "schedule": "LH", "hidden": 8, "parameters": "1", "training": "t"}


def _entry(name: str, record: dict, documents: int, tokens: int) -> DatasetLineage:
    return DatasetLineage(name=name, path=f"/nowhere/{name}", category="c", language="en", audit_group="C",
                          provenance=record, provenance_digest=record.get("digest"), documents=documents,
                          tokens=tokens, response_tokens=tokens // 2, manifest_digest=f"m-{name}")


def _state(*entries: DatasetLineage, policy: DataPolicy | None = None) -> TrainerState:
    from dataclasses import asdict

    return TrainerState(step=5, lineage=entries, data_policy=asdict(policy or DataPolicy()))


# Tokens and documents in different ratios: a share over documents is 0.5 / 0.25 / 0.25, over
# tokens 0.1 / 0.3 / 0.6.
STATE = _state(_entry("a", _record(id="a", license="CC-BY-4.0", retrieved="2026-01-02"), 20, 100),
               _entry("b", _record(id="b", license="MIT", retrieved="2026-03-04"), 10, 300),
               _entry("c", {"status": "unknown"}, 10, 600))


def test_shares_are_tokens_over_the_total_and_sum_to_one():
    summary = training_data_summary(STATE, model_name="m")
    rows = summary["sources"]["public_datasets"] + summary["sources"]["other_undeclared"]
    assert {r["dataset"]: r["share"] for r in rows} == {"a": 100 / 1000, "b": 300 / 1000, "c": 600 / 1000}
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert summary["general"]["training_tokens"] == 1000
    assert summary["general"]["undeclared_token_share"] == 0.6


def test_the_card_and_summary_state_undeclared_provenance_and_the_template_fields():
    summary = training_data_summary(STATE, model_name="m", provider="Lab", provider_contact="lab@example.org",
                                    model_version="1.0", placed_on_market="2027-01-01")
    card = model_card(model_name="m", model_info=INFO, summary=summary, license="Apache-2.0")
    assert "**60.0 % of tokens had no declared provenance** (1 dataset(s): c)" in card
    assert "was declared and checked" not in card and "every dataset's provenance was declared" not in card
    markdown = summary_markdown(summary)
    for said in ("Provider: Lab (contact: lab@example.org)", "version 1.0", "placed on the market: 2027-01-01",
                 "60.0 % of tokens had no declared provenance", "Latest data collection (the latest retrieval "
                 "date declared): 2026-03-04", "content types: c", "Data policy checked before training (default)",
                 "Reservations of rights (text-and-data-mining opt-outs): 40.0 % of tokens are openly licensed",
                 "60.0 % had no declared provenance: its opt-out status is unknown",
                 "provenance was not declared for 60.0 % of tokens", "Illegal and unwanted content:"):
        assert said in markdown, said
    assert "relies on the general Art. 4" not in markdown  # not established with undeclared data
    declared = training_data_summary(_state(*STATE.lineage[:2], policy=DataPolicy(allow_unknown=True)),
                                     model_name="m")
    card = model_card(model_name="m", model_info=INFO, summary=declared, license="Apache-2.0")
    assert "every dataset's provenance was declared when it was prepared, and checked against a custom data " \
           "policy" in card
    assert "(custom)" in summary_markdown(declared) and "no dataset relies on the general Art. 4" in \
        summary_markdown(declared)


@pytest.mark.parametrize("spdx, hub", [
    ("Apache-2.0", ("apache-2.0", None)), ("GPL-3.0-only", ("gpl-3.0", None)), ("ODC-By-1.0", ("odc-by", None)),
    ("CC-BY-NC-4.0", ("cc-by-nc-4.0", None)), ("PDDL-1.0", ("pddl", None)),
    ("BSD-4-Clause", ("other", "bsd-4-clause")), ("MIT AND CC-BY-4.0", ("other", "mit-and-cc-by-4.0")),
])
def test_spdx_licences_map_to_hub_ids_or_other_with_a_name_and_link(spdx, hub):
    licence = hf_license(spdx)
    assert (licence.license, licence.license_name) == hub
    assert (licence.license_link is None) == (hub[0] != "other")


def test_a_model_licence_dropping_the_datas_terms_needs_the_risk_accepted():
    summary = training_data_summary(_state(
        _entry("sa", _record(id="sa", license="CC-BY-SA-4.0"), 1, 10),
        _entry("gen", _record(id="gen", license="proprietary-agreement", basis="synthetic", form="synthetic-audited",
                              generator="m", generator_license="CC0-1.0"), 1, 10)), model_name="m")
    assert licence_risk("Apache-2.0", summary) == ["CC-BY-SA-4.0", "proprietary-agreement"]
    assert licence_risk("CC-BY-SA-4.0 AND proprietary-agreement", summary) == []
    assert licence_risk(None, summary) == []  # `license: other`, unspecified: nothing claimed
    with pytest.raises(UserError, match=r"--license Apache-2.0 is more permissive than the training data's "
                                        r"terms \(.*\): it drops CC-BY-SA-4.0, proprietary-agreement"):
        model_card(model_name="m", model_info=INFO, summary=summary, license="Apache-2.0")
    card = model_card(model_name="m", model_info=INFO, summary=summary, license="Apache-2.0",
                      accept_licence_risk=True)
    assert "**Licence risk accepted:** the model is released under Apache-2.0, which does not carry these " \
           "terms of its training data: CC-BY-SA-4.0, proprietary-agreement" in card
    # Attribution licences are honoured by the card's attribution of every source: no risk.
    assert licence_risk("Apache-2.0", training_data_summary(STATE, model_name="m")) == []


def test_an_agreement_source_trained_on_directly_is_not_also_listed_as_only_derived_from():
    agreed = _record(id="partner", license="proprietary-agreement", basis="agreement", form="agreement-supplied")
    derived = {**_record(id="synth", license="proprietary-agreement", basis="synthetic",
                         form="synthetic-audited", generator="m", generator_license="CC0-1.0")}
    derived["derived_from"] = [{"id": "partner", "digest": agreed["digest"], "license": "proprietary-agreement",
                                "basis": "agreement", "source": "s"}]
    from mimir_megatron.data.provenance import record_digest

    derived["digest"] = record_digest(derived)
    private = training_data_summary(_state(_entry("synth", derived, 1, 10)), model_name="m")["sources"][
        "licensed_private_datasets"]
    assert [d["id"] for d in private["used_only_to_derive_synthetic_data"]] == ["partner"]
    both = training_data_summary(_state(_entry("synth", derived, 1, 10), _entry("partner", agreed, 1, 10)),
                                 model_name="m")["sources"]["licensed_private_datasets"]
    assert [r["dataset"] for r in both["trained_on_directly"]] == ["partner"]
    assert both["used_only_to_derive_synthetic_data"] == []


def test_a_contamination_report_must_have_checked_this_checkpoints_training_data():
    from mimir_megatron.evaluation.contamination import CheckedDataset, ContaminationReport

    def report(*datasets):
        return ContaminationReport(benchmarks={}, datasets=tuple(CheckedDataset(*d) for d in datasets))

    matching = report(*((e.name, None, e.manifest_digest) for e in STATE.lineage))
    assert report_mismatch(matching, STATE) is None
    other = report(("a", None, "m-a"), ("x", None, "m-x"))
    assert report_mismatch(other, STATE).startswith("built on other data than this checkpoint was trained on: "
                                                    "its index does not hold b, c as trained")
    unrecorded = ContaminationReport(benchmarks={})
    assert "does not record which prepared datasets it checked" in report_mismatch(unrecorded, STATE)
