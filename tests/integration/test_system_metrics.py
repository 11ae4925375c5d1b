"""MLflow system metrics (MLflow's own monitor) land in the training run, and can be switched off."""

from conftest import REPO, train_overrides

from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.loop import train


def system_metric_keys(run_dir, run_id) -> set[str]:
    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db").get_run(run_id)
    return {k for k in run.data.metrics if k.startswith("system/")}


def test_system_metrics_in_the_run(demo_data, tmp_path):
    cfg = load_train_config(REPO / "configs/train/demo.yaml", train_overrides(
        demo_data, tmp_path, "train.steps=3", "checkpoint.interval=100", "tracking.system_metrics=true",
        "tracking.system_metrics_interval=0.1"))
    result = train(cfg)
    keys = system_metric_keys(tmp_path, result.run_id)
    # One node: no node prefix. CPU and memory always; GPU ones only where NVML finds a GPU.
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= keys, keys


def test_system_metrics_off(demo_data, tmp_path):
    cfg = load_train_config(REPO / "configs/train/demo.yaml", train_overrides(
        demo_data, tmp_path, "train.steps=1", "checkpoint.interval=100"))
    assert not cfg.tracking.system_metrics
    assert system_metric_keys(tmp_path, train(cfg).run_id) == set()
