"""One answer to "which model directory is this?" for every command: the three forms recognised,
a form named by the wrong flag refused with the flag that fits, --ema only for checkpoints."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mimir_megatron.checkpoint import (
    ModelKind,
    add_model_arguments,
    detect_model_dir,
    model_dir_from_args,
    resolve_model_dir,
)
from mimir_megatron.errors import UserError


@pytest.fixture
def forms(tmp_path):
    """One directory of each form, laid out as the writers lay them out (entries only)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_0000006").mkdir(parents=True)
    (run / "checkpoints" / "step_0000006" / "trainer_state.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step_0000006\n")
    weights, hf = tmp_path / "weights", tmp_path / "hf"
    weights.mkdir()
    (weights / "model.yaml").write_text("hidden_size: 64\n")
    (weights / "model.safetensors").write_bytes(b"")
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    return {"run": run, "checkpoints": run / "checkpoints", "step": run / "checkpoints" / "step_0000006",
            "weights": weights, "hf": hf, "empty": tmp_path}


@pytest.mark.parametrize("name,kind", [("run", "checkpoint"), ("checkpoints", "checkpoint"),
                                       ("step", "checkpoint"), ("weights", "weights"), ("hf", "hf")])
def test_every_form_is_recognised_and_named_flags_accept_their_own(forms, name, kind):
    assert detect_model_dir(forms[name]).kind == ModelKind(kind)
    assert resolve_model_dir(model=forms[name]).kind == ModelKind(kind)
    assert resolve_model_dir(**{kind: forms[name]}).path == forms[name]


def test_a_form_under_the_wrong_flag_is_refused_with_the_flag_that_fits(forms):
    with pytest.raises(UserError, match=r"^--checkpoint .*weights: this is project weights; pass it as "
                                        r"--weights \(or --model\)$"):
        resolve_model_dir(checkpoint=forms["weights"])
    with pytest.raises(UserError, match=r"this is a training checkpoint; pass it as --checkpoint"):
        resolve_model_dir(hf=forms["run"])
    with pytest.raises(UserError, match=r"this is a transformers directory; pass it as --hf"):
        resolve_model_dir(weights=forms["hf"])


