"""Every command that takes a training checkpoint, on its three path forms: a ``step_N`` directory,
a run's checkpoints directory (through ``latest``) and the run directory itself. One small trained run is shared; the commands
run in-process (``mimir_megatron.cli.main``), except `mimir eval`'s real `mimir serve` (slow tier).

The reference for "the same model" is the step directory's own dist_checkpointing tensors, read
without our loader (``load_plain_tensors``).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, train_overrides

from mimir_megatron.cli import main
from mimir_megatron.train.tracking import metric_name

STEP = "step_0000003"
FORMS = ("step", "checkpoints", "run")


@pytest.fixture(scope="module")
def trained(demo_data, tmp_path_factory) -> Path:
    """A 4-step demo run stopped (as if pre-empted) after its checkpoint at step 3, with an EMA:
    returns its run directory."""
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.loop import train

    run_dir = tmp_path_factory.mktemp("trained")
    train(load_train_config(REPO / "configs/train/demo.yaml",
                            train_overrides(demo_data, run_dir, "train.steps=4")), stop_at_step=3)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == STEP
    return run_dir


def source(run_dir: Path, form: str) -> Path:
    return {"step": run_dir / "checkpoints" / STEP, "checkpoints": run_dir / "checkpoints", "run": run_dir}[form]


def assert_holds_the_checkpoint(model, run_dir: Path, ema: bool = False) -> None:
    """``model`` has the checkpoint's trained (or EMA) weights, read straight from
    dist_checkpointing's files without our loader."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from mimir_megatron.model.sharded import model_sharded_state

    plain = dist_checkpointing.load_plain_tensors(str(run_dir / "checkpoints" / STEP))
    params = {id(p) for p in model.parameters()}
    compared = 0
    for tensor in model_sharded_state(model).values():
        if not isinstance(tensor, ShardedTensor):  # factories (split projections) are skipped
            continue
        key = f"ema.{tensor.key}" if ema and id(tensor.data) in params else tensor.key
        saved = plain[key]
        for offset in tensor.global_offset[:tensor.prepend_axis_num]:  # a layer of a stack
            saved = saved[offset]
        assert torch.equal(tensor.data, saved.to(tensor.data.dtype)), key
        compared += 1
    assert compared > 0


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("ema", [False, True])
def test_load_model_reads_the_checkpoint_latest_names(trained, form, ema):
    from mimir_megatron.checkpoint import load_model

    assert_holds_the_checkpoint(load_model(source(trained, form), ema=ema), trained, ema)


def test_loading_a_model_leaves_the_process_rng_alone(trained):
    """Export or serving must not replay the training run's RNG state into the process."""
    from mimir_megatron.checkpoint import load_model

    def draws() -> tuple:
        return torch.rand(3).tolist(), np.random.rand(), random.random()

    for seed in (torch.manual_seed, np.random.seed, random.seed):
        seed(1234)
    expected = draws()
    for seed in (torch.manual_seed, np.random.seed, random.seed):
        seed(1234)
    load_model(source(trained, "checkpoints"))
    assert draws() == expected


@pytest.mark.parametrize("form", FORMS)
def test_export(trained, form, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(source(trained, form)), "--output", str(out)]) == 0
    exported = {}
    for shard in sorted(out.glob("*.safetensors")):
        exported |= load_file(str(shard))
    assert exported and json.loads((out / "config.json").read_text())["model_type"] == "hrm_text"
    assert (out / "tokenizer.json").is_file()  # the demo tokenizer named by the checkpoint


@pytest.mark.parametrize("form", FORMS)
def test_generate(trained, form, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--checkpoint", str(source(trained, form)), "--ema", "--input",
                 str(tmp_path / "in.jsonl"), "--output", str(out), "--max-new-tokens", "3"]) == 0
    assert len(json.loads(out.read_text())["completion_ids"]) <= 3


@pytest.mark.parametrize("form", FORMS)
def test_serve_start_up(trained, form, monkeypatch, tmp_path):
    import mimir_megatron.inference.server as server

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no key given: the user's own is made there
    served = {}
    monkeypatch.setattr(server, "serve", lambda engine, **kw: served.update(engine=engine, **kw))
    assert main(["serve", "--checkpoint", str(source(trained, form)), "--port", "0"]) == 0
    assert_holds_the_checkpoint(served["engine"].model, trained)
    assert served["engine"].tokenizer is not None


@pytest.mark.parametrize("form", FORMS)
def test_evaluation_reads_the_checkpoint(trained, form, tmp_path):
    """What eval and sweep take from a checkpoint (the server is `mimir serve`, tested above):
    its MLflow run, step, tokenizer, schedule and a name naming the step."""
    import argparse

    from mimir_megatron.checkpoint import read_trainer_state
    from mimir_megatron.entrypoints.evaluate import _model, _source_name, _tokenizer_dir, _trained_schedule
    from mimir_megatron.evaluation.tracking import tracking_target

    state = read_trainer_state(trained / "checkpoints" / STEP)
    path = str(source(trained, form))
    args = argparse.Namespace(model=None, checkpoint=path, hf=None, weights=None, base_url=None, tokenizer=None,
                              ema=False, trained_schedule=None, api_key_file=None)
    model = _model(args)  # resolved once: every fact below is asked of it
    target = tracking_target(tmp_path, record=model.record)
    assert (target.parent_run_id, target.checkpoint_step) == (state.mlflow_run_id, 3)
    assert target.uri == f"sqlite:///{(trained / 'mlflow.db').resolve()}"
    assert _trained_schedule(args, model) == (state.model["h_cycles"], state.model["l_cycles"])
    assert _tokenizer_dir(args, model) == state.model["tokenizer"]
    assert _source_name(args, model) == f"{trained.name}-{STEP}"


