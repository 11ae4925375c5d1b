"""`mimir export` of a training checkpoint in MLflow: a LoggedModel of the training run, holding
the exported files, linked to the run's metrics at the checkpoint's step and to its lineage, the
card and summary in the run as well, and registered with the card as description."""

from __future__ import annotations

import getpass

import json

import pytest
from conftest import REPO, train_overrides

from mimir_megatron.cli import main
from mimir_megatron.train.tracking import metric_name

pytest.importorskip("transformers", reason="mimir export needs the hf extra")


@pytest.fixture(scope="module")
def trained(demo_data, tmp_path_factory):
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.loop import train

    run_dir = tmp_path_factory.mktemp("export") / "run"
    return run_dir, train(load_train_config(REPO / "configs" / "train" / "demo.yaml", train_overrides(
        demo_data, run_dir, "train.steps=2", "checkpoint.interval=2")))


def test_an_audit_of_a_training_checkpoint_is_a_child_run_of_its_training_run(trained, tmp_path):

    from mlflow.tracking import MlflowClient

    from mimir_megatron.audits.outputs import audit_tracking
    from mimir_megatron.checkpoint import ModelDir, ModelKind

    run_dir, result = trained
    where = audit_tracking(tmp_path / "audit", ModelDir(ModelKind.checkpoint, run_dir / "checkpoints" / "step_0000002"))
    assert where.uri == f"sqlite:///{run_dir.resolve() / 'mlflow.db'}" and where.parent_run_id == result.run_id
    figure = tmp_path / "match_lengths.png"
    figure.write_bytes(b"\x89PNG")
    audit_id = where.log("prefix-audit", {"ngram": 13}, {"A/prompts": 6.0}, [figure])
    client = MlflowClient(where.uri)
    audit = client.get_run(audit_id)
    assert audit.data.tags["mlflow.parentRunId"] == result.run_id
    assert audit.info.user_id == client.get_run(result.run_id).info.user_id == getpass.getuser()
    assert audit.info.experiment_id == client.get_run(result.run_id).info.experiment_id
    assert [f.path for f in client.list_artifacts(audit_id)] == ["match_lengths.png"]
    (tmp_path / "weights").mkdir()  # not a training checkpoint: the audit's own store
    elsewhere = audit_tracking(tmp_path / "audit", ModelDir(ModelKind.weights, tmp_path / "weights"))
    assert (elsewhere.experiment, elsewhere.parent_run_id) == ("mimir-audit", None)
    assert elsewhere.uri == f"sqlite:///{(tmp_path / 'audit').resolve() / 'mlflow.db'}"


def test_an_export_is_a_logged_model_of_its_training_run_and_registrable(trained, tmp_path):
    from mlflow.tracking import MlflowClient

    from mimir_megatron.checkpoint import read_trainer_state

    run_dir, result = trained
    out = tmp_path / "demo-hf"
    report = tmp_path / "contamination.json"  # the fields the summary reads, as `mimir audit contamination` writes
    # ... on this run's training data: every dataset it trained on, as its manifest was then.
    state = read_trainer_state(run_dir / "checkpoints" / "step_0000002")
    datasets = [{"name": e.name, "manifest_digest": e.manifest_digest} for e in state.lineage]
    report.write_text(json.dumps({"format": "mimir-contamination-v1", "suite": "demo", "ngram": 13, "benchmarks": {
        "arith": {"items": 40, "contaminated": 2, "longest_span": {"tokens": 21}, "data_sha256": "x"}},
        "datasets": datasets}))
    assert main(["export", "--checkpoint", str(run_dir / "checkpoints" / "step_0000002"), "--output", str(out),
                 "--contamination", str(report), "--register", "demo-model"]) == 0

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(result.run_id)
    outputs = {o.model_id: o.step for o in run.outputs.model_outputs}
    exported = [m for m in (client.get_logged_model(i) for i in outputs) if m.name == "demo-hf"]
    assert len(exported) == 1 and outputs[exported[0].model_id] == 2
    model = exported[0]
    assert (model.source_run_id, str(model.status), model.params["checkpoint_step"]) == (result.run_id, "READY", "2")
    assert model.tags["mimir.checkpoint"] == str((run_dir / "checkpoints" / "step_0000002").resolve())
    assert model.tags["mimir.lineage"] == f"runs:/{result.run_id}/data/lineage.json"
    card = (out / "README.md").read_text()
    assert model.tags["mlflow.note.content"] == card

    files = {f.path for f in client.list_logged_model_artifacts(model.model_id)}
    assert {"README.md", "config.json", "training_data_summary.md"} <= files
    assert any(f.endswith(".safetensors") for f in files)
    in_run = {f.path for f in client.list_artifacts(result.run_id, "export/demo-hf")}
    assert in_run == {f"export/demo-hf/{f}" for f in ("README.md", "training_data_summary.md",
                                                      "training_data_summary.json")}

    assert [f.path for f in client.list_artifacts(result.run_id, "contamination")] == [
        "contamination/contamination.json"]

    loss = metric_name("loss")
    linked = {m.key: m for m in model.metrics}
    assert linked[loss].step == 2 and linked[loss].value == pytest.approx(result.losses[-1])
    assert [m.step for m in client.get_metric_history(result.run_id, loss)] == [1, 2]  # nothing added

    [version] = client.search_model_versions("name = 'demo-model'")
    # MLflow 3.17's sqlite registry links a version to its LoggedModel by its source URI.
    assert (version.source, version.run_id, version.description) == (f"models:/{model.model_id}",
                                                                     result.run_id, card)
    assert client.get_registered_model("demo-model").description == card


def test_an_export_is_a_function_of_typed_arguments(trained, tmp_path):
    """`mimir export`'s workflow without the CLI, from a loaded model and its training record:
    the files the command writes; --register without a training record is refused."""
    from mimir_megatron.checkpoint import detect_model_dir
    from mimir_megatron.errors import UserError
    from mimir_megatron.release.export import ReleaseDetails, export_model

    run_dir, _ = trained
    assert main(["export", "--model", str(run_dir), "--output", str(tmp_path / "cli"), "--license", "Apache-2.0",
                 "--provider", "Test Lab", "--no-mlflow"]) == 0
    source = detect_model_dir(run_dir)
    model = source.load()
    out = export_model(model, tmp_path / "lib", ReleaseDetails(name="cli", license="Apache-2.0", provider="Test Lab"),
                       record=source.record, tokenizer=source.tokenizer, mlflow=False)
    for name in ("README.md", "training_data_summary.json", "training_data_summary.md", "config.json",
                 "tokenizer.json"):
        assert (out / name).read_text() == (tmp_path / "cli" / name).read_text(), name
    general = json.loads((out / "training_data_summary.json").read_text())["general"]
    step = source.record.checkpoint
    assert (general["provider"], general["model"], general["checkpoint"], general["step"]) == \
        ("Test Lab", "cli", str(step), 2)
    card = (out / "README.md").read_text()
    assert "license: apache-2.0" in card and f"exported from {step.name} (the trained weights)" in card
    with pytest.raises(UserError, match="^--register needs a training checkpoint's export"):
        export_model(model, tmp_path / "refused", register="demo", origin="a test")
    assert not (tmp_path / "refused").exists()
