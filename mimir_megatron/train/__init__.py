"""`mimir train`: recurrence scheduler, per-module optimizer groups, DP/TP, checkpoints, MLflow."""

from mimir_megatron.lazy import lazy_exports

# Imported on first use: the CLI imports this package to register its commands.
__getattr__ = lazy_exports(__name__, {
    "TrainConfig": ".config", "load_train_config": ".config",
})
__all__ = ["TrainConfig", "load_train_config"]
