"""`mimir train` in one process: resume is bit-exact, refusals, groups, MLflow run contents."""

import getpass
import os
import re
import stat
from pathlib import Path

import pytest
import torch
from conftest import REPO, train_overrides

from mimir_megatron.errors import ConfigError, UserError
from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.loop import train
from mimir_megatron.train.tracking import metric_name

DEMO = REPO / "configs" / "train" / "demo.yaml"


def run(demo_data, run_dir, *extra, stop_at_step=None):
    cfg = load_train_config(DEMO, train_overrides(demo_data, run_dir, *extra))
    return train(cfg, stop_at_step=stop_at_step)


@pytest.fixture(scope="module")
def uninterrupted(reference_run):
    return reference_run[1]


def test_losses_are_finite_and_fall(uninterrupted):
    losses = uninterrupted.losses
    assert len(losses) == 6 and all(map(lambda x: x == x, losses))
    assert losses[-1] < losses[0]


def test_resume_is_bit_exact(demo_data, tmp_path, uninterrupted):
    first = run(demo_data, tmp_path, stop_at_step=3)
    assert first.preempted and first.final_step == 3
    second = run(demo_data, tmp_path)
    assert second.final_step == 6
    assert first.losses + second.losses == uninterrupted.losses  # exactly, not approximately
    from mlflow.tracking import MlflowClient  # one run, one model: pending while pre-empted, then ready

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert second.run_id == first.run_id
    [output] = client.get_run(second.run_id).outputs.model_outputs
    assert str(client.get_logged_model(output.model_id).status) == "READY"


def test_checkpoints_are_atomic_and_pruned(demo_data, tmp_path):
    run(demo_data, tmp_path, "train.steps=9", "checkpoint.keep=2")
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_0000009"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step_0000006", "step_0000009"]
    assert not list(ckpts.glob("*.tmp"))


