"""Model configuration: shipped YAMLs load, every mistake gets its own clear message."""

import logging

import pytest
from conftest import MIMIR, REPO, TINY

from mimir_megatron.config import ModelConfig, load_config
from mimir_megatron.errors import ConfigError


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "model").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_model_config_loads(path):
    cfg = load_config(path)
    assert cfg.errors() == []


def test_mimir_shape():
    cfg = load_config(MIMIR)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.ffn_hidden_size) == (1536, 12, 128, 4096)
    assert (cfg.num_layers_L, cfg.num_layers_H, cfg.h_cycles, cfg.l_cycles, cfg.depth) == (16, 16, 2, 3, 8)
    assert cfg.vocab_size == cfg.padded_vocab_size == 262_144


@pytest.mark.parametrize(
    "override,message",
    [
        ("hidden_size=258", "hidden_size (258) is not divisible by model.num_attention_heads (4)"),
        ("tensor_parallel_size=3", "tensor_parallel_size (3) does not divide model.num_attention_heads (4)"),
        ("ffn_hidden_size=767", "does not divide model.ffn_hidden_size (767)"),
        ("h_cycles=0", "model.h_cycles must be >= 1, got 0"),
        ("l_cycles=0", "model.l_cycles must be >= 1, got 0"),
        ("bp_window=9", "model.bp_window must be in 1..8"),
        ("bp_window=0", "model.bp_window must be in 1..8"),
        ("window_policy=first_k", "window_policy must be one of last_k, h_first, got 'first_k'"),
        ("params_dtype=float16", "params_dtype must be one of"),
    ],
)
def test_each_mistake_is_named(override, message):
    overrides = [override] + (["tensor_parallel_size=2"] if "ffn" in override else [])
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert message in str(err.value)


def test_all_mistakes_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["h_cycles=0", "l_cycles=0", "window_policy=x"])
    text = str(err.value)
    assert text.count("\n  - ") == 3


def test_type_errors_name_the_key():
    with pytest.raises(ConfigError, match="hidden_size"):
        load_config(TINY, ["hidden_size=wide"])


def test_unknown_key_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hidden_size: 64\nhiden_layers: 3\n")
    with pytest.raises(ConfigError, match="unknown model setting.*hiden_layers"):
        load_config(bad)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("no/such.yaml")


def test_vocab_padding_is_announced(caplog):
    caplog.set_level(logging.INFO)
    cfg = load_config(TINY, ["vocab_size=1000", "tensor_parallel_size=2"])
    assert cfg.padded_vocab_size == 1024
    assert "padded to 1024" in caplog.text


def test_defaults_are_the_mimir_shape():
    assert ModelConfig().validate().padded_vocab_size == 262_144
