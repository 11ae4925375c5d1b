"""The GPU tests' model shape, and a second model holding a reference model's weights."""

from __future__ import annotations

from conftest import tiny_config

from mimir_megatron.model import build_model

SHAPE = ("hidden_size=256", "num_attention_heads=4", "ffn_hidden_size=512", "vocab_size=1024")


def like(ref_model, *overrides: str, strict: bool = True):
    """A model of SHAPE with ``overrides``, holding the reference model's weights: a second
    model, not a copy (``copy.deepcopy`` of a megatron model raises: its modules hold process
    groups, which cannot be pickled). Checked on CPU in tests/integration/test_fast_path.py."""
    model = build_model(tiny_config(*SHAPE, *overrides))
    model.load_state_dict(ref_model.state_dict(), strict=strict)
    return model
