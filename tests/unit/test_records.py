"""Every stored record refuses a hand-damaged file in one line naming the file and what is wrong:
a missing field, a field of the wrong type, a version this mimir does not read, and content edited
after its digest was written; a record written before digests (or formats) were recorded reads as
its record's migration says. The hand edits are tests/helpers/record_damage.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mimir_megatron.errors import UserError
from record_damage import assert_refused, damage, drop, put, reseal


def _manifest(directory: Path) -> Path:
    from mimir_megatron.data.manifest import MANIFEST_NAME, write_manifest

    directory.mkdir(parents=True, exist_ok=True)
    write_manifest(directory, {
        "documents": 3, "tokens": {"prefix": 4, "response": 5, "total": 9},
        "tokenizer": {"sha256": "a" * 64, "path": "tok", "end_of_turn_ids": [2]}, "dtype": "uint16",
        "shards": [{"prefix": "shards/00000", "documents": 3}], "outputs": {"shards/00000.bin": "b" * 64},
        "settings": {"seq_len": 64, "denylist": None}, "provenance": {"status": "unknown"}, "notes": "Grøn",
    })
    return directory / MANIFEST_NAME


def _read_manifest(directory: Path):
    from mimir_megatron.data.manifest import Manifest

    return Manifest.read(directory)


def _sidecar(directory: Path) -> Path:
    from mimir_megatron.data.provenance import Provenance, sidecar_path, write_sidecar

    data = directory / "data.jsonl"
    directory.mkdir(parents=True, exist_ok=True)
    data.write_text("{}\n")
    write_sidecar(data, Provenance(id="d", source="Københavns tal", license="CC-BY-4.0", basis="open-licence",
                                   form="reformatted", languages=("da",)))
    return sidecar_path(data)


def _read_sidecar(directory: Path):
    from mimir_megatron.data.provenance import read_provenance

    return read_provenance(directory / "data.jsonl").provenance


def _report(directory: Path) -> Path:
    from mimir_megatron.evaluation.contamination import (
        BenchmarkCheck,
        CheckedDataset,
        ContaminationReport,
        LongestSpan,
    )

    return ContaminationReport(
        benchmarks={"arith": BenchmarkCheck(items=4, contaminated=1, longest_span=LongestSpan(21, "x", "0"),
                                            data_sha256="c" * 64, contaminated_items=("0",))},
        suite="demo", ngram=13, seed=1, datasets=(CheckedDataset("a", "/a", "d" * 64),)).write(directory)


def _read_report(directory: Path):
    from mimir_megatron.evaluation.contamination import ContaminationReport

    return ContaminationReport.read(directory / "demo.json")


def _state(directory: Path) -> Path:
    from mimir_megatron.checkpoint.trainer_state import STATE_FILE, TrainerState, write_trainer_state

    directory.mkdir(parents=True, exist_ok=True)
    write_trainer_state(directory, TrainerState(step=7, consumed_samples=14, config={"run": {"name": "ø"}}))
    return directory / STATE_FILE


def _read_state(directory: Path):
    from mimir_megatron.checkpoint.trainer_state import read_trainer_state

    return read_trainer_state(directory)


def _results(directory: Path) -> Path:
    from mimir_megatron.evaluation.results import EvalResults, TaskScore

    return EvalResults(suite="demo", model="tiny", schedule=(2, 3), category_averages={"Maths": 0.5},
                       tasks={"arith": TaskScore(score=0.5, n=4, metric="exact_match", category="Maths",
                                                 chance=0.0)}).write(directory)


def _read_results(directory: Path):
    from mimir_megatron.evaluation.results import EvalResults

    return EvalResults.read(directory)


def _sweep(directory: Path) -> Path:
    from mimir_megatron.evaluation.results import SweepResults

    return SweepResults(suite="demo", trained=(2, 3), rows=(
        {"D": 8, "H": 2, "L": 3, "schedule": "LLLH LLLH", "trained": True, "arith": 50.0},)).write(directory)


def _read_sweep(directory: Path):
    from mimir_megatron.evaluation.results import SweepResults

    return SweepResults.read(directory)


def _plan(directory: Path) -> Path:
    from mimir_megatron.train.plan.record import PlanRecord

    layout = {"tp": 1, "dp": 8, "micro_batch": 1, "recompute": "none", "fits": True, "step_time_s": 1.5,
              "tokens_per_s": 1000.0, "days": 2.0, "gpu_hours": 384.0}
    directory.mkdir(parents=True, exist_ok=True)
    return PlanRecord.from_dict({"config": "c.yaml", "gpus": 8, "nodes": 1, "seq_len": 2048,
                                 "global_batch": 64, "steps": 100, "tokens": 13107200, "efficiency": 0.3,
                                 "configured": layout, "layouts": [layout]}).write(directory / "plan.json")


def _read_plan(directory: Path):
    from mimir_megatron.train.plan.record import PlanRecord

    return PlanRecord.read(directory / "plan.json")


def _evidence(directory: Path) -> Path:
    from mimir_data_prep.synth_pipeline.evidence_file import STATE_NAME
    from synth_records import evidence_row

    directory.mkdir(parents=True, exist_ok=True)
    (directory / STATE_NAME).write_bytes(evidence_row("r1", "discarded").line())
    return directory / STATE_NAME


def _read_evidence(directory: Path):
    from mimir_data_prep.synth_pipeline.evidence_file import StateFile

    with StateFile(directory) as state:
        return state.read(state.index["r1"])


def _stamp(directory: Path) -> Path:
    from mimir_data_prep.synth_pipeline.run_records import PipelineStamp

    directory.mkdir(parents=True, exist_ok=True)
    return PipelineStamp("oversæt", "a" * 64).write(directory)


def _read_stamp(directory: Path):
    from mimir_data_prep.synth_pipeline.run_records import PipelineStamp

    return PipelineStamp.read(directory)


def _acceptance(directory: Path) -> Path:
    from mimir_data_prep.synth_pipeline.run_records import AcceptanceReport

    directory.mkdir(parents=True, exist_ok=True)
    return AcceptanceReport(
        pipeline="oversæt", fingerprint="a" * 64, source_rows=3, decided=2, pending=1,
        status={"kept": 0, "accepted": 1, "discarded": 1, "error": 0}, acceptance_rate=0.5,
        discard_reasons={"off_topic": 1}, error_reasons={}, regenerate_reasons={"too_vague": 1},
        check_failures={}, generations_per_row={"1": 1, "2": 1},
        calls={"generator": 3, "auditor": 2, "retries": 0}, models={"generator": "g"}, stopped=None).write(directory)


def _read_acceptance(directory: Path):
    from mimir_data_prep.synth_pipeline.run_records import AcceptanceReport

    return AcceptanceReport.read(directory)


def _pointer(directory: Path) -> Path:
    from mimir_data_prep.synth_pipeline.run_records import MlflowPointer

    directory.mkdir(parents=True, exist_ok=True)
    return MlflowPointer("0123abcd", "sqlite:////tmp/ø/mlflow.db").write(directory)


def _read_pointer(directory: Path):
    from mimir_data_prep.synth_pipeline.run_records import MlflowPointer

    return MlflowPointer.read(directory)


def _signature(directory: Path) -> Path:
    from mimir_megatron.data.signing import ManifestSignature

    directory.mkdir(parents=True, exist_ok=True)
    return ManifestSignature(key_id="0" * 16, digest="a" * 64, signature=b"\x01" * 64).write(directory)


def _read_signature(directory: Path):
    from mimir_megatron.data.signing import ManifestSignature

    return ManifestSignature.read(directory)


# The records: (writer, reader, the digest computed again after a careful hand edit)
RECORDS = {
    "manifest": (_manifest, _read_manifest, reseal()),
    "sidecar": (_sidecar, _read_sidecar, reseal(leave_out=("format",))),  # the provenance record's own digest
    "report": (_report, _read_report, reseal()),
    "results": (_results, _read_results, reseal()),
    "sweep": (_sweep, _read_sweep, reseal()),
    "plan": (_plan, _read_plan, reseal()),
    "state": (_state, _read_state, reseal()),
    "evidence": (_evidence, _read_evidence, reseal()),
    "stamp": (_stamp, _read_stamp, reseal()),
    "acceptance": (_acceptance, _read_acceptance, reseal()),
    "pointer": (_pointer, _read_pointer, reseal()),
    "signature": (_signature, _read_signature, lambda record: None),  # a signature is its own check
}

# (record, change, recompute the digest so that only the check under test speaks, what the line must say)
CASES = {
    "manifest-missing-field": ("manifest", drop("documents"), True, "documents: missing"),
    "manifest-missing-nested": ("manifest", drop("tokenizer", "sha256"), True, "tokenizer.sha256: missing"),
    "manifest-wrong-type": ("manifest", put("3", "documents"), True,
                            "documents: a non-negative integer expected, got '3'"),
    "manifest-wrong-shard": ("manifest", put([{"prefix": 5, "documents": 1}], "shards"), True,
                             "shards[0].prefix: a string expected"),
    "manifest-unknown-version": ("manifest", put("mimir-prepared-v0", "format"), True,
                                 "format 'mimir-prepared-v0' is not one this version of mimir reads"),
    "manifest-edited": ("manifest", put(4, "documents"), False, "edited after mimir prepare wrote it"),
    "manifest-digest-removed": ("manifest", drop("digest"), False, "has no digest"),
    "sidecar-missing-field": ("sidecar", drop("basis"), True, "provenance.basis: required"),
    "sidecar-wrong-type": ("sidecar", put("da", "languages"), True, "provenance.languages: a list of ISO 639 codes"),
    "sidecar-unknown-version": ("sidecar", put("mimir-provenance-v9", "format"), True,
                                "format 'mimir-provenance-v9' is not one this version of mimir reads"),
    "sidecar-edited": ("sidecar", put("CC0-1.0", "license"), False, "provenance record was edited after it was written"),
    "report-missing-field": ("report", drop("benchmarks", "arith", "items"), True,
                             "benchmarks.arith: items, contaminated and longest_span.tokens are required"),
    "report-missing-benchmarks": ("report", drop("benchmarks"), True, "benchmarks: missing"),
    "report-wrong-type": ("report", put("13", "ngram"), True, "ngram: an integer expected"),
    "report-wrong-nested-type": ("report", put("many", "benchmarks", "arith", "contaminated"), True,
                                 "benchmarks.arith.contaminated: an integer expected"),
    "report-unknown-version": ("report", put("mimir-contamination-v0", "format"), True,
                               "format 'mimir-contamination-v0' is not one this version of mimir reads"),
    "report-edited": ("report", put(0, "benchmarks", "arith", "contaminated"), False,
                      "edited after `mimir audit contamination` wrote it (its digest does not match its content)"),
    "results-missing-field": ("results", drop("tasks", "arith", "n"), True, "tasks.arith.n: missing"),
    "results-wrong-type": ("results", put("half", "tasks", "arith", "score"), True,
                           "tasks.arith.score: a number expected"),
    "results-unknown-version": ("results", put("mimir-eval-results-v0", "format"), True,
                                "format 'mimir-eval-results-v0' is not one this version of mimir reads"),
    "results-edited": ("results", put(0.75, "tasks", "arith", "score"), False,
                       "edited after `mimir eval` wrote it (its digest does not match its content)"),
    "sweep-missing-field": ("sweep", drop("rows", 0, "H"), True, "rows[0].H: missing"),
    "sweep-wrong-type": ("sweep", put([2], "trained"), True, "trained: [H, L] expected"),
    "sweep-unknown-version": ("sweep", put("mimir-sweep-results-v9", "format"), True,
                              "format 'mimir-sweep-results-v9' is not one this version of mimir reads"),
    "sweep-edited": ("sweep", put(75.0, "rows", 0, "arith"), False,
                     "edited after `mimir sweep` wrote it (its digest does not match its content)"),
    "plan-missing-field": ("plan", drop("configured", "fits"), True, "configured.fits: missing"),
    "plan-wrong-type": ("plan", put("8", "gpus"), True, "gpus: an integer expected"),
    "plan-unknown-version": ("plan", put("mimir-plan-v0", "format"), True,
                             "format 'mimir-plan-v0' is not one this version of mimir reads"),
    "plan-edited": ("plan", put(16, "gpus"), False, "edited after it was written (its digest does not match its content)"),
    "state-missing-field": ("state", drop("step"), True, "trainer state lacks step"),
    "state-wrong-type": ("state", put("7", "step"), True, "step must be a non-negative integer"),
    "state-edited": ("state", put(8, "step"), False, "damaged trainer state (its content does not match its digest)"),
    # Today's formats always carry their digest: one deleted (with the record edited) is refused;
    # only files of the formats before (below) migrate.
    "report-digest-removed": ("report", drop("digest"), False, "has no digest, though the version that wrote it"),
    "results-digest-removed": ("results", drop("digest"), False, "has no digest, though the version that wrote"),
    "sweep-digest-removed": ("sweep", drop("digest"), False, "has no digest, though the version that wrote it"),
    "plan-digest-removed": ("plan", drop("digest"), False, "has no digest, though the version that wrote it"),
    "state-digest-removed": ("state", drop("digest"), False, "its digest was deleted"),
    # The synthetic pipeline's output directory (an evidence row is named by its line too).
    "evidence-missing-field": ("evidence", drop("input_sha256"), True, "line 1: input_sha256: missing"),
    "evidence-wrong-status": ("evidence", put("done", "status"), True,
                              "line 1: status: one of kept, accepted, discarded, error expected, got 'done'"),
    "evidence-wrong-nested": ("evidence", put("yes", "attempts", 0, "checks", 0, "passed"), True,
                              "line 1: attempts[0].checks[0].passed: true or false expected"),
    "evidence-unknown-version": ("evidence", put("mimir-synth-evidence-v9", "format"), True,
                                 "format 'mimir-synth-evidence-v9' is not one this version of mimir reads"),
    "evidence-edited": ("evidence", put("accepted", "status"), False,
                        "line 1: edited after `mimir synth run` wrote it (its digest does not match"),
    "evidence-digest-removed": ("evidence", drop("digest"), False, "has no digest, though the version"),
    "stamp-missing-field": ("stamp", drop("fingerprint"), True, "fingerprint: missing"),
    "stamp-wrong-type": ("stamp", put(7, "name"), True, "name: a string expected, got 7"),
    "stamp-unknown-version": ("stamp", put("mimir-synth-pipeline-v0", "format"), True,
                              "format 'mimir-synth-pipeline-v0' is not one this version of mimir reads"),
    "stamp-edited": ("stamp", put("b" * 64, "fingerprint"), False, "edited after `mimir synth run` wrote it"),
    "acceptance-missing-field": ("acceptance", drop("status", "error"), True, "status.error: missing"),
    "acceptance-wrong-type": ("acceptance", put("2", "decided"), True, "decided: an integer expected, got '2'"),
    "acceptance-wrong-count": ("acceptance", put(1.5, "calls", "retries"), True,
                               "calls.retries: an integer expected, got 1.5"),
    "acceptance-unknown-version": ("acceptance", put("mimir-synth-report-v0", "format"), True,
                                   "format 'mimir-synth-report-v0' is not one this version of mimir reads"),
    "acceptance-edited": ("acceptance", put(3, "decided"), False, "edited after `mimir synth run` wrote it"),
    "acceptance-digest-removed": ("acceptance", drop("digest"), False, "has no digest, though the version"),
    "pointer-missing-field": ("pointer", drop("run_id"), True, "run_id: missing"),
    "pointer-unknown-version": ("pointer", put("mimir-synth-mlflow-run-v2", "format"), True,
                                "format 'mimir-synth-mlflow-run-v2' is not one this version of mimir reads"),
    "pointer-edited": ("pointer", put("ffff", "run_id"), False, "edited after `mimir synth run` wrote it"),
    "signature-missing-field": ("signature", drop("digest"), False, "digest: missing"),
    "signature-wrong-type": ("signature", put(5, "key_id"), False, "key_id: a string expected, got 5"),
    "signature-not-base64": ("signature", put("not base64!", "signature"), False, "signature: base64 expected"),
    "signature-algorithm": ("signature", put("rsa", "algorithm"), False, "algorithm: 'ed25519' expected, got 'rsa'"),
    "signature-unknown-version": ("signature", put("mimir-manifest-signature-v0", "format"), False,
                                  "format 'mimir-manifest-signature-v0' is not one this version of mimir reads"),
    "signature-without-format": ("signature", drop("format"), False, "format None is not one this version"),
}
# A record that lost its format too still has its digest checked (the migration never skips it).
for _name, (_keys, _value, _says) in {
        "results": (("tasks", "arith", "score"), 0.75, "edited after `mimir eval` wrote it"),
        "sweep": (("rows", 0, "arith"), 75.0, "edited after `mimir sweep` wrote it"),
        "plan": (("gpus",), 16, "edited after it was written"),
        "state": (("step",), 8, "damaged trainer state (its content does not match its digest)")}.items():
    def _change(record, keys=_keys, value=_value):
        record.pop("format", None)
        put(value, *keys)(record)
    CASES[f"{_name}-formatless-edited"] = (_name, _change, False, _says)


@pytest.mark.parametrize("case", CASES)
def test_a_hand_damaged_record_is_refused_in_one_line_naming_the_file(tmp_path, case):
    name, change, redigest, says = CASES[case]
    write, read, resealed = RECORDS[name]
    path = write(tmp_path / "record")
    assert read(tmp_path / "record") is not None  # undamaged: read back
    damage(path, change, *([resealed] if redigest else []))
    assert_refused(lambda: read(tmp_path / "record"), path, says)


# The format of each record before its writer always recorded a digest.
DIGESTLESS_FORMATS = {"report": "mimir-contamination-v1", "results": "mimir-eval-results-v1",
                      "sweep": "mimir-sweep-results-v1", "plan": "mimir-plan-v1"}

# (record, without a format too, a field edited by hand: its keys, its new value, how the record gives it)
BEFORE_DIGESTS = {
    "report": ("report", False, ("benchmarks", "arith", "contaminated"), 0,
               lambda report: report.benchmarks["arith"].contaminated),
    "results": ("results", False, ("tasks", "arith", "score"), 0.75, lambda results: results.tasks["arith"].score),
    "results-formatless": ("results", True, ("tasks", "arith", "score"), 0.75,
                           lambda results: results.tasks["arith"].score),
    "sweep": ("sweep", False, ("rows", 0, "arith"), 75.0, lambda sweep: sweep.rows[0]["arith"]),
    "sweep-formatless": ("sweep", True, ("rows", 0, "arith"), 75.0, lambda sweep: sweep.rows[0]["arith"]),
    "plan": ("plan", False, ("gpus",), 16, lambda plan: plan.gpus),
    "plan-formatless": ("plan", True, ("gpus",), 16, lambda plan: plan.gpus),
}


@pytest.mark.parametrize("case", BEFORE_DIGESTS)
def test_a_record_written_before_digests_reads_as_it_is(tmp_path, case):
    """The contamination report, the eval and sweep results and the plan carry a digest since their
    v2 formats: a file of v1 written before (no digest; results and plans maybe no format either)
    holds today's fields and reads as it is, through the record's migration. There is nothing to
    verify, so a hand edit of such a file is read too (a v1 file that carries a digest is checked)."""
    name, formatless, keys, edited, value = BEFORE_DIGESTS[case]
    write, read, _ = RECORDS[name]
    path = write(tmp_path / "record")
    older = drop("format") if formatless else put(DIGESTLESS_FORMATS[name], "format")
    damage(path, drop("digest"), older, put(edited, *keys))
    assert value(read(tmp_path / "record")) == edited


# A synthetic pipeline's file written before formats were recorded (no format, no digest): a field
# edited by hand, and how the record gives it.
SYNTH_BEFORE_FORMATS = {
    "evidence": (("status",), "error", lambda row: row.status),
    "stamp": (("fingerprint",), "b" * 64, lambda stamp: stamp.fingerprint),
    "acceptance": (("decided",), 3, lambda report: report.decided),
    "pointer": (("run_id",), "ffff", lambda pointer: pointer.run_id),
}


@pytest.mark.parametrize("name", SYNTH_BEFORE_FORMATS)
def test_a_synth_file_written_before_formats_reads_as_it_is(tmp_path, name):
    """evidence.jsonl's rows, pipeline.json, report.json and mlflow_run.json were written without a
    format or digest before they were records: such a file holds today's fields and reads as it is
    (there is nothing to verify); writing it again gives it today's format and a digest."""
    keys, edited, value = SYNTH_BEFORE_FORMATS[name]
    write, read, _ = RECORDS[name]
    path = write(tmp_path / "record")
    damage(path, drop("digest"), drop("format"), put(edited, *keys))
    assert value(read(tmp_path / "record")) == edited


