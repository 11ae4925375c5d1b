"""The data rule across the whole data graph (issue 51): each route by which ordinary, legal-looking
flags got data the default policy forbids into a model with a clean card, and its refusal.

- licences compose as a conjunction down the lineage: an OR may narrow an ancestor's terms, never
  reopen them; a generator's terms bind its output and must be declared;
- a model continued from other weights (or resumed under another configuration) is judged with
  the data those were trained on; weights without a recorded lineage are refused by default;
- direct identifiers found and kept (``--personal-data report``) are refused by default;
- a file's own declaration (its sidecar) is its record; synthetic data names its sources; a
  derivation that copies its agreement parent is no derivation;
- a parent changed since its child was derived refuses the child; a lineage may not loop;
- digests that cannot be dropped: signed manifests verify their shards whatever data.verify says,
  the digest cache sees an in-place edit whose mtime was put back;
- a licence with an exception (``WITH``) is judged everywhere, never a traceback;
- the release documents say what the lineage records.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from provenance_data import OPEN, TOK, cli_error, declared, mixture, prepare, problems, write_raw

from mimir_megatron.checkpoint import BaseModel, DatasetLineage, TrainerState, read_trainer_state
from mimir_megatron.checkpoint.trainer_state import write_trainer_state
from mimir_megatron.cli import main
from mimir_megatron.data.policy import DataPolicy, policy_problems
from mimir_megatron.data.provenance import read_provenance, record_digest

SYNTH = ["--basis", "synthetic", "--form", "synthetic-audited"]
NC_ALLOWED = DataPolicy(allow_licenses=["open", "CC-BY-NC-4.0"])
LLAMA = "LicenseRef-scancode-llama-2-license-2023"


def _prepare_refused(tmp_path: Path, caplog, name: str, *flags: str, raw: Path | None = None) -> str:
    """`mimir prepare` of a new file (or ``raw``) into ``tmp_path/name``, refused: its one line
    (and no manifest written: none there, or the one there before)."""
    raw = raw or write_raw(tmp_path / f"{name}.jsonl", say=f"Tell ({name})")
    manifest = tmp_path / name / "manifest.json"
    before = manifest.read_bytes() if manifest.exists() else None
    error = cli_error(caplog, "prepare", "-i", str(raw), "-t", TOK, "-o", str(tmp_path / name), "--seq-len",
                      "64", "--workers", "1", "--no-progress", *flags)
    assert (manifest.read_bytes() if manifest.exists() else None) == before
    return error


def _forge(manifest_path: Path, change) -> None:
    """A hand edit of a manifest's provenance with both digests recomputed, as a forger would."""
    from mimir_megatron.data.manifest import write_manifest

    manifest = json.loads(manifest_path.read_text())
    change(manifest["provenance"])
    manifest["provenance"]["digest"] = record_digest(manifest["provenance"])
    write_manifest(manifest_path.parent, manifest)


# -- 1. licences as a conjunction down the lineage ----------------------------------------------


def test_an_or_may_narrow_an_ancestors_terms_never_reopen_them(tmp_path, caplog):
    """A child of NC data declared `CC-BY-4.0 OR CC-BY-NC-4.0` offers a way out of NC: refused at
    prepare naming both; a record forged that way is refused when read. An OR inside the terms kept
    (narrowing) is fine, and inherits."""
    nc = prepare(tmp_path, "nc", "--source", "NC set", "--license", "CC-BY-NC-4.0", "--basis", "open-licence",
                 "--form", "reformatted")
    derived = ["--source", "made from NC", *SYNTH, "--derived-from", str(nc)]
    error = _prepare_refused(tmp_path, caplog, "laundered", *derived, "--license", "CC-BY-4.0 OR CC-BY-NC-4.0")
    assert "--license: CC-BY-4.0 OR CC-BY-NC-4.0 is more permissive than nc's terms CC-BY-NC-4.0 (drops " \
           "CC-BY-NC-4.0)" in error, error
    narrowed = prepare(tmp_path, "narrowed", *derived, "--license", "CC-BY-NC-4.0 AND (MIT OR Apache-2.0)")
    assert read_provenance(narrowed).provenance.license == "CC-BY-NC-4.0 AND (MIT OR Apache-2.0)"
    assert "CC-BY-NC-4.0 is not an open licence" in problems(mixture(tmp_path, "narrowed"))[0]
    # The record as today's main wrote it for the laundered child: refused when read, not trained.
    _forge(narrowed / "manifest.json", lambda p: p.update(license="CC-BY-4.0 OR CC-BY-NC-4.0"))
    found = problems(mixture(tmp_path, "narrowed"))
    assert len(found) == 1 and "provenance.license: CC-BY-4.0 OR CC-BY-NC-4.0 is more permissive than nc's" \
        in found[0], found


