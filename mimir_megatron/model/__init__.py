"""The HRM-Text model on megatron-core (imports neither the trainer nor the CLI).

Importing it patches nothing: on CPU, :func:`mimir_megatron.backend.setup` (called by the entry
points, and by ``build_model`` through the process-group set-up) redirects megatron-core's
CUDA-only calls.
"""

from mimir_megatron.model.build import build_model, count_parameters
from mimir_megatron.model.hrm import HRMTextModel, ModelOutput
from mimir_megatron.model.window import WindowPlan, plan_window

__all__ = [
    "HRMTextModel", "ModelOutput", "WindowPlan", "build_model", "count_parameters", "plan_window",
]