def test_only_a_trainer_state_written_before_digests_reads_without_one(tmp_path):
    """The trainer state's version is the checkpoint layout's, unchanged since digests: a state
    written before them holds no ``files`` and no pinned manifest digests, and reads as it is; a
    state whose digest was deleted but which still shows a newer writer's records is refused (a
    lineage edited under a deleted digest would otherwise export a false card)."""
    path = _state(tmp_path / "old")
    damage(path, drop("digest"), drop("files"), put(9, "step"))
    assert _read_state(tmp_path / "old").step == 9
    entry = {"name": "a", "path": "/a", "category": "c", "language": "en", "audit_group": "C",
             "provenance": {"status": "unknown"}, "provenance_digest": None, "manifest_digest": "m"}
    damage(path, put([entry], "lineage"))
    assert_refused(lambda: _read_state(tmp_path / "old"), path, "its digest was deleted")


def test_a_report_without_a_format_is_refused_naming_it(tmp_path):
    """The contamination report has carried its format from the first version: a report without
    one is not a report `mimir audit contamination` wrote (its rule since then)."""
    path = _report(tmp_path / "record")
    damage(path, drop("digest"), drop("format"))
    assert_refused(lambda: _read_report(tmp_path / "record"), path,
                   "format None is not one this version of mimir reads (it reads 'mimir-contamination-v2')")