@pytest.fixture(scope="module")
def audit_index(trained, demo_data, tmp_path_factory) -> tuple[Path, Path]:
    dataset = sorted(p for p in demo_data.iterdir() if (p / "manifest.json").is_file() and p.name != "eval")[0]
    index = tmp_path_factory.mktemp("audit") / "index"
    assert main(["audit", "index", "--data", f"A={dataset}", "--output", str(index), "--cpus", "1"]) == 0
    return dataset, index


@pytest.mark.parametrize("form", FORMS)
def test_audits(trained, audit_index, form, tmp_path, monkeypatch):
    """Both audits on a training checkpoint; their MLflow runs are child runs of its training run
    in the training run's store, their artifacts in the run directory's artifact store, not in
    ./mlruns of the working directory."""
    from mlflow.tracking import MlflowClient

    from mimir_megatron.checkpoint import read_trainer_state

    dataset, index = audit_index
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    model = str(source(trained, form))
    out = tmp_path / "prefix"
    assert main(["audit", "prefix", "--model", model, "--index", str(index), "--categories", "A",
                 "--per-category", "2", "--prefix-tokens", "8", "--max-new-tokens", "4",
                 "--output", str(out)]) == 0
    assert main(["audit", "continuation", "--model", model, "--data", f"A={dataset}", "--samples", "2",
                 "--prefix-tokens", "8", "--continuation-tokens", "4", "--output", str(tmp_path / "cont")]) == 0
    assert (tmp_path / "cont" / "table12.json").is_file()
    assert not (tmp_path / "cwd" / "mlruns").exists()
    assert not (out / "mlflow.db").exists()
    training_run = read_trainer_state(trained / "checkpoints" / STEP).mlflow_run_id
    client = MlflowClient(tracking_uri=f"sqlite:///{trained.resolve()}/mlflow.db")
    experiment = client.get_run(training_run).info.experiment_id
    audits = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{training_run}' and "
                                "tags.`mimir.kind` = 'audit'", order_by=["attributes.start_time DESC"])
    run = next(r for r in audits if r.info.run_name == "prefix-audit")
    assert run.info.artifact_uri.startswith((trained / "mlartifacts").resolve().as_uri())
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"table11.md"}


@pytest.mark.parametrize("form", FORMS)
def test_train_init_from_and_resume(trained, demo_data, form, tmp_path):
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.loop import train

    def run(run_dir: Path, *extra: str):
        return train(load_train_config(REPO / "configs/train/demo.yaml",
                                       train_overrides(demo_data, run_dir, *extra)))

    path = source(trained, form)
    resumed = run(tmp_path / "resumed", f"checkpoint.resume={path}", "train.steps=4")
    assert len(resumed.losses) == 1 and resumed.final_step == 4  # one step after step 3
    # The checkpoint's MLflow run lives in the other run directory's store: this one logs to a
    # new run that names it, and its metrics arrive (no retrying a run that cannot appear).
    from mlflow.tracking import MlflowClient

    from mimir_megatron.checkpoint import read_trainer_state

    logged = MlflowClient(f"sqlite:///{tmp_path / 'resumed' / 'mlflow.db'}").get_run(resumed.run_id)
    assert logged.data.tags["mimir.resumed_from_run_id"] == read_trainer_state(trained / "checkpoints" / STEP).mlflow_run_id
    assert logged.info.status == "FINISHED" and metric_name("loss") in logged.data.metrics
    continued = run(tmp_path / "continued", f"checkpoint.init_from={path}", "train.steps=1")
    assert continued.final_step == 1


def test_a_dangling_latest_is_one_line_naming_it(trained, tmp_path, capsys):
    from mimir_megatron.checkpoint import resolve
    from mimir_megatron.errors import UserError

    broken = tmp_path / "checkpoints"
    shutil.copytree(trained / "checkpoints", broken)
    (broken / "latest").write_text("step_0000009\n")
    with pytest.raises(UserError, match=r"latest names step_0000009, which is not a complete checkpoint"):
        resolve(broken)
    assert main(["export", "--checkpoint", str(broken), "--output", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_mimir_eval_on_a_checkpoints_directory(trained, tmp_path):
    """`mimir eval --checkpoint <run>/checkpoints`: a real `mimir serve` subprocess loads it."""
    from mimir_megatron.evaluation.fixtures import write_fixtures

    suite = tmp_path / "suite.yaml"
    suite.write_text(f"name: ckpt\ntasks:\n  - {{from: {REPO}/configs/eval/mimir_da.yaml, name: gec, "
                     "max_tokens: 4}\n")
    data = write_fixtures(tmp_path / "data", 2)
    out = tmp_path / "out"
    assert main(["eval", "--checkpoint", str(source(trained, "checkpoints")), "--suite", str(suite),
                 "--data-dir", str(data), "--limit", "1", "--output", str(out)]) == 0
    summary = json.loads((out / "results.json").read_text())
    assert summary["tasks"]["gec"]["n"] == 1 and summary["tasks"]["gec"]["error"] is None
