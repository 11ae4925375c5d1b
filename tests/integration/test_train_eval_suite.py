"""Evaluation during training: `eval.suite` runs a benchmark suite on rank 0's engine every
`eval.interval` steps and at the end, next to the exact match, and MLflow receives the scores."""

import pytest
from conftest import REPO, train_overrides

from mimir_megatron.errors import ConfigError
from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.loop import train
from mimir_megatron.train.tracking import metric_name

DEMO = REPO / "configs" / "train" / "demo.yaml"
SUITE = REPO / "configs" / "eval" / "demo.yaml"


def test_suite_scores_reach_mlflow_at_each_evaluation(demo_data, tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = load_train_config(DEMO, train_overrides(
        demo_data, tmp_path, "train.steps=4", "eval.interval=2", "eval.max_samples=4",
        f"eval.suite={SUITE}", "eval.limit=2", f"eval.data_dir={demo_data}", "eval.max_new_tokens=8"))
    result = train(cfg)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    for metric in ("eval/exact_match", "eval/text_en", "eval/arith_da", "eval/avg/text_tasks"):
        history = client.get_metric_history(result.run_id, metric_name(metric))
        assert [m.step for m in history] == [2, 4], metric
        assert all(0.0 <= m.value <= 1.0 for m in history)
    assert (tmp_path / "eval_logs" / "step_0000004").is_dir()  # InspectAI's logs, per evaluation


@pytest.mark.parametrize("override, message", [
    ("eval.suite=no/such/suite.yaml", "eval.suite: no/such/suite.yaml is not a file"),
    ("eval.limit=0", "eval.limit must be >= 1"),
])
def test_bad_suite_settings_fail_before_compute(demo_data, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(DEMO, train_overrides(demo_data, tmp_path, override)).validate()
