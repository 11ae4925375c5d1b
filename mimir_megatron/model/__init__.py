"""The HRM-Text model on megatron-core (imports neither the trainer nor the CLI).

Importing it patches nothing: on CPU, :func:`mimir_megatron.backend.setup` (called by the entry
points, and by ``build_model`` through the process-group set-up) redirects megatron-core's
CUDA-only calls. Its exports load on first use, so that the pure parts (``model.window``: which
applications are in the bp window) can be imported without torch and megatron-core (`mimir plan`).
"""

from mimir_megatron.lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "build_model": ".build", "count_parameters": ".build", "HRMTextModel": ".hrm",
    "ModelOutput": ".hrm", "WindowPlan": ".window", "plan_window": ".window",
})
__all__ = [
    "HRMTextModel", "ModelOutput", "WindowPlan", "build_model", "count_parameters", "plan_window",
]