def test_records_read_back_what_was_written(tmp_path):
    manifest = _read_manifest(_manifest(tmp_path / "m").parent)
    assert (manifest.documents, manifest.tokens_total, manifest.tokenizer.end_of_turn_ids, manifest.seq_len,
            manifest.shards[0].prefix, manifest.digest_problem) == (3, 9, (2,), 64, "shards/00000", None)
    assert manifest.content["notes"] == "Grøn"  # fields it does not name are kept (and digested)
    _sidecar(tmp_path / "s")
    assert _read_sidecar(tmp_path / "s").source == "Københavns tal"
    report = _read_report(_report(tmp_path / "r").parent)
    assert report.benchmarks["arith"].contaminated_items == ("0",) and report.datasets[0].manifest_digest == "d" * 64
    assert report.metrics() == {"arith/contaminated items": 1, "arith/contaminated fraction": 0.25,
                                "arith/longest span": 21, "arith/documents hit": 0}
    assert _read_state(_state(tmp_path / "t").parent).config == {"run": {"name": "ø"}}
    results = _read_results(_results(tmp_path / "e").parent)
    assert (results.schedule, results.tasks["arith"].score, results.category_averages) == ((2, 3), 0.5,
                                                                                            {"Maths": 0.5})
    assert _read_sweep(_sweep(tmp_path / "w").parent).trained == (2, 3)
    plan = _read_plan(_plan(tmp_path / "p").parent)
    assert (plan.gpus, plan.configured.fits, plan.layouts[0].dp) == (8, True, 8)
    # What the writers hand to tools carries the digest, and reads back: the plan file, MLflow's
    # plan.json (PlanRecord.json), the eval's and the sweep's files written again from a read.
    from mimir_megatron.integrity import digest_matches
    from mimir_megatron.train.plan.record import PlanRecord

    assert plan.to_dict() == json.loads((tmp_path / "p" / "plan.json").read_text())
    assert digest_matches(json.loads(plan.json())) and PlanRecord.from_dict(json.loads(plan.json())) == plan
    again = results.write(tmp_path / "e2")
    assert again.read_text() == (tmp_path / "e" / "results.json").read_text()
    sweep = _read_sweep(tmp_path / "w")
    assert sweep.write(tmp_path / "w2").read_text() == (tmp_path / "w" / "table5.json").read_text()
    assert report.write(tmp_path / "r2").read_text() == (tmp_path / "r" / "demo.json").read_text()