def test_a_generators_terms_bind_its_output_and_must_be_declared(tmp_path, caplog):
    """The same OR against a restrictive generator licence is refused; synthetic data made by a
    generator without a declared licence is refused at prepare, and `unknown` (an explicit answer)
    is refused by the default policy, naming the generator."""
    made = ["--source", "generated", *SYNTH, "--generator", "llama-2-70b"]
    error = _prepare_refused(tmp_path, caplog, "or-generator", *made, "--generator-license", LLAMA,
                             "--license", f"CC-BY-4.0 OR {LLAMA}")
    assert f"is more permissive than generator llama-2-70b's terms {LLAMA} (drops {LLAMA})" in error, error
    error = _prepare_refused(tmp_path, caplog, "no-licence", *made, "--license", "CC-BY-4.0")
    assert "--generator-license: required for data a generator made" in error, error
    prepare(tmp_path, "unknown", *made, "--generator-license", "unknown")
    found = problems(mixture(tmp_path, "unknown"))
    assert found == ["dataset unknown: license unknown (the generator 'llama-2-70b' has no declared licence "
                     "(generator_license)): declare it, or set data_policy.allow_unknown"], found
    kept = prepare(tmp_path, "kept", *made, "--generator-license", LLAMA)
    assert read_provenance(kept).provenance.license == LLAMA  # inherited: the generator's terms
    assert "not a standard licence" in problems(mixture(tmp_path, "kept"))[0]
    # `mimir synth run`'s sidecar: the generator endpoint's licence, else unknown.
    from mimir_megatron.data.provenance import derived_provenance, effective_terms

    source = write_raw(tmp_path / "source.jsonl")
    assert main(["data", "declare", str(source), *OPEN]) == 0
    unset = derived_provenance([source], id="s", source="synth", form="synthetic-audited", basis="synthetic",
                               generator="generator m")
    assert (unset.generator_license, effective_terms(unset)) == ("unknown", "unknown")
    declared_ = derived_provenance([source], id="s", source="synth", form="synthetic-audited", basis="synthetic",
                                   generator="generator m", generator_license="Apache-2.0")
    assert effective_terms(declared_) == "CC-BY-4.0 AND Apache-2.0"


# -- 2. a model's lineage includes its base -----------------------------------------------------


def _entry(name: str, record: dict, tokens: int, personal_data: dict | None = None) -> DatasetLineage:
    return DatasetLineage(name=name, path=f"/nowhere/{name}", category="c", language="en", audit_group="C",
                          provenance=record, provenance_digest=record.get("digest"), documents=tokens // 10,
                          tokens=tokens, response_tokens=tokens // 2, manifest_digest=f"m-{name}",
                          personal_data=personal_data)


def _checkpoint(path: Path, *lineage: DatasetLineage, base: BaseModel | None = None,
                policy: DataPolicy = DataPolicy()) -> Path:
    path.mkdir(parents=True)
    write_trainer_state(path, TrainerState(step=3, lineage=lineage, base_model=base, data_policy=asdict(policy)))
    return path