def test_mlflow_run_holds_config_and_per_step_metrics(uninterrupted):
    from mlflow.tracking import MlflowClient

    run_dir = os.path.dirname(os.path.dirname(uninterrupted.checkpoint))  # <run>/checkpoints/step_N
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    mlrun = client.get_run(uninterrupted.run_id)
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.tags["mlflow.user"] == mlrun.info.user_id == getpass.getuser()  # who made it
    assert mlrun.data.params["model.hidden_size"] == "64"
    assert mlrun.data.params["optim.lr"] == "0.003"
    assert mlrun.data.params["settings.checkpoint.interval"] == "3"  # a setting, not a hyperparameter
    sp = mlrun.data.params["settings.model.parallel.sequence_parallel"]
    assert f"SP={sp}" in mlrun.data.tags["parallel_layout"]  # no param contradicts a tag
    assert re.fullmatch(r"demo-k2to5-s6-[0-9a-f]{6}", mlrun.info.run_name)
    assert "lr_H = lr / k_H" in mlrun.data.tags["mlflow.note.content"]
    files = {f.path for f in client.list_artifacts(uninterrupted.run_id)}
    files |= {f.path for f in client.list_artifacts(uninterrupted.run_id, "data")}
    assert {"config.yaml", "data/lineage.json", "data/policy_decision.json"} <= files
    for tag in ("git_commit", "host", "world_size", "parallel_layout", "data_fingerprint", "checkpoint.latest"):
        assert tag in mlrun.data.tags
    # Where MLflow 3's UI files it: a model-training experiment, and the run outputs the model it
    # trains (kept outside MLflow, in the run's checkpoints), which makes it a training run.
    experiment = client.get_experiment(mlrun.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    [output] = mlrun.outputs.model_outputs
    model = client.get_logged_model(output.model_id)
    assert (model.source_run_id, str(model.status)) == (uninterrupted.run_id, "READY")
    assert model.tags["mimir.checkpoints"] == str((Path(run_dir) / "checkpoints").resolve())
    assert model.tags["mlflow.model.isExternal"] == "true"
    for metric in ("loss", "lr/L", "lr/H", "lr/embedding", "lr/head", "window_k", "k_L", "k_H", "grad_norm",
                   "supervised_tokens", "tokens_seen", "tokens_per_s", "tflops_per_device", "mfu",
                   "peak_memory_gb"):
        history = client.get_metric_history(uninterrupted.run_id, metric_name(metric))
        assert [m.step for m in history] == [1, 2, 3, 4, 5, 6], metric
    losses = [m.value for m in client.get_metric_history(uninterrupted.run_id, metric_name("loss"))]
    assert losses == pytest.approx(uninterrupted.losses)
    k = [m.value for m in client.get_metric_history(uninterrupted.run_id, metric_name("window_k"))]
    assert k == [2, 3, 4, 5, 5, 5]  # ramp over 50 % of 6 steps: k = 2 + int(step / 3 * 3), step 0-based
    seen = [m.value for m in client.get_metric_history(uninterrupted.run_id, metric_name("tokens_seen"))]
    assert seen == [4 * 64 * step for step in range(1, 7)]  # global batch x seq_len per step


def test_evaluation_during_training_changes_no_training_number(demo_data, tmp_path, uninterrupted):
    """Periodic held-out evaluation (eval.interval) logs its points and leaves the losses bit-exact."""
    from mlflow.tracking import MlflowClient

    evaluated = run(demo_data, tmp_path, "eval.interval=2", "eval.max_samples=4", "eval.max_new_tokens=8")
    assert evaluated.losses == uninterrupted.losses
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    points = client.get_metric_history(evaluated.run_id, metric_name("eval/exact_match"))
    assert [m.step for m in points] == [2, 4, 6]
    files = {f.path for f in client.list_artifacts(evaluated.run_id, "eval")}
    assert files == {f"eval/step_{s:07d}" for s in (2, 4, 6)}


def test_frozen_modules_do_not_move(demo_data, tmp_path):
    """With k=1 (last_k) only H trains: L and the embedding must stay bit-identical."""
    from mimir_megatron.model import build_model
    from mimir_megatron.model.state import gather_full_state
    from mimir_megatron.checkpoint import load_checkpoint

    run(demo_data, tmp_path, "window.schedule=constant", "window.k=1", "train.steps=3")
    cfg = load_train_config(DEMO, train_overrides(demo_data, tmp_path))
    initial = gather_full_state(build_model(cfg.model))
    trained_model = build_model(cfg.model)
    load_checkpoint(tmp_path / "checkpoints" / "step_0000003", trained_model, None, None)
    trained = gather_full_state(trained_model)
    for name in initial:
        moved = not torch.equal(initial[name], trained[name])
        expected = name.startswith(("H.", "head."))
        assert moved == expected, name


def test_resume_refuses_a_changed_mixture(demo_data, tmp_path):
    run(demo_data, tmp_path, stop_at_step=3)
    other = demo_data / "other_mixture.yaml"
    text = (demo_data / "mixture.yaml").read_text().replace("repeat: 1}", "repeat: 2}")
    other.write_text(text)
    with pytest.raises(UserError, match="data mixture changed"):
        run(demo_data, tmp_path, f"data.mixture={other}")
    run(demo_data, tmp_path, f"data.mixture={other}", "checkpoint.allow_data_change=true")


def test_resume_refuses_another_shape(demo_data, tmp_path):
    run(demo_data, tmp_path, stop_at_step=3)
    with pytest.raises(UserError, match=r"another shape:\n  - ffn_hidden_size: checkpoint 128, config 256"):
        run(demo_data, tmp_path, "model.ffn_hidden_size=256")


def test_unwritable_checkpoint_directory_is_refused(demo_data, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.access(locked, os.W_OK):  # root ignores permission bits: use a path under a file
        (tmp_path / "afile").write_text("")
        target = tmp_path / "afile" / "ckpts"
    else:
        target = locked / "ckpts"
    # Permission bits: "... is not writable (Permission denied)"; under a file (root): "cannot write".
    with pytest.raises(UserError, match=r"ckpts\S* is not writable|cannot write checkpoint directory \S*ckpts"):
        run(demo_data, tmp_path / "r", f"checkpoint.dir={target}")


@pytest.mark.parametrize(
    "override,message",
    [
        ("window.k1=9", "window.k1 must be in 1..8"),
        ("optim.optimizer=sgd", "optim.optimizer must be one of adamw, adam_atan2"),
        ("train.global_batch_size=5", r"not a multiple of train.micro_batch_size \(2\)"),
        ("optim.cooldown_steps=-1", "optim.warmup_steps and optim.cooldown_steps must be >= 0"),
        ("data.mixture=/nonexistent.yaml", "data.mixture: no file"),
    ],
)
def test_invalid_values_fail_before_compute(demo_data, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        cfg = load_train_config(DEMO, train_overrides(demo_data, tmp_path, override))
        cfg.validate(world_size=1)


def test_every_shipped_train_config_loads():
    for path in sorted((REPO / "configs" / "train").glob("*.yaml")):
        cfg = load_train_config(path, ["data.mixture=" + str(REPO / "configs/data/demo.yaml")])
        assert cfg.model.errors() == [], path


def test_export_from_a_training_checkpoint_with_and_without_ema(demo_data, tmp_path):
    from mimir_megatron.cli import main
    from mimir_megatron.interop import read_safetensors_dir

    run(demo_data, tmp_path, "train.steps=3", "optim.ema_decay=0.5")
    step = tmp_path / "checkpoints" / "step_0000003"
    assert main(["export", "--checkpoint", str(step), "--output", str(tmp_path / "raw")]) == 0
    assert main(["export", "--checkpoint", str(step), "--ema", "--output", str(tmp_path / "ema")]) == 0
    raw, ema = read_safetensors_dir(tmp_path / "raw"), read_safetensors_dir(tmp_path / "ema")
    head_raw, head_ema = raw["lm_head.weight"], ema["lm_head.weight"]
    assert not torch.equal(head_raw, head_ema)  # the EMA lags the weights
    assert torch.equal(raw["model.z_L_init"], ema["model.z_L_init"])
    # The demo's tokenizer travels with the export, so the directory is a complete model.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "raw")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)


def test_continued_training_from_a_checkpoint_and_from_imported_weights(demo_data, tmp_path):
    """v1 -> v1.5: new window schedule, fresh optimizer, weights from the v1 run, parent tag. Weights
    without a recorded lineage (imported) are refused by the default data policy before anything
    is built, and train under a policy that allows them."""
    from mlflow.tracking import MlflowClient

    from mimir_megatron.interop import export_hf, import_hf, save_weights
    from mimir_megatron.checkpoint import load_model

    v1 = run(demo_data, tmp_path / "v1", "train.steps=3")
    start = tmp_path / "v1" / "checkpoints" / "step_0000003"
    v15 = run(demo_data, tmp_path / "v15", f"checkpoint.init_from={start}", "window.k0=5",
              "window.k1=8", "train.steps=2")
    assert v15.final_step == 2 and v15.losses[0] < v1.losses[0]  # starts from trained weights
    tags = MlflowClient(f"sqlite:///{tmp_path / 'v15'}/mlflow.db").get_run(v15.run_id).data.tags
    assert tags["mlflow.parentRunId"] == v1.run_id
    # From a transformers model, through `mimir import` weights.
    export_hf(load_model(start), tmp_path / "hf")
    save_weights(import_hf(tmp_path / "hf"), tmp_path / "imported")
    with pytest.raises(UserError, match=r"base model .*imported: its training data is not recorded"):
        run(demo_data, tmp_path / "refused", f"checkpoint.init_from={tmp_path / 'imported'}")
    allowing = tmp_path / "mixture.yaml"
    allowing.write_text((demo_data / "mixture.yaml").read_text() + "data_policy: {allow_unknown_base: true}\n")
    from_hf = run(demo_data, tmp_path / "from_hf", f"checkpoint.init_from={tmp_path / 'imported'}",
                  f"data.mixture={allowing}", "window.k0=5", "window.k1=8", "train.steps=2")
    assert from_hf.losses == pytest.approx(v15.losses, rel=1e-6)


def test_adam_atan2_trains(demo_data, tmp_path):
    result = run(demo_data, tmp_path, "optim.optimizer=adam_atan2", "train.steps=3", "optim.lr=3e-4")
    assert result.final_step == 3 and result.losses[-1] < result.losses[0]


def test_checkpoint_of_another_layout_version_is_refused(demo_data, tmp_path):
    from dataclasses import replace

    from mimir_megatron.checkpoint.trainer_state import read_trainer_state, write_trainer_state

    run(demo_data, tmp_path, stop_at_step=3)
    path = tmp_path / "checkpoints" / "step_0000003"
    write_trainer_state(path, replace(read_trainer_state(path), format=None))
    with pytest.raises(UserError, match="layout version none; this version of mimir-megatron reads version 1"):
        run(demo_data, tmp_path)
