"""mimir-megatron: distributed training of HRM-Text (Mimir) models on megatron-core.

Public API (imported lazily so that ``import mimir_megatron`` stays light):

- :func:`load_config` (path, overrides) -> ModelConfig
- :func:`build_model` (config) -> HRMTextModel; sets up a one-rank process group when needed
- :func:`export_hf` (model, output_dir) and :func:`import_hf` (hf_dir) -> HRMTextModel
- :func:`load_model` (checkpoint: ``step_N``, a checkpoints or run directory; ``ema``) -> HRMTextModel
- :class:`Batch`, the batch contract shared by data, model and trainer
"""

from __future__ import annotations

from typing import Any

from mimir_megatron import megatron_import

# megatron-core's import must not pull in torch's compiler (see megatron_import; imports nothing).
megatron_import.install()

__all__ = ["Batch", "ModelConfig", "build_model", "export_hf", "import_hf", "load_config", "load_model"]


def __getattr__(name: str) -> Any:
    # Even Batch is lazy: it imports torch, and the CLI must install its signal handlers first.
    if name == "Batch":
        from mimir_megatron.batch import Batch

        return Batch
    if name in ("ModelConfig", "load_config"):
        from mimir_megatron import config

        return getattr(config, name)
    if name == "build_model":
        from mimir_megatron.model import build_model

        return build_model
    if name == "load_model":
        from mimir_megatron.checkpoint import load_model

        return load_model
    if name in ("export_hf", "import_hf"):
        from mimir_megatron import interop

        return getattr(interop, name)
    raise AttributeError(f"module 'mimir_megatron' has no attribute {name!r}")
