"""Can this checkpoint be loaded into this model? Layout version and model shape."""

from __future__ import annotations

from pathlib import Path

from mimir_megatron.config import ModelConfig
from mimir_megatron.errors import UserError

from .layout import FORMAT
from .trainer_state import TrainerState

# Shape fields the weights do not depend on: the recurrence schedule and metadata may change
# between save and load (execution and parallel settings are not part of the shape at all).
# params_dtype: checkpoints hold fp32 weights (a bf16 run saves its fp32 main copy), which load
# into either.
FREE_SHAPE_FIELDS = {"bp_window", "window_policy", "tokenizer", "seed", "h_cycles", "l_cycles",
                     "max_position_embeddings", "params_dtype"}


def check_format(saved: TrainerState, path: Path) -> None:
    """Refuse a checkpoint written with another layout version of the sharded state."""
    if saved.format != FORMAT:
        version = "none" if saved.format is None else saved.format
        raise UserError(f"checkpoint {path} has layout version {version}; this "
                        f"version of mimir-megatron reads version {FORMAT}")


def check_compatible(saved: TrainerState, cfg: ModelConfig, path: Path) -> None:
    """Refuse a checkpoint of another layout version or model shape, naming what differs."""
    check_format(saved, path)
    current = cfg.shape_dict()
    diffs = [
        f"{key}: checkpoint {value!r}, config {current[key]!r}"
        for key, value in saved.model.items()
        # Records written before the shape/execution split also hold execution and layout keys.
        if key in current and key not in FREE_SHAPE_FIELDS and current[key] != value
    ]
    if saved.padded_vocab_size != cfg.padded_vocab_size and not diffs:
        diffs.append(
            f"padded vocabulary: checkpoint {saved.padded_vocab_size}, this TP layout "
            f"{cfg.padded_vocab_size} (set model.make_vocab_size_divisible_by so both agree)"
        )
    if diffs:
        raise UserError(f"checkpoint {path} holds a model of another shape:\n  - " + "\n  - ".join(diffs))
