"""Provenance declarations, licence expressions, the data policy and the checks `mimir train` runs
before step 1 (mimir_megatron.data.provenance and .policy), on tiny prepared datasets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mimir_megatron.cli import main
from mimir_megatron.data.policy import DataPolicy, policy_problems
from mimir_megatron.data.provenance import (
    ProvenanceDeclaration,
    combine_licenses,
    license_allowed,
    read_provenance,
    resolve_declaration,
    stored_record,
)
from mimir_megatron.errors import UserError
from provenance_data import OPEN, TOK
from provenance_data import cli_error as _cli_error
from provenance_data import mixture as _mixture
from provenance_data import prepare as _prepare
from provenance_data import problems as _problems
from provenance_data import write_raw as _raw

def test_every_mistake_of_a_declaration_is_one_line_naming_its_field(tmp_path):
    decl = ProvenanceDeclaration(source="", license="CC-BY-9.9", basis="licensed", form="scraped",
                                 languages=["English"], retrieved="2026-13-01", location="not a place",
                                 derived_from=["missing-dataset"])
    errors: list[str] = []
    assert resolve_declaration(decl, "ds", default_id="ds", base=tmp_path, errors=errors) is None
    fields = sorted(e.split(":")[0] for e in errors)
    assert fields == ["ds.basis", "ds.derived_from[0]", "ds.form", "ds.languages[0]", "ds.license",
                      "ds.location", "ds.retrieved", "ds.source"], errors
    assert any("'CC-BY-9.9'" in e and "SPDX" in e for e in errors)


def test_prepare_records_the_declaration_and_the_inputs_sha256(tmp_path):
    import hashlib

    out = _prepare(tmp_path, "open", *OPEN, "--source-location", "org/open-set", "--retrieved", "2026-10-01")
    manifest = json.loads((out / "manifest.json").read_text())
    record = manifest["provenance"]
    assert (record["id"], record["license"], record["basis"], record["location"]) == \
        ("open", "CC-BY-4.0", "open-licence", "org/open-set")
    source = manifest["sources"][0]
    assert source["sha256"] == hashlib.sha256(Path(source["path"]).read_bytes()).hexdigest()
    assert _problems(_mixture(tmp_path, "open")) == []


def test_undeclared_data_is_unknown_and_refused_unless_allowed(tmp_path):
    out = _prepare(tmp_path, "plain")
    assert read_provenance(out).provenance is None and read_provenance(out).record == {"status": "unknown"}
    problems = _problems(_mixture(tmp_path, "plain"))
    assert len(problems) == 1 and "dataset plain: provenance unknown" in problems[0]
    assert _problems(_mixture(tmp_path, "plain", policy="data_policy: {allow_unknown: true}\n")) == []


def test_agreement_data_only_through_a_derived_dataset(tmp_path):
    """The paper's rule: agreement-supplied data is refused, synthetic data derived from it is not;
    a conversion of it (same basis) is still agreement data. Every offender is listed at once."""
    agreed = _raw(tmp_path / "agreed.jsonl")
    assert main(["data", "declare", str(agreed), "--source", "Partner corpus", "--license",
                 "proprietary-agreement", "--basis", "agreement", "--form", "agreement-supplied",
                 "--language", "da"]) == 0
    _prepare(tmp_path, "agreed", raw=agreed)  # provenance from the sidecar
    _prepare(tmp_path, "plain")
    synthetic = _prepare(tmp_path, "synthetic", "--source", "generated from the partner corpus",
                         "--basis", "synthetic", "--form", "synthetic-audited", "--derived-from", str(agreed))
    record = read_provenance(synthetic).provenance
    assert record.license == "proprietary-agreement" and record.languages == ("da",)  # inherited
    assert record.derived_from[0].basis == "agreement"

    problems = _problems(_mixture(tmp_path, "agreed", "plain", "synthetic"))
    assert [p.split(":")[0] for p in problems] == ["dataset agreed", "dataset plain"], problems
    assert "basis agreement is not in data_policy.allow_bases" in problems[0]
    assert _problems(_mixture(tmp_path, "synthetic")) == []


def test_licence_expressions_and_the_policy_licence_rules():
    assert combine_licenses(["CC-BY-4.0", "MIT", "CC-BY-4.0"]) == "CC-BY-4.0 AND MIT"
    assert combine_licenses(["CC-BY-4.0", "unknown"]) == "unknown"
    assert license_allowed("MIT OR GPL-3.0-only", {"MIT"}, set())
    assert not license_allowed("MIT AND GPL-3.0-only", {"MIT"}, set())
    assert not license_allowed("CC-BY-NC-4.0", None, {"CC-BY-NC-4.0"})
    record = stored_record(resolve_declaration(
        ProvenanceDeclaration(source="s", license="CC-BY-NC-4.0", basis="open-licence", form="reformatted"),
        "x", default_id="x", base=Path("."), errors=[]))
    policy = DataPolicy(deny_licenses=["CC-BY-NC-4.0"], allow_groups=["A"])
    problems = policy_problems("x", record, policy, audit_group="C")
    assert len(problems) == 2 and "license CC-BY-NC-4.0" in problems[0] and "audit group C" in problems[1]


def test_a_policy_naming_an_unknown_basis_or_licence_is_refused(tmp_path):
    from mimir_megatron.data.mixture import load_mixture

    _prepare(tmp_path, "open", *OPEN)
    bad = "data_policy: {allow_bases: [open-licence, scraped], deny_licenses: [NOT-A-LICENCE], allow: 1}\n"
    with pytest.raises(UserError) as caught:
        load_mixture(_mixture(tmp_path, "open", policy=bad))
    lines = str(caught.value).splitlines()[1:]
    assert len(lines) == 3, lines
    assert any("allow_bases: unknown basis 'scraped'" in line for line in lines)
    assert any("deny_licenses[0]" in line for line in lines)
    assert any("data_policy.allow is not a setting" in line for line in lines)


def test_an_edited_manifest_and_a_changed_input_are_reported(tmp_path):
    out = _prepare(tmp_path, "open", *OPEN)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["provenance"]["license"] = "CC0-1.0"  # a hand edit of the record
    manifest_path.write_text(json.dumps(manifest))
    source = Path(manifest["sources"][0]["path"])
    source.write_text(source.read_text().replace(" 0.", " 9."))  # same size, other bytes
    os.utime(source, ns=(0, 0))
    problems = _problems(_mixture(tmp_path, "open"))
    assert len(problems) == 3, problems
    assert "edited after mimir prepare wrote it" in problems[0]
    assert "provenance record was edited" in problems[1]
    assert f"input {source} changed since it was prepared" in problems[2]


def test_a_derived_from_naming_nothing_is_refused_before_anything_is_written(tmp_path):
    raw = _raw(tmp_path / "x.jsonl")
    assert main(["prepare", "-i", str(raw), "-t", TOK, "-o", str(tmp_path / "out"), "--source", "s",
                 "--basis", "synthetic", "--form", "synthetic-audited", "--derived-from", "nowhere"]) == 2
    assert not (tmp_path / "out").exists()


def _declare(errors: list[str] | None = None, parents: dict[str, Path] | None = None, **fields):
    """The stored record of a declaration (None with ``errors`` filled when it is refused)."""
    errors = [] if errors is None else errors
    values = {"source": "s", "basis": "open-licence", "form": "reformatted", **fields}
    found = resolve_declaration(ProvenanceDeclaration(**values), "ds", default_id="ds", base=Path("."),
                                siblings=parents, errors=errors)
    return None if found is None else stored_record(found)


@pytest.mark.parametrize("licence", ["CC-BY-4.0", "CC-BY-SA-4.0", "CC0-1.0", "ODC-By-1.0", "ODbL-1.0", "PDDL-1.0",
                                     "MIT", "Apache-2.0", "BSD-3-Clause", "MIT OR CC-BY-NC-4.0"])
def test_the_default_policy_trains_on_open_licences(licence):
    assert policy_problems("x", _declare(license=licence), DataPolicy(), "C") == []


@pytest.mark.parametrize("licence, why", [
    ("CC-BY-NC-4.0", "not an open licence (ScanCode category Source-available)"),
    ("CC-BY-ND-4.0", "not an open licence (ScanCode category Source-available)"),
    ("MIT AND CC-BY-NC-SA-4.0", "CC-BY-NC-SA-4.0 is not an open licence"),
    ("LicenseRef-scancode-unknown", "not a standard licence"),
    ("LicenseRef-scancode-public-domain", "not a standard licence"),
])
def test_the_default_policy_refuses_nc_nd_unknown_and_licenseref_unless_listed(licence, why):
    record = _declare(license=licence)
    problems = policy_problems("x", record, DataPolicy(), "C")
    assert len(problems) == 1 and problems[0].startswith(f"dataset x: license {licence}:") and why in problems[0]
    listed = DataPolicy(allow_licenses=["open", licence.split(" AND ")[-1]])
    assert policy_problems("x", record, listed, "C") == []


def test_basis_licence_and_form_are_checked_against_each_other():
    def refused(**fields) -> list[str]:
        errors: list[str] = []
        assert _declare(errors, **fields) is None
        return errors

    assert refused(license="proprietary-agreement") == [
        "ds.basis: open-licence under the agreement licence proprietary-agreement (agreement data is basis "
        "agreement; data derived from it basis synthetic)"]
    assert refused(license="MIT", basis="public-domain")[0].startswith("ds.license: basis public-domain needs")
    assert refused(license="MIT", basis="open-licence", form="agreement-supplied")[0].startswith("ds.basis: form")
    tdm = refused(license="LicenseRef-scancode-proprietary-license", basis="tdm-research")
    assert [e.split(":")[0] for e in tdm] == ["ds.research_organisation", "ds.lawful_access"], tdm
    assert refused(license="MIT", derived_terms="MIT")[0].startswith("ds.derived_terms: only an agreement")
    assert refused(license="MIT", lawful_access="x")[0].startswith("ds.research_organisation: only basis")
    # The TDM research exception, recorded with what it needs, is permissible by default whatever
    # the licence; under a policy without it, refused by its basis.
    record = _declare(license="LicenseRef-scancode-proprietary-license", basis="tdm-research",
                      research_organisation="Example University", lawful_access="library subscription")
    assert record["research_organisation"] == "Example University"
    assert policy_problems("x", record, DataPolicy(), "C") == []
    assert "basis tdm-research is not in" in policy_problems(
        "x", record, DataPolicy(allow_bases=["open-licence"]), "C")[0]


def test_a_custom_policy_says_so():
    assert DataPolicy().is_default and DataPolicy().describe().startswith("the paper's default")
    custom = DataPolicy(allow_licenses=["open", "CC-BY-NC-4.0"])
    assert not custom.is_default and "CC-BY-NC-4.0" in custom.describe()


def test_a_derived_dataset_cannot_relax_its_ancestors_licence(tmp_path, caplog):
    """The smuggling route: NC data re-declared CC-BY-4.0 downstream is refused naming both
    licences, at every generation; left to inherit, it carries NC and the default refuses it."""
    nc = _prepare(tmp_path, "nc", "--source", "NC set", "--license", "CC-BY-NC-4.0", "--basis", "open-licence",
                  "--form", "reformatted")
    relax = ["prepare", "-i", str(_raw(tmp_path / "d.jsonl")), "-t", TOK, "-o", str(tmp_path / "relaxed"),
             "--source", "made from NC", "--basis", "synthetic", "--form", "synthetic-audited",
             "--derived-from", str(nc)]
    error = _cli_error(caplog, *relax, "--license", "CC-BY-4.0")
    assert "--license: CC-BY-4.0 is more permissive than nc's terms CC-BY-NC-4.0" in error, error
    assert not (tmp_path / "relaxed").exists()
    child = _prepare(tmp_path, "child", "--source", "made from NC", "--basis", "synthetic",
                     "--form", "synthetic-audited", "--derived-from", str(nc))
    assert read_provenance(child).provenance.license == "CC-BY-NC-4.0"  # inherited
    grandchild = [*relax[:6], str(tmp_path / "grandchild"), *relax[7:-1], str(child), "--license", "MIT"]
    assert "MIT is more permissive than child's terms CC-BY-NC-4.0" in _cli_error(caplog, *grandchild)
    problems = _problems(_mixture(tmp_path, "child", policy="data_policy: {deny_licenses: [CC-BY-NC-4.0]}\n"))
    assert problems == ["dataset child: license CC-BY-NC-4.0: CC-BY-NC-4.0 is in data_policy.deny_licenses"]
    assert "CC-BY-NC-4.0 is not an open licence" in _problems(_mixture(tmp_path, "child"))[0]
    # A stricter licence is fine: the parent's terms kept, more added.
    _prepare(tmp_path, "stricter", "--source", "s", "--basis", "synthetic", "--form", "synthetic-audited",
             "--derived-from", str(nc), "--license", "CC-BY-NC-4.0 AND CC-BY-SA-4.0")
    # The generator model's terms bind its output too.
    error = _cli_error(caplog, *relax[:6], str(tmp_path / "gen"), "--source", "s", "--basis", "synthetic",
                       "--form", "synthetic-audited", "--license", "MIT", "--generator", "some-model",
                       "--generator-license", "CC-BY-NC-4.0")
    assert "MIT is more permissive than generator some-model's terms CC-BY-NC-4.0" in error


def test_agreement_data_passes_on_the_terms_its_agreement_states(tmp_path, caplog):
    """The paper's route stays open: an agreement that lets derived data be used under stated
    terms records them; synthetic data made from it takes (or declares) those terms. Without
    stated terms a derivative cannot claim an open licence, nor can a re-preparation of the
    agreement data claim basis open-licence."""
    stated = _raw(tmp_path / "stated.jsonl")
    silent = _raw(tmp_path / "silent.jsonl")
    agreement = ["--source", "Partner corpus", "--license", "proprietary-agreement", "--basis", "agreement",
                 "--form", "agreement-supplied"]
    assert main(["data", "declare", str(stated), *agreement, "--derived-terms", "CC-BY-4.0"]) == 0
    assert main(["data", "declare", str(silent), *agreement]) == 0
    synth = ["--source", "generated", "--basis", "synthetic", "--form", "synthetic-audited"]
    inherited = _prepare(tmp_path, "inherited", *synth, "--derived-from", str(stated))
    declared = _prepare(tmp_path, "declared", *synth, "--derived-from", str(stated), "--license", "CC-BY-4.0")
    assert read_provenance(inherited).provenance.license == read_provenance(declared).provenance.license == "CC-BY-4.0"
    assert read_provenance(declared).provenance.derived_from[0].derived_terms == "CC-BY-4.0"
    assert _problems(_mixture(tmp_path, "inherited", "declared")) == []
    base = ["prepare", "-i", str(_raw(tmp_path / "x.jsonl")), "-t", TOK, "-o", str(tmp_path / "refused")]
    error = _cli_error(caplog, *base, *synth, "--derived-from", str(silent), "--license", "CC-BY-4.0")
    assert "CC-BY-4.0 is more permissive than silent's terms proprietary-agreement" in error
    error = _cli_error(caplog, *base, "--source", "re-prepared", "--basis", "open-licence", "--form",
                       "reformatted", "--derived-from", str(silent))
    assert "--basis: open-licence under the agreement licence proprietary-agreement" in error
    error = _cli_error(caplog, *base, "--source", "x", "--basis", "open-licence", "--form", "reformatted",
                       "--license", "MIT", "--derived-terms", "MIT")
    assert "--derived-terms: only an agreement source states terms" in error
    assert not (tmp_path / "refused").exists()


def _rewrite(manifest_path: Path, change) -> None:
    """A hand edit that recomputes both digests, as a careful forger would."""
    from mimir_megatron.data.manifest import write_manifest
    from mimir_megatron.data.provenance import record_digest

    manifest = json.loads(manifest_path.read_text())
    change(manifest)
    if "digest" in manifest["provenance"]:
        manifest["provenance"]["digest"] = record_digest(manifest["provenance"])
    if "digest" in manifest:
        write_manifest(manifest_path.parent, manifest)  # the manifest's digest, by its one writer
    else:
        manifest_path.write_text(json.dumps(manifest))  # its digest deleted by hand


@pytest.mark.parametrize("change, field", [
    (lambda m: m["provenance"].pop("basis"), "provenance.basis: required"),
    (lambda m: m["provenance"].update(license="CC-BY-4"), "provenance.license: unknown licence id(s) 'CC-BY-4'"),
    (lambda m: m["provenance"].update(source=""), "provenance.source: required"),
    (lambda m: m["provenance"].update(languages="en"), "provenance.languages: a list of ISO 639 codes"),
    (lambda m: m["provenance"].update(license="proprietary-agreement"), "provenance.basis: open-licence under"),
    (lambda m: m["provenance"].update(derived_from=[{"id": "x"}]), "provenance.derived_from[0]: not a parent"),
    (lambda m: m["provenance"].pop("digest"), "provenance record has no digest"),
    (lambda m: m.pop("digest"), "manifest.json: has no digest"),
])
def test_a_stored_record_is_validated_whenever_it_is_read(tmp_path, caplog, change, field):
    """Records edited by hand with consistent digests: one line naming the dataset, the file and
    the field from the policy check, `mimir data report` and a prepare deriving from it; never a
    traceback, nothing written."""
    out = _prepare(tmp_path, "open", *OPEN)
    _rewrite(out / "manifest.json", change)
    problems = _problems(_mixture(tmp_path, "open"))
    assert len(problems) == 1 and problems[0].startswith("dataset open: ") and field in problems[0], problems
    assert str(out / "manifest.json") in problems[0]
    if "no digest" in field:
        return  # the record itself is well-formed: reports may read it
    assert field in _cli_error(caplog, "data", "report", "--mixture", str(_mixture(tmp_path, "open")))
    error = _cli_error(caplog, "prepare", "-i", str(_raw(tmp_path / "d.jsonl")), "-t", TOK, "-o",
                       str(tmp_path / "child"), "--source", "s", "--basis", "synthetic", "--form",
                       "derived-task", "--derived-from", str(out))
    assert "--derived-from" in error and str(out / "manifest.json") in error and field in error, error
    assert not (tmp_path / "child").exists()


@pytest.mark.parametrize("licence, why", [
    ("MIT AND", "'MIT AND' is not a licence expression"),
    ("CC-BY-4", "unknown licence id(s) 'CC-BY-4'"),
    (" ", "empty"),
])
def test_a_malformed_licence_flag_is_one_line(tmp_path, caplog, licence, why):
    error = _cli_error(caplog, "prepare", "-i", str(_raw(tmp_path / "d.jsonl")), "-t", TOK, "-o",
                       str(tmp_path / "out"), "--source", "s", "--basis", "open-licence", "--form",
                       "reformatted", "--license", licence)
    assert f"--license: {why}" in error, error
    assert not (tmp_path / "out").exists()


def test_a_damaged_sidecar_is_refused_before_anything_is_written(tmp_path, caplog):
    raw = _raw(tmp_path / "d.jsonl")
    assert main(["data", "declare", str(raw), *OPEN]) == 0
    sidecar = Path(str(raw) + ".provenance.json")
    record = json.loads(sidecar.read_text())
    from mimir_megatron.data.provenance import record_digest

    record["license"] = "CC-BY-NC-4"
    record["digest"] = record_digest({k: v for k, v in record.items() if k != "format"})  # the record's own
    sidecar.write_text(json.dumps(record))
    error = _cli_error(caplog, "prepare", "-i", str(raw), "-t", TOK, "-o", str(tmp_path / "out"))
    assert f"{sidecar}: provenance.license: unknown licence id(s) 'CC-BY-NC-4'" in error, error
    sidecar.write_text("[1, 2]")
    assert "not a provenance record" in _cli_error(caplog, "prepare", "-i", str(raw), "-t", TOK, "-o",
                                                    str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_the_lineage_pins_each_manifest_and_export_names_one_changed_since(tmp_path):
    """A licence changed after training with both digests recomputed passes every check of the
    dataset itself; the checkpoint's lineage pinned the manifest's digest, and the release
    documents' check names the dataset."""
    from mimir_megatron.checkpoint import TrainerState
    from mimir_megatron.data.mixture import load_mixture
    from mimir_megatron.release.summary import lineage_problems
    from mimir_megatron.train.lineage import mixture_lineage

    out = _prepare(tmp_path, "open", *OPEN)
    _prepare(tmp_path, "other", *OPEN)
    state = TrainerState(step=1, lineage=tuple(mixture_lineage(load_mixture(_mixture(tmp_path, "open", "other")))))
    assert state.lineage[0].manifest_digest == json.loads((out / "manifest.json").read_text())["digest"]
    assert lineage_problems(state, "ckpt") == []
    _rewrite(out / "manifest.json", lambda m: m["provenance"].update(license="CC0-1.0"))
    assert _problems(_mixture(tmp_path, "open")) == []  # consistent: nothing in the dataset tells
    problems = lineage_problems(state, "ckpt")
    assert len(problems) == 1 and problems[0].startswith(
        f"ckpt: dataset open: its manifest {out / 'manifest.json'} changed since this checkpoint was trained"), problems


