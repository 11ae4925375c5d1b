"""Configuration: shipped YAMLs load, shape apart from execution and parallel layout, every
mistake of every section gets its own clear line, all of them at once."""

import json
import logging
from dataclasses import fields
from enum import Enum

import pytest
from conftest import MIMIR, REPO, TINY

from mimir_megatron.config import (
    ExecutionConfig,
    ModelConfig,
    ModelShape,
    ParallelConfig,
    load_config,
    model_config_from_record,
)
from mimir_megatron.errors import ConfigError
from mimir_megatron.train.config import load_train_config


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
        ("parallel.tensor_parallel_size=3", "tensor_parallel_size (3) does not divide model.num_attention_heads (4)"),
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
    overrides = [override] + (["parallel.tensor_parallel_size=2"] if "ffn" in override else [])
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
    bad.write_text("hidden_size: 64\nhiden_layers: 3\nexecution: {attention: dense}\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert "model.hiden_layers is not a setting (known: vocab_size, hidden_size," in str(err.value)
    assert "model.execution.attention is not a setting (known: attention_backend," in str(err.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("no/such.yaml")


def test_vocab_padding_is_announced(caplog):
    caplog.set_level(logging.INFO)
    cfg = load_config(TINY, ["vocab_size=1000", "parallel.tensor_parallel_size=2"])
    assert cfg.padded_vocab_size == 1024
    assert "padded to 1024" in caplog.text


def test_defaults_are_the_mimir_shape():
    assert ModelConfig().validate().padded_vocab_size == 262_144


# -- shape / execution / parallel ------------------------------------------------------------------


def test_shape_execution_and_parallel_are_apart():
    shape = {f.name for f in fields(ModelShape)}
    execution, parallel = {f.name for f in fields(ExecutionConfig)}, {f.name for f in fields(ParallelConfig)}
    assert not shape & execution and not shape & parallel and not execution & parallel
    cfg = load_config(TINY, ["execution.attention_backend=dense", "parallel.tensor_parallel_size=2"])
    assert set(cfg.shape_dict()) == shape  # what checkpoints and project weights record
    assert (cfg.execution.attention_backend, cfg.parallel.tensor_parallel_size) == ("dense", 2)
    assert cfg.shape == ModelShape(**{name: getattr(cfg, name) for name in shape})


def test_a_setting_from_before_the_split_names_its_new_place():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["attention_backend=dense", "tensor_parallel_size=2"])
    assert "model.attention_backend is not a setting: it is now model.execution.attention_backend" in str(err.value)
    assert "model.tensor_parallel_size is not a setting: it is now model.parallel.tensor_parallel_size" in str(err.value)


def test_a_moved_key_is_named_only_in_its_old_section():
    """The hint is for the model section's old keys; inside a subsection it is just unknown."""
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["execution.tensor_parallel_size=2"])
    assert "model.execution.tensor_parallel_size is not a setting (known: " in str(err.value)


def test_a_record_from_before_the_split_loads_its_shape_only():
    legacy = {**load_config(TINY).shape_dict(), "attention_backend": "varlen", "compile": True,
              "tensor_parallel_size": 2, "sequence_parallel": True}
    cfg = model_config_from_record(legacy, ["parallel.sequence_parallel=false"])
    assert cfg.execution == ExecutionConfig() and cfg.parallel == ParallelConfig(1, False)
    assert cfg.shape_dict() == load_config(TINY).shape_dict()


def test_choices_are_enums_and_stay_plain_strings():
    cfg = load_config(TINY, ["execution.recompute=full", "window_policy=h_first"])
    assert isinstance(cfg.execution.recompute, Enum) and cfg.execution.recompute == "full"
    plain = cfg.to_dict()
    assert type(plain["window_policy"]) is str and type(plain["execution"]["recompute"]) is str
    assert json.loads(json.dumps(plain)) == plain


# -- a training config: every mistake of every section, one line each --------------------------


def test_one_line_per_mistake_in_every_section(tmp_path):
    bad = tmp_path / "train.yaml"
    bad.write_text(f"""
model: {{config: {TINY}, h_cycles: 0}}
data: {{mixture: {REPO / "configs/data/demo.yaml"}, seq_len: 1}}
train: {{steps: many}}
window: {{schedule: cubic}}
optim: {{beta1: 1.5}}
checkpoint: {{keep: 0}}
tracking: {{system_metrics_interval: 0}}
eval: {{limit: 0}}
""")
    with pytest.raises(ConfigError) as err:
        load_train_config(bad)
    lines = str(err.value).splitlines()[1:]
    assert all(line.startswith("  - ") for line in lines), lines
    expected = ["model.h_cycles must be >= 1, got 0",
                "data.seq_len must be an integer >= 2, got 1",
                "train.steps: Value 'many' of type 'str' could not be converted to Integer",
                "window.schedule must be one of constant, linear, got 'cubic'",
                "optim.beta1 must be in [0, 1), got 1.5",
                "checkpoint.keep must be >= 1, got 0",
                "tracking.system_metrics_interval must be > 0, got 0.0",
                "eval.limit must be >= 1, got 0"]
    assert sorted(line[4:] for line in lines) == sorted(expected)


def test_each_sections_values_and_the_checks_across_sections_are_all_listed(tmp_path):
    """Each section checks its own values; the checks that read two sections (the layout over the
    ranks, the mixture a run needs) follow; every mistake is listed, in the words used before the
    checks moved to their sections."""
    bad = tmp_path / "train.yaml"
    bad.write_text(f"""
model: {{config: {TINY}, params_dtype: bfloat16, parallel: {{tensor_parallel_size: 2}}}}
data: {{mixture: {tmp_path / "none.yaml"}}}
train: {{steps: 0, plan_efficiency: 2.0}}
window: {{schedule: linear, k0: 9, ramp_fraction: 0}}
optim: {{fully_shard: true, shard_state: false, lr: 0, cooldown: linear, cooldown_steps: 0}}
checkpoint: {{interval: 0, init_from: {tmp_path / "nowhere"}}}
tracking: {{system_metrics_interval: -1}}
eval: {{suite: {tmp_path / "suite.yaml"}, limit: 0}}
""")
    with pytest.raises(ConfigError) as err:
        load_train_config(bad)
    found = sorted(line[4:] for line in str(err.value).splitlines()[1:])
    assert found == sorted([
        "train.steps must be >= 1, got 0",
        "train.plan_efficiency must be in (0, 1], got 2.0",
        f"eval.suite: {tmp_path / 'suite.yaml'} is not a file (a suite YAML, e.g. configs/eval/demo.yaml)",
        "eval.limit must be >= 1, got 0",
        "eval.suite runs on rank 0's engine alone, which needs the whole model: use "
        "model.parallel.tensor_parallel_size=1, or evaluate checkpoints with `mimir eval`",
        "optim.fully_shard=true shards over data-parallel ranks only: it needs "
        "model.parallel.tensor_parallel_size=1, got 2",
        "window.k0 must be in 1..8 (the model's schedule depth), got 9",
        "window.ramp_fraction must be in (0, 1], got 0.0",
        "optim.fully_shard=true shards the optimizer state: it contradicts optim.shard_state=false",
        "optim.lr must be > 0, got 0.0",
        "optim.cooldown=linear needs optim.cooldown_steps >= 1",
        "tracking.system_metrics_interval must be > 0, got -1.0",
        "checkpoint.interval must be >= 1, got 0",
        f"checkpoint.init_from: no directory {tmp_path / 'nowhere'}",
        f"data.mixture: no file {tmp_path / 'none.yaml'}"]), found


def test_a_missing_model_yaml_does_not_hide_the_other_mistakes(tmp_path):
    bad = tmp_path / "train.yaml"
    bad.write_text("model: {config: nowhere.yaml}\ndata: {seq_len: 1}\noptimizer: {lr: 1}\n")
    with pytest.raises(ConfigError) as err:
        load_train_config(bad)
    text = str(err.value)
    assert "model.config: config file not found: nowhere.yaml" in text
    assert "data.seq_len must be an integer >= 2, got 1" in text
    assert "data.mixture is required" in text
    assert "optimizer is not a section (known: run, train, window, optim," in text
