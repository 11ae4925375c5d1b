"""`mimir train`: recurrence scheduler, per-module optimizer groups, DP/TP, checkpoints, MLflow."""

from mimir_megatron.train.config import TrainConfig, load_train_config

__all__ = ["TrainConfig", "load_train_config"]