def test_digests_written_before_the_canonical_encoding_still_verify(tmp_path):
    """A trainer state written by an earlier version (ASCII-escaped JSON, its digest over that) and
    a provenance sidecar written before sidecars carried a format: both read as they are."""
    import hashlib

    path = _state(tmp_path / "old")
    record = json.loads(path.read_text())
    body = {k: v for k, v in record.items() if k != "digest"}
    record["digest"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    path.write_text(json.dumps(record, indent=2, sort_keys=True))  # as the old writer did
    assert _read_state(tmp_path / "old").config == {"run": {"name": "ø"}}
    sidecar = _sidecar(tmp_path / "s")
    record = json.loads(sidecar.read_text())
    record.pop("format")
    sidecar.write_text(json.dumps(record))
    assert _read_sidecar(tmp_path / "s").license == "CC-BY-4.0"


def test_the_run_directory_of_a_checkpoint_is_derived_in_one_place(tmp_path):
    """Under ``<run>/checkpoints/`` a checkpoint's run is that folder's parent; elsewhere the
    trainer state's recorded run.dir, else runs/<run.name>, as the trainer derived it."""
    from mimir_megatron.checkpoint.run_directory import RunDirectory
    from mimir_megatron.checkpoint.trainer_state import TrainerState
    from mimir_megatron.train.config import TrainConfig

    state = TrainerState(step=1, config={"run": {"name": "demo", "dir": str(tmp_path / "run")},
                                         "tracking": {"uri": None, "experiment": 5}})
    inside = RunDirectory.of_checkpoint(tmp_path / "r" / "checkpoints" / "step_0000001", state)
    assert inside.root == tmp_path / "r" and inside.contamination == tmp_path / "r" / "contamination"
    assert RunDirectory.of_checkpoint(tmp_path / "moved" / "step_0000001", state).root == tmp_path / "run"
    unnamed = TrainerState(step=1, config={"run": {"name": "demo", "dir": None}})
    assert RunDirectory.of_checkpoint(tmp_path / "step_0000001", unnamed).root == Path("runs") / "demo"
    recorded = state.recorded_run()
    assert (recorded.tracking_uri, recorded.experiment) == (None, None)  # unset, and a mistyped entry
    cfg = TrainConfig()
    cfg.run.name = "demo"
    assert cfg.run_dir == Path("runs") / "demo" and cfg.checkpoint_dir == Path("runs") / "demo" / "checkpoints"
    cfg.run.dir = str(tmp_path / "run")
    assert RunDirectory.configured(cfg.run.dir, cfg.run.name).mlflow_uri == f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}"


