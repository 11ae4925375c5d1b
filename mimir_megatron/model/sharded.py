"""The model's and the EMA's sharded tensors as training checkpoints store them.

Shared by the trainer (which adds optimizer moments) and by whatever only reads weights back
(the inference engine), so both agree on the keys without the reader importing the trainer.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor


def model_sharded_state(model: torch.nn.Module) -> dict[str, Any]:
    """``model.sharded_state_dict()`` without Transformer Engine's ``_extra_state`` (FP8 scaling
    history: rebuilt within a few steps, and without it a checkpoint loads under either layer
    backend)."""
    return {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}


def ema_sharded_state(model: torch.nn.Module, model_sd: dict[str, Any],
                      shadow: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The EMA's fp32 ``shadow`` tensors, sharded like the parameters they average."""
    by_param = {id(t.data): t for t in model_sd.values() if hasattr(t, "data")}
    return {
        name: make_sharded_optimizer_tensor(by_param[id(param)], shadow[name], prefix="ema")
        for name, param in model.named_parameters()
    }
