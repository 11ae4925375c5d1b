"""Can this checkpoint be loaded into this model? Layout version and model shape."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from mimir_megatron.config import EXECUTION_FIELDS, ModelConfig
from mimir_megatron.errors import UserError

from .layout import FORMAT

# Model fields that may change between save and load (layout and schedule, not shape).
LAYOUT_FIELDS = {"tensor_parallel_size", "sequence_parallel", "bp_window", "window_policy",
                 "tokenizer", "seed", "h_cycles", "l_cycles", "max_position_embeddings"} | set(
    EXECUTION_FIELDS)


def check_format(saved: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint written with another layout version of the sharded state."""
    if saved.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} has layout version {saved.get('format', 'none')}; this "
                        f"version of mimir-megatron reads version {FORMAT}")


def check_compatible(saved: dict[str, Any], cfg: ModelConfig, path: Path) -> None:
    """Refuse a checkpoint of another layout version or model shape, naming what differs."""
    check_format(saved, path)
    current = asdict(cfg)
    diffs = [
        f"{key}: checkpoint {value!r}, config {current.get(key)!r}"
        for key, value in saved["model"].items()
        if key not in LAYOUT_FIELDS and current.get(key) != value
    ]
    if saved.get("padded_vocab_size") != cfg.padded_vocab_size and not diffs:
        diffs.append(
            f"padded vocabulary: checkpoint {saved.get('padded_vocab_size')}, this TP layout "
            f"{cfg.padded_vocab_size} (set model.make_vocab_size_divisible_by so both agree)"
        )
    if diffs:
        raise UserError(f"checkpoint {path} holds a model of another shape:\n  - " + "\n  - ".join(diffs))