def test_bad_paths_and_ema_are_one_line_each(forms, tmp_path):
    with pytest.raises(UserError, match=r"^--model .*missing: model directory not found$"):
        resolve_model_dir(model=tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(UserError, match=r"^--model .*plain: not a model directory; expected a training "):
        resolve_model_dir(model=tmp_path / "plain")
    with pytest.raises(UserError, match="exactly one model"):
        resolve_model_dir(model=forms["hf"], hf=forms["hf"])
    with pytest.raises(UserError, match=r"^--ema needs a training checkpoint; .* is project weights"):
        detect_model_dir(forms["weights"]).check_ema(True)
    detect_model_dir(forms["run"]).check_ema(True)


def test_the_flags_are_the_same_for_every_command(forms):
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--model", str(forms["weights"])])
    assert model_dir_from_args(args).kind == ModelKind.weights
    with pytest.raises(SystemExit):  # one source only
        parser.parse_args(["--model", str(forms["hf"]), "--hf", str(forms["hf"])])
    from mimir_megatron.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for name in ("generate", "serve", "export", "eval", "sweep", "lm-eval", "audit"):
        command = commands[name]
        if name == "audit":  # its subcommands take the model
            command = command._subparsers._group_actions[0].choices["prefix"]
        flags = {o for a in command._actions for o in a.option_strings}
        assert {"--model", "--checkpoint", "--weights", "--hf", "--ema"} <= flags, name


@pytest.mark.parametrize("name,display,served", [
    ("run", "run-step_0000006", "run"), ("checkpoints", "run-step_0000006", "checkpoints"),
    ("step", "run-step_0000006", "step_0000006"), ("weights", "weights", "weights"), ("hf", "hf", "hf")])
def test_a_models_names_come_from_its_directory(forms, name, display, served):
    """Evaluation tables and MLflow name a checkpoint by its run and step whichever form named it;
    the server answers to the directory's name as given (what clients were told to send)."""
    source = detect_model_dir(forms[name])
    assert source.display_name() == display
    assert source.served_name == served
    if source.kind == ModelKind.checkpoint:
        assert source.display_name(ema=True) == display + "-ema"


def test_the_run_directory_and_lineage_of_each_form(tmp_path, forms):
    """A checkpoint's run directory is its ``checkpoints/`` folder's parent, else (``checkpoint.dir``
    set elsewhere) the one its recorded configuration names; its lineage is the one recorded. The
    other forms record no run and no lineage."""
    from mimir_megatron.checkpoint import DatasetLineage, TrainerState
    from mimir_megatron.checkpoint.trainer_state import write_trainer_state

    recorded = (DatasetLineage(name="d", path="/data/d", category="c", language="en", audit_group="A",
                               provenance={"status": "unknown"}, provenance_digest=None, documents=3,
                               tokens=30),)
    elsewhere = tmp_path / "ckpts" / "step_0000002"  # checkpoint.dir outside the run directory
    elsewhere.mkdir(parents=True)
    write_trainer_state(elsewhere, TrainerState(step=2, lineage=recorded,
                                                config={"run": {"dir": str(tmp_path / "the-run"), "name": "r"}}))
    beside = tmp_path / "run2" / "checkpoints" / "step_0000002"
    beside.mkdir(parents=True)
    write_trainer_state(beside, TrainerState(step=2, config={"run": {"dir": "/elsewhere", "name": "r"}}))
    unnamed = tmp_path / "unnamed" / "step_0000002"
    unnamed.mkdir(parents=True)
    write_trainer_state(unnamed, TrainerState(step=2, config={"run": {"name": "r"}}))

    assert detect_model_dir(elsewhere).run_directory.root == tmp_path / "the-run"
    assert detect_model_dir(elsewhere).lineage == recorded
    assert detect_model_dir(tmp_path / "run2").run_directory.root == tmp_path / "run2"  # its folder wins
    assert detect_model_dir(tmp_path / "run2").lineage == ()
    assert detect_model_dir(unnamed).run_directory.root == Path("runs") / "r"  # run.dir unset: runs/<name>
    assert detect_model_dir(elsewhere).record.checkpoint == elsewhere
    for name in ("weights", "hf"):
        source = detect_model_dir(forms[name])
        assert (source.record, source.run_directory, source.lineage) == (None, None, None)


def test_a_model_is_resolved_once_and_every_fact_is_asked_of_it(tmp_path, monkeypatch):
    """The model value a command resolves reads the checkpoint's trainer state once (its digest
    checked once) however many facts are asked (record, run, lineage, settings, schedule,
    tokenizer, names), follows ``latest`` once, and hands that state to the weights' loader,
    which verifies the files against it instead of reading it again."""
    from mimir_megatron.checkpoint import TrainerState, load, model_dir
    from mimir_megatron.checkpoint.trainer_state import write_trainer_state

    step = tmp_path / "run" / "checkpoints" / "step_0000004"
    step.mkdir(parents=True)
    (step.parent / "latest").write_text("step_0000004\n")
    write_trainer_state(step, TrainerState(step=4, model={"h_cycles": 2, "l_cycles": 3, "tokenizer": "tok"},
                                           config={"run": {"name": "r", "dir": None}}))
    reads, resolves = [], []
    real_read, real_resolve = model_dir.read_trainer_state, model_dir.resolve
    monkeypatch.setattr(model_dir, "read_trainer_state", lambda p: reads.append(p) or real_read(p))
    monkeypatch.setattr(model_dir, "resolve", lambda p: resolves.append(p) or real_resolve(p))
    model = resolve_model_dir(checkpoint=tmp_path / "run")
    for _ in range(2):
        facts = (model.record.state.step, model.run_directory.root, model.lineage, model.trained_schedule,
                 model.tokenizer, model.tokenizer_or("given"), model.display_name(), model.served_name)
        assert facts == (4, tmp_path / "run", (), (2, 3), Path("tok"), Path("given"), "run-step_0000004", "run")
    assert reads == [step] and resolves == [tmp_path / "run"]
    loaded = []
    monkeypatch.setattr(load, "load_model", lambda path, **kw: loaded.append((path, kw)) or "model")
    assert model.load(ema=True) == "model"
    assert loaded == [(step, {"ema": True, "tensor_parallel_size": 1, "state": model.record.state})]
    assert reads == [step]  # the loader was given the state, not left to read it again
