"""`mimir export` of a training checkpoint in MLflow: a LoggedModel of the training run, holding
the exported files, linked to the run's metrics at the checkpoint's step and to its lineage, the
card and summary in the run as well, and registered with the card as description."""

from __future__ import annotations

import pytest
from conftest import REPO, train_overrides

from mimir_megatron.cli import main
from mimir_megatron.train.tracking import metric_name

pytest.importorskip("transformers", reason="mimir export needs the hf extra")


def test_an_export_is_a_logged_model_of_its_training_run_and_registrable(demo_data, tmp_path):
    from mlflow.tracking import MlflowClient

    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.loop import train

    run_dir = tmp_path / "run"
    result = train(load_train_config(REPO / "configs" / "train" / "demo.yaml", train_overrides(
        demo_data, run_dir, "train.steps=2", "checkpoint.interval=2")))
    out = tmp_path / "demo-hf"
    assert main(["export", "--checkpoint", str(run_dir / "checkpoints" / "step_0000002"), "--output", str(out),
                 "--register", "demo-model"]) == 0

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

    loss = metric_name("loss")
    linked = {m.key: m for m in model.metrics}
    assert linked[loss].step == 2 and linked[loss].value == pytest.approx(result.losses[-1])
    assert [m.step for m in client.get_metric_history(result.run_id, loss)] == [1, 2]  # nothing added

    [version] = client.search_model_versions("name = 'demo-model'")
    # MLflow 3.17's sqlite registry links a version to its LoggedModel by its source URI.
    assert (version.source, version.run_id, version.description) == (f"models:/{model.model_id}",
                                                                     result.run_id, card)
    assert client.get_registered_model("demo-model").description == card