def test_continued_training_is_judged_with_the_data_of_its_base(tmp_path):
    """v1 trained on NC data under a custom policy; continued (init_from) or resumed under the
    default policy, its data is judged again: refused, naming the base and the dataset. Imported
    weights record no lineage: refused unless the policy allows them. Export judges the union, and
    the summary and card count the base's data."""
    from mimir_megatron.interop import CONFIG_FILE
    from mimir_megatron.release.card import model_card
    from mimir_megatron.release.summary import lineage_problems, summary_markdown, training_data_summary
    from mimir_megatron.train.lineage import earlier_training_problems

    nc = _entry("nc", declared(id="nc", license="CC-BY-NC-4.0"), 500)
    v1 = _checkpoint(tmp_path / "v1" / "checkpoints" / "step_0000003", nc, policy=NC_ALLOWED).resolve()
    refused = earlier_training_problems(None, str(v1), DataPolicy())
    assert refused == [f"base model {v1} (step 3): dataset nc: license CC-BY-NC-4.0: CC-BY-NC-4.0 is not an "
                       "open licence (ScanCode category Source-available): list it in data_policy.allow_licenses "
                       "to train on it"], refused
    assert earlier_training_problems(None, str(v1.parent.parent), NC_ALLOWED) == []  # the run directory form
    assert "checkpoint" in earlier_training_problems(v1, None, DataPolicy())[0]  # resumed under another policy
    # The continued run as today's main records it (default policy, the base's lineage kept).
    opened = _entry("open", declared(id="open", license="CC-BY-4.0"), 100)
    v15 = _checkpoint(tmp_path / "v15", opened, base=BaseModel(source=str(v1), step=3, lineage=(nc,)))
    assert "base model" in earlier_training_problems(v15, None, DataPolicy())[0]
    state = read_trainer_state(v15)
    assert [line.split(": license")[0] for line in lineage_problems(state, "ckpt")] == \
        [f"ckpt: base model {v1} (step 3): dataset nc"]
    summary = training_data_summary(state, model_name="m")
    assert summary["tables"]["by_license"] == {"CC-BY-NC-4.0": 500, "CC-BY-4.0": 100}
    assert [r["model"] for r in summary["sources"]["public_datasets"]] == ["this run", str(v1)]
    assert f"Continued from the base model {v1} (step 3; 500 tokens from nc, listed below)" in \
        summary_markdown(summary)
    with pytest.raises(Exception, match="drops CC-BY-NC-4.0"):  # the card cannot claim CC-BY-4.0
        model_card(model_name="m", model_info={}, summary=summary, license="CC-BY-4.0")
    # Imported weights: no lineage.
    imported = tmp_path / "imported"
    imported.mkdir()
    (imported / CONFIG_FILE).write_text("{}")
    assert "its training data is not recorded" in earlier_training_problems(None, str(imported), DataPolicy())[0]
    assert earlier_training_problems(None, str(imported), DataPolicy(allow_unknown_base=True)) == []


# -- 3. personal data as a policy term -----------------------------------------------------------


def test_personal_data_found_and_kept_is_refused_by_default(tmp_path):
    """`--personal-data report` keeps what the screen found: the default policy refuses it, naming
    the counts; a policy may allow it, and the card says so. Redacted data trains."""
    from mimir_megatron.data.mixture import load_mixture
    from mimir_megatron.release.card import model_card
    from mimir_megatron.release.summary import training_data_summary
    from mimir_megatron.train.lineage import mixture_lineage

    raw = tmp_path / "mail.jsonl"
    raw.write_text("".join(json.dumps({"prompt": f"Write to anna{i}@example.dk.", "completion": f"Dear {i},"}) + "\n"
                           for i in range(3)))
    prepare(tmp_path, "kept", *OPEN, "--personal-data", "report", raw=raw)
    prepare(tmp_path, "redacted", *OPEN, "--personal-data", "redact", raw=raw)
    assert problems(mixture(tmp_path, "kept")) == [
        "dataset kept: personal data: its screen found 3 direct identifier(s) (3 email) and kept them "
        "(--personal-data report); prepare it again with --personal-data reject or redact, or set "
        "data_policy.allow_personal_data: true"]
    assert problems(mixture(tmp_path, "redacted")) == []
    allowing = mixture(tmp_path, "kept", policy="data_policy: {allow_personal_data: true}\n")
    assert problems(allowing) == []
    lineage = [replace(e, tokens=10, documents=1) for e in mixture_lineage(load_mixture(allowing))]
    assert lineage[0].personal_data["found"] == {"email": 3}
    state = TrainerState(step=1, lineage=tuple(lineage), data_policy=asdict(DataPolicy(allow_personal_data=True)))
    card = model_card(model_name="m", model_info={"layers_l": 1, "layers_h": 1, "schedule": "LH", "hidden": 8,
                                                 "parameters": "1", "training": "t"},
                      summary=training_data_summary(state, model_name="m"))
    assert "direct identifiers found and kept in the training data (kept: 3 email), allowed explicitly by the " \
           "custom data policy (allow_personal_data)" in card


# -- 4. a file's own declaration is its record ---------------------------------------------------