def test_an_in_training_suite_without_run_dir_keeps_its_logs_in_the_default_run_directory(tmp_path, monkeypatch):
    """run.dir is optional (configs/train/demo.yaml sets none): the in-training suite's InspectAI
    logs go to runs/<run.name>/eval_logs/step_N, the run directory's, where building the folder
    from run.dir itself was a TypeError at the first suite evaluation. The suite is stubbed."""
    from mimir_megatron.train import evaluate, loop
    from mimir_megatron.train.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig()
    cfg.run.name, cfg.run.dir, cfg.eval.suite = "demo", None, "demo"
    asked = []

    def suite_scores(model, config, log_dir):
        asked.append(log_dir)
        log_dir.mkdir(parents=True)
        return {"suite/arith": 0.5}

    class Tracker:
        def __init__(self):
            self.logged = []

        def __getattr__(self, name):
            return lambda *args: self.logged.append((name, *args))

    monkeypatch.setattr(evaluate, "suite_scores", suite_scores)
    tracker = Tracker()
    assert loop._evaluate_suite(None, cfg, tracker, 3) == {"suite/arith": 0.5}
    assert asked == [Path("runs/demo/eval_logs/step_0000003")] == [cfg.run_directory.eval_logs(3)]
    assert ("log_path", asked[0], "eval/step_0000003/inspect_logs") in tracker.logged
    cfg.run.dir = str(tmp_path / "elsewhere")
    loop._evaluate_suite(None, cfg, tracker, 4)
    assert asked[-1] == tmp_path / "elsewhere" / "eval_logs" / "step_0000004"


