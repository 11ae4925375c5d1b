"""What a training run shows in MLflow: metric names in chart-section order, params split into
hyperparameters and settings, run names, and artifacts that wait while the store refuses them
(tests/system/test_ui_browser.py sees them in the UI)."""

from __future__ import annotations

import logging

from conftest import REPO

from mimir_megatron.train.config import flatten, load_train_config
from mimir_megatron.train.tracking import Tracker, metric_name, run_description, run_name, run_params

DEMO = REPO / "configs" / "train" / "demo.yaml"


def test_the_curves_a_researcher_reads_first_lead_mlflows_chart_order():
    # MLflow sorts chart sections by name (the part before the last "/"), charts by full name.
    names = [metric_name(k) for k in ("nonfinite_skip", "eval/exact_match", "lr/embedding", "window_k",
                                      "tokens_seen", "mfu", "tokens_per_s", "grad_norm", "loss", "lr/H",
                                      "plan/step_time_s", "eval/avg/text_tasks")]
    sections = sorted({n.rsplit("/", 1)[0] for n in names})
    assert sections[:5] == ["1-train", "2-schedule", "3-eval", "3-eval/avg", "4-tokens"]
    lead = sorted(n for n in names if n.startswith("1-train/"))
    assert lead == ["1-train/grad_norm", "1-train/loss", "1-train/mfu", "1-train/tokens_per_s"]
    schedule = sorted(n for n in names if n.startswith("2-schedule/"))
    assert schedule == ["2-schedule/lr_H", "2-schedule/lr_embedding", "2-schedule/window_k"]
    assert metric_name("plan/step_time_s") == "5-step/planned_step_time_s"
    assert metric_name("something_new") == "something_new"


def test_params_split_hyperparameters_from_settings_and_follow_what_the_run_does():
    cfg = load_train_config(DEMO, ["model.parallel.sequence_parallel=true"])
    params = run_params(flatten(cfg.to_dict()),
                        {"model.parallel.sequence_parallel": cfg.model.uses_sequence_parallel})
    for hyper in ("optim.lr", "model.hidden_size", "window.k0", "train.steps", "train.global_batch_size",
                  "data.seq_len", "run.seed", "checkpoint.init_from"):
        assert hyper in params, hyper
    for setting in ("checkpoint.interval", "tracking.experiment", "train.micro_batch_size", "eval.max_samples",
                    "train.log_interval", "run.dir", "model.parallel.tensor_parallel_size", "optim.shard_state"):
        assert f"settings.{setting}" in params and setting not in params, setting
    # TP=1: no sequence parallelism, whatever the config asked, as the run's layout tag says.
    assert params["settings.model.parallel.sequence_parallel"] is False
    assert len(params) == len(flatten(cfg.to_dict()))


def test_run_names_tell_runs_of_a_recipe_apart_unless_the_user_names_one():
    demo = load_train_config(DEMO)
    assert run_name(demo).startswith("demo-k2to5-s300-")
    assert run_name(load_train_config(DEMO, ["optim.lr=1e-3"])) != run_name(demo)
    constant = load_train_config(DEMO, ["window.schedule=constant", "window.k=3", "train.steps=50"])
    assert run_name(constant).startswith("demo-k3-s50-")
    assert run_name(load_train_config(DEMO, ["tracking.run_name=ablation A"])) == "ablation A"
    text = run_description(demo, 989.0, "h200")
    assert "lr_H = lr / k_H" in text and "2 -> 5" in text and "989 TFLOP/s (h200)" in text


def test_refused_artifacts_wait_while_metrics_flow_and_are_named_at_the_end(tmp_path, monkeypatch, caplog):
    tracker = Tracker(None, tmp_path, "e", enabled=True, retry_seconds=0.0)
    tracker.start("r", {"optim.lr": 0.1}, {})
    client, run_id = tracker._client, tracker.run_id
    deliver, full = client.log_text, [True]

    def log_text(run, text, path):
        if full[0]:
            raise OSError(28, "No space left on device")
        return deliver(run, text, path)

    monkeypatch.setattr(client, "log_text", log_text)
    with caplog.at_level(logging.WARNING):
        tracker.log_text("a: 1\n", "config.yaml")
        tracker.log_metrics(1, {"loss": 2.0})
    assert [m.value for m in client.get_metric_history(run_id, metric_name("loss"))] == [2.0]
    assert [r.message for r in caplog.records if "config.yaml" in r.message]  # said once, not lost
    assert not client.list_artifacts(run_id)

    full[0] = False  # the store has room again: the next delivery brings it
    tracker.log_metrics(2, {"loss": 1.5})
    assert [f.path for f in client.list_artifacts(run_id)] == ["config.yaml"]

    full[0] = True  # still refused at the end: one line names it, the run still ends well
    tracker.log_json({"documents": 3}, "data/lineage.json")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert tracker.close(wait_seconds=0)
    [line] = [r.message for r in caplog.records if "not stored" in r.message]
    assert "1 artifacts not stored (data/lineage.json)" in line and "No space left" in line
    assert client.get_run(run_id).info.status == "FINISHED"