def test_a_files_own_declaration_is_its_record(tmp_path, caplog):
    """Agreement data relabelled on the command line, declared synthetic from nothing, or copied and
    called a derivation of itself: each refused in one line, nothing written. A derivation that
    transforms its agreement parent takes the terms the agreement states for it."""
    partner = write_raw(tmp_path / "partner.jsonl")
    assert main(["data", "declare", str(partner), "--source", "Partner corpus", "--license", "proprietary-agreement",
                 "--basis", "agreement", "--form", "agreement-supplied", "--derived-terms", "CC-BY-4.0"]) == 0
    error = _prepare_refused(tmp_path, caplog, "relabelled", "--source", "x", "--license", "CC-BY-4.0",
                             "--basis", "open-licence", "--form", "reformatted", raw=partner)
    assert f"{partner}: its own record {partner}.provenance.json says basis agreement, declared open-licence; " \
           "licence proprietary-agreement, declared CC-BY-4.0 (drops proprietary-agreement)" in error, error
    error = _prepare_refused(tmp_path, caplog, "from-nothing", "--source", "x", "--license", "CC-BY-4.0", *SYNTH)
    assert "--basis: synthetic data names what it was made from (derived_from) or what generated it" in error
    error = _prepare_refused(tmp_path, caplog, "itself", "--source", "x", *SYNTH, "--derived-from", str(partner),
                             raw=partner)
    assert "says basis agreement, declared synthetic" in error, error
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(partner.read_bytes())  # the same documents without their sidecar
    error = _prepare_refused(tmp_path, caplog, "copied", "--source", "x", *SYNTH, "--derived-from", str(partner),
                             raw=copy)
    assert "derived_from partner: 4 of 4 documents checked (100 %) are verbatim copies of partner's" in error
    derived = prepare(tmp_path, "derived", "--source", "x", *SYNTH, "--derived-from", str(partner))
    assert read_provenance(derived).provenance.license == "CC-BY-4.0"
    assert problems(mixture(tmp_path, "derived")) == []


# -- 5. lineage that goes stale or loops ---------------------------------------------------------


def test_a_parent_changed_since_refuses_its_children_and_a_lineage_may_not_loop(tmp_path, caplog):
    parent = prepare(tmp_path, "parent", *OPEN)
    converted = ["--source", "converted", "--basis", "open-licence", "--form", "curated-reformatted"]
    child = prepare(tmp_path, "child", *converted, "--derived-from", str(parent))
    assert read_provenance(child).provenance.license == "CC-BY-4.0" and problems(mixture(tmp_path, "child")) == []
    # The parent prepared again, now declared NC: its child, derived as CC-BY-4.0, is stale.
    prepare(tmp_path, "parent", "--source", "Open set", "--license", "CC-BY-NC-4.0", "--basis", "open-licence",
            "--form", "reformatted", raw=tmp_path / "parent.jsonl")
    found = problems(mixture(tmp_path, "child"))
    assert len(found) == 1 and found[0].startswith(
        f"dataset child: it was derived from parent ({parent.resolve()}), which changed since (the record "
        "pinned ") and "licence CC-BY-NC-4.0); prepare child again from parent as it is" in found[0], found
    # Derived from itself, and X from Y from X.
    error = _prepare_refused(tmp_path, caplog, "parent", *converted, "--derived-from", str(parent),
                             raw=tmp_path / "parent.jsonl")
    assert "is the dataset being prepared: a dataset cannot be derived from itself" in error, error
    grand = prepare(tmp_path, "grand", *converted, "--derived-from", str(parent))
    error = _prepare_refused(tmp_path, caplog, "parent", *converted, "--derived-from", str(grand),
                             raw=tmp_path / "parent.jsonl")
    assert "grand: its lineage loops (parent -> grand -> parent)" in error, error
    # A loop already on disk (a record forged to name itself) is refused by the gate.
    _forge(grand / "manifest.json", lambda p: p["derived_from"][0].update(path=str(grand.resolve())))
    assert "dataset grand: its lineage loops (grand -> grand): a dataset cannot be derived from itself" in \
        problems(mixture(tmp_path, "grand"))


# -- 6. digests that cannot be dropped ------------------------------------------------------------


def test_signed_manifests_verify_their_shards_whatever_data_verify_says(tmp_path):
    out = prepare(tmp_path, "open", *OPEN)
    key = tmp_path / "key"
    assert main(["data", "keygen", "--output", str(key)]) == 0
    assert main(["data", "sign", "--key", str(key), str(out)]) == 0
    shard = out / "shards" / "00000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    signed = mixture(tmp_path, "open", policy=f"data_policy: {{public_key: {key}.pub}}\n")
    found = problems(signed, verify=False)
    assert len(found) == 1 and f"{shard}: sha256 differs" in found[0], found
    assert problems(mixture(tmp_path, "open"), verify=False) == []  # unsigned: data.verify=false trusts it


