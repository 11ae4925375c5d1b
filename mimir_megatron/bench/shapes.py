"""The model shapes `mimir bench --shape` knows, as code: a wheel carries no ``configs/``.

``tiny`` and ``mimir`` equal ``configs/model/tiny.yaml`` and ``configs/model/mimir.yaml``
(tests/integration/test_bench.py checks it); ``mid`` sits between them: D=768, 4+4 layers, a 32k vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mimir_megatron.config import ModelConfig

_RECURRENCE = {"h_cycles": 2, "l_cycles": 3, "bp_window": 5, "window_policy": "last_k",
               "rope_theta": 10000.0, "norm_eps": 1.0e-6, "params_dtype": "float32"}

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"vocab_size": 1024, "hidden_size": 256, "num_attention_heads": 4, "ffn_hidden_size": 768,
             "num_layers_L": 2, "num_layers_H": 2, "max_position_embeddings": 512, "seed": 1234,
             **_RECURRENCE},
    # Head dim 128 as in Mimir; SwiGLU width round(4 * 768 * 2/3) to a multiple of 256.
    "mid": {"vocab_size": 32768, "hidden_size": 768, "num_attention_heads": 6, "ffn_hidden_size": 2048,
            "num_layers_L": 4, "num_layers_H": 4, "max_position_embeddings": 4096, **_RECURRENCE},
    "mimir": {"vocab_size": 262144, "hidden_size": 1536, "num_attention_heads": 12,
              "ffn_hidden_size": 4096, "num_layers_L": 16, "num_layers_H": 16,
              "max_position_embeddings": 4096, **_RECURRENCE},
}


# The serving benchmarks' models (bench/bench_serve.py, bench_sessions.py, bench_step_ops.py): a
# shape above and its overrides. ``mid512`` is small enough to serve on 2 cores and large enough
# that its weights (118 MB) stream from memory at every decoding step.
SERVING_SHAPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "tiny": ("tiny", ("vocab_size=1024",)),
    "mid512": ("mid", ("hidden_size=512", "num_attention_heads=8", "ffn_hidden_size=1536", "vocab_size=1024",
                       "max_position_embeddings=512")),
}


def model_config(shape: str | None, config: str | Path | None, overrides: Sequence[str] = ()) -> ModelConfig:
    """The named shape, or a model YAML (``--config``), with ``key=value`` overrides."""
    from mimir_megatron.config import load_config, model_config_from_dict

    if config is not None:
        return load_config(config, overrides)
    return model_config_from_dict(SHAPES[shape or "tiny"], overrides)
