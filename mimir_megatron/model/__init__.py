"""The HRM-Text model on megatron-core (imports neither the trainer nor the CLI)."""

from mimir_megatron import backend as _backend

_backend.activate()  # before megatron's model modules are used; no-op with a GPU

from mimir_megatron.model.build import build_model, count_parameters  # noqa: E402
from mimir_megatron.model.hrm import HRMTextModel, ModelOutput  # noqa: E402
from mimir_megatron.model.window import WindowPlan, plan_window  # noqa: E402

__all__ = [
    "HRMTextModel", "ModelOutput", "WindowPlan", "build_model", "count_parameters", "plan_window",
]