def test_the_digest_cache_sees_an_in_place_edit_whose_mtime_was_put_back(tmp_path):
    from mixtures import make_mixture

    mix = make_mixture(tmp_path)
    cache = tmp_path / "index"
    assert problems(mix, digest_cache=cache) == []
    shard = tmp_path / "a" / "shards" / "00000.bin"
    before = shard.stat()
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    with open(shard, "r+b") as f:  # in place: the same inode and size
        f.write(bytes(data))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (shard.stat().st_ino, shard.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    found = problems(mix, digest_cache=cache)
    assert len(found) == 1 and f"{shard}: sha256 differs" in found[0], found


# -- 7. licences with an exception ---------------------------------------------------------------


def test_a_licence_with_an_exception_is_judged_everywhere(tmp_path, caplog, capsys):
    """`GPL-2.0-only WITH Classpath-exception-2.0`: prepared, trained on (copyleft is open), listed
    or denied by its licence's id, reported, inherited and kept by a derived dataset, given a card
    licence: never a traceback."""
    from mimir_megatron.release.card import hf_license

    licence = "GPL-2.0-only WITH Classpath-exception-2.0"
    gpl = prepare(tmp_path, "gpl", "--source", "s", "--license", licence, "--basis", "open-licence",
                  "--form", "reformatted")
    assert problems(mixture(tmp_path, "gpl")) == []
    assert problems(mixture(tmp_path, "gpl", policy="data_policy: {deny_licenses: [GPL-2.0-only]}\n")) == [
        f"dataset gpl: license {licence}: {licence} is in data_policy.deny_licenses"]
    assert policy_problems("gpl", read_provenance(gpl).record, DataPolicy(allow_licenses=[licence]), "C") == []
    assert main(["data", "report", "--mixture", str(mixture(tmp_path, "gpl"))]) == 0
    assert "may be trained on" in capsys.readouterr().out
    converted = ["--source", "c", "--basis", "open-licence", "--form", "curated-reformatted", "--derived-from",
                 str(gpl)]
    assert read_provenance(prepare(tmp_path, "child", *converted)).provenance.license == licence
    error = _prepare_refused(tmp_path, caplog, "relaxed", *converted, "--license", "MIT")
    assert f"MIT is more permissive than gpl's terms {licence} (drops {licence})" in error, error
    card = hf_license(licence)
    assert (card.license, card.license_link) == ("other", "https://spdx.org/licenses/GPL-2.0-only.html")


# -- 8. release documents true --------------------------------------------------------------------


def test_the_release_documents_say_what_the_lineage_records(tmp_path):
    """Agreement-derived data under its own heading, its agreement source listed once though the
    derived dataset shares its name; the TDM organisation named; every dataset of the mixture
    listed (0 tokens where unsampled); the card says how personal data was handled."""
    from mimir_megatron.release.card import model_card
    from mimir_megatron.release.summary import summary_markdown, training_data_summary

    partner = write_raw(tmp_path / "partner.jsonl")
    assert main(["data", "declare", str(partner), "--source", "Partner corpus", "--license", "proprietary-agreement",
                 "--basis", "agreement", "--form", "agreement-supplied", "--derived-terms", "CC-BY-4.0"]) == 0
    derived = prepare(tmp_path, "partner", "--source", "generated from the partner corpus", *SYNTH,
                      "--derived-from", str(partner), raw=write_raw(tmp_path / "generated.jsonl", say="Made"))
    assert read_provenance(derived).provenance.id == "partner"  # named like its source
    tdm = declared(id="news", license="LicenseRef-scancode-proprietary-license", basis="tdm-research",
                   research_organisation="Example University", lawful_access="library subscription")
    screen = {"policy": "reject", "found": {"email": 2}, "documents_rejected": 2}
    state = TrainerState(step=5, data_policy=asdict(DataPolicy()), lineage=(
        _entry("partner", read_provenance(derived).record, 300, screen), _entry("news", tdm, 100, screen),
        _entry("idle", declared(id="idle", license="MIT"), 0)))
    summary = training_data_summary(state, model_name="m")
    markdown = summary_markdown(summary)
    assert [r["dataset"] for r in summary["sources"]["agreement_derived_data"]] == ["partner"]
    assert "### Synthetic data derived from data supplied under agreement" in markdown
    assert "### Other synthetic data\n\nNone." in markdown
    assert "### Data supplied under agreement, used only to derive synthetic data\n\n- partner: Partner corpus " \
           "(proprietary-agreement)" in markdown
    assert "mined under the DSM Directive's Art. 3 research exception by Example University" in markdown
    assert (summary["general"]["datasets"], summary["general"]["datasets_not_sampled"]) == (3, 1)
    assert "| idle | s | MIT | open-licence | reformatted | en | C | 0 | 0.0 % |" in markdown
    card = model_card(model_name="m", model_info={"layers_l": 1, "layers_h": 1, "schedule": "LH", "hidden": 8,
                                                 "parameters": "1", "training": "t"}, summary=summary)
    assert "from 3 datasets (1 not sampled yet)" in card
    assert "Personal data: 2 of 2 dataset(s) trained on were screened for direct identifiers" in card
    assert "none found was kept (rejected or redacted)" in card