def test_mimir_prepare_writes_its_manifest_through_the_one_writer(tmp_path, monkeypatch):
    """data_prep builds the manifest's content and hands it to ``write_manifest``, the one place
    its format and digest are set: the file is written by that writer (a second writer in
    data_prep, with its own digest rule or its own write, fails here), its bytes are what the
    writer makes of its content, and it reads back as the record prepare() returns. Danish text in
    the input and the provenance: a digest over ASCII-escaped JSON would differ."""
    from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR
    from mimir_data_prep.prepare import prepare

    from mimir_megatron.data import manifest as manifest_module
    from mimir_megatron.data.provenance import Provenance
    from mimir_megatron.integrity import json_digest

    written, real = [], manifest_module.write_json_atomic
    monkeypatch.setattr(manifest_module, "write_json_atomic",
                        lambda path, value, **kw: written.append(Path(path)) or real(path, value, **kw))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "Tæl til tre på dansk.", "completion": "Én, to, tre."},
                              ensure_ascii=False) + "\n")
    provenance = Provenance(id="da", source="Københavns tal", license="CC-BY-4.0", basis="open-licence",
                            form="reformatted", languages=("da",))
    returned = prepare([src], DEMO_TOKENIZER_DIR, tmp_path / "out", seq_len=64, workers=1, progress=False,
                       provenance=provenance)
    path = tmp_path / "out" / "manifest.json"
    assert written == [path.resolve()]
    assert returned == manifest_module.Manifest.read(tmp_path / "out") and returned.digest_problem is None
    assert (returned.documents, returned.provenance["source"]) == (1, "Københavns tal")
    (tmp_path / "again").mkdir()
    rewritten = manifest_module.write_manifest(tmp_path / "again", returned.content)
    assert (tmp_path / "again" / "manifest.json").read_bytes() == path.read_bytes()
    assert rewritten.digest == returned.digest == json_digest(returned.content)  # the canonical rule


def test_the_manifest_writer_owns_the_format_and_the_digest(tmp_path):
    """Whatever the content says of them, ``write_manifest`` writes today's format first and the
    digest of the content last; what the reader would refuse it refuses, writing nothing."""
    from mimir_megatron.data.manifest import FORMAT, MANIFEST_NAME, write_manifest

    content = dict(_read_manifest(_manifest(tmp_path / "m").parent).content)
    (tmp_path / "n").mkdir()
    record = write_manifest(tmp_path / "n", {**content, "digest": "0" * 64})
    stored = json.loads((tmp_path / "n" / MANIFEST_NAME).read_text())
    assert (list(stored)[0], list(stored)[-1], stored["digest"]) == ("format", "digest", content["digest"])
    assert record.content == stored and stored["format"] == FORMAT
    for bad, says in (({"format": "mimir-prepared-v0"}, "format 'mimir-prepared-v0'"),
                      ({"documents": -1}, "documents: a non-negative integer expected")):
        (tmp_path / "bad").mkdir(exist_ok=True)
        with pytest.raises(UserError, match=says):
            write_manifest(tmp_path / "bad", {**content, **bad})
        assert not (tmp_path / "bad" / MANIFEST_NAME).exists()
