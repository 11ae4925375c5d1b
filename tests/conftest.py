"""Shared fixtures. Tests run on CPU with gloo; every test process has a one-rank group."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "model" / "tiny.yaml"
MIMIR = REPO / "configs" / "model" / "mimir.yaml"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def tiny_config(*overrides: str):
    from mimir_megatron.config import load_config

    # Small enough for exhaustive gradient checks in seconds.
    base = ["hidden_size=64", "num_attention_heads=4", "ffn_hidden_size=128", "vocab_size=250"]
    return load_config(TINY, [*base, *overrides])