def test_signed_manifests_when_the_policy_names_a_public_key(tmp_path, caplog):
    """A forger who recomputes both digests cannot recompute the signature: with
    data_policy.public_key set, an unsigned, re-signed-elsewhere or edited manifest is named."""
    out = _prepare(tmp_path, "open", *OPEN)
    key = tmp_path / "key"
    assert main(["data", "keygen", "--output", str(key)]) == 0
    assert oct((key).stat().st_mode & 0o777) == "0o600"
    policy = f"data_policy: {{public_key: {key}.pub}}\n"
    assert "manifest.sig: missing" in _problems(_mixture(tmp_path, "open", policy=policy))[0]
    assert main(["data", "sign", "--key", str(key), str(out)]) == 0
    assert _problems(_mixture(tmp_path, "open", policy=policy)) == []
    _rewrite(out / "manifest.json", lambda m: m["provenance"].update(license="CC0-1.0"))
    problems = _problems(_mixture(tmp_path, "open", policy=policy))
    assert problems == [f"dataset open: {out / 'manifest.sig'}: signs another manifest" + problems[0].split(
        "signs another manifest")[1]] and "(digest " in problems[0]
    other = tmp_path / "other"
    assert main(["data", "keygen", "--output", str(other)]) == 0
    assert main(["data", "sign", "--key", str(other), str(out)]) == 0  # the forger's own key
    assert "not signed by the key" in _problems(_mixture(tmp_path, "open", policy=policy))[0]
    assert "keygen never overwrites" in _cli_error(caplog, "data", "keygen", "--output", str(key))
    from mimir_megatron.data.mixture import load_mixture

    with pytest.raises(UserError, match=r"data_policy.public_key: .*: not a PEM public key"):
        load_mixture(_mixture(tmp_path, "open", policy=f"data_policy: {{public_key: {out / 'manifest.json'}}}\n"))
