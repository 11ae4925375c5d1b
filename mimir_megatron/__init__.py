"""mimir-megatron: distributed training of HRM-Text (Mimir) models on megatron-core.

Public API (imported lazily so that ``import mimir_megatron`` stays light):

- :func:`load_config` (path, overrides) -> ModelConfig
- :func:`build_model` (config) -> HRMTextModel; sets up a one-rank process group when needed
- :func:`export_hf` (model, output_dir) and :func:`import_hf` (hf_dir) -> HRMTextModel
- :func:`load_model` (checkpoint: ``step_N``, a checkpoints or run directory; ``ema``) -> HRMTextModel
- :class:`Batch`, the batch contract shared by data, model and trainer
"""

from __future__ import annotations

from mimir_megatron.lazy import lazy_exports

# Even Batch is lazy: it imports torch, and the CLI must install its signal handlers first.
__getattr__ = lazy_exports(__name__, {
    "Batch": ".batch", "ModelConfig": ".config", "load_config": ".config", "build_model": ".model",
    "load_model": ".checkpoint", "export_hf": ".interop", "import_hf": ".interop",
})
__all__ = ["Batch", "ModelConfig", "build_model", "export_hf", "import_hf", "load_config", "load_model"]
