"""Model configuration: a typed schema, YAML loading with dotlist overrides, one validation pass.

Every mistake found is reported, each in one line, in a single :class:`ConfigError`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mimir_megatron.errors import ConfigError

log = logging.getLogger(__name__)

WINDOW_POLICIES = ("last_k", "h_first")
PARAMS_DTYPES = ("float32", "bfloat16")
ATTENTION_BACKENDS = ("auto", "dense", "flex", "varlen")
LAYER_BACKENDS = ("auto", "local", "te")
FP8_RECIPES = ("none", "delayed", "current", "mxfp8")
RECOMPUTE = ("none", "selective", "full")
EXECUTION_FIELDS = ("attention_backend", "layer_backend", "fp8", "compile", "recompute",
                    "loss_chunk_tokens")
"""Model settings that choose how the model computes, not what it is: free to change between a
checkpoint's save and its resume or export."""


@dataclass
class ModelConfig:
    """Shape and numerics of an HRM-Text model (defaults: the Mimir "XL" shape)."""

    vocab_size: int = 262_144
    """Tokenizer vocabulary. The embedding and head are padded to `padded_vocab_size`."""
    hidden_size: int = 1536
    """Model width D."""
    num_attention_heads: int = 12
    """Heads of plain multi-head attention (no GQA)."""
    ffn_hidden_size: int = 4096
    """SwiGLU intermediate size."""
    num_layers_L: int = 16
    """Transformer layers in the low-level (L) stack."""
    num_layers_H: int = 16
    """Transformer layers in the high-level (H) stack."""
    h_cycles: int = 2
    """H-cycles of the recurrence; each runs `l_cycles` L-applications then one H-application."""
    l_cycles: int = 3
    """L-applications per H-cycle."""
    bp_window: int = 5
    """Default truncated-backprop window k (module applications that build a graph)."""
    window_policy: str = "last_k"
    """Which applications the window covers: `last_k` (paper) or `h_first` (reference code)."""
    rope_theta: float = 10_000.0
    """RoPE base (rotate-half convention)."""
    norm_eps: float = 1e-6
    """Epsilon of the parameterless RMSNorms."""
    embedding_scale: float | None = None
    """Multiplier on the token embedding; None means sqrt(hidden_size)."""
    max_position_embeddings: int = 4096
    """Longest context the model is meant for (recorded in exports)."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this times the tensor-parallel size."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks that split each layer (part of the model config: it constrains shapes)."""
    sequence_parallel: bool = True
    """Shard activations along the sequence between TP regions (only used when TP > 1)."""
    params_dtype: str = "float32"
    """Storage dtype of the weights: float32 (CPU, master weights) or bfloat16 (inference and
    export only: `mimir train` refuses it, the trainer keeps fp32 weights)."""
    attention_backend: str = "auto"
    """PrefixLM attention from `kernels/`: `dense` (boolean mask + SDPA, the CPU reference),
    `flex` (FlexAttention block mask, compiled on GPU), `varlen` (two-pass variable-length
    flash attention, GPU); `auto` picks flex on GPU and dense on CPU."""
    layer_backend: str = "auto"
    """Linear layers of the L/H stacks: `local` (megatron's own, CPU and GPU) or `te`
    (Transformer Engine, needed for FP8); `auto` picks te where it imports on a GPU."""
    fp8: str = "none"
    """FP8 recipe of the Transformer Engine linears: none (bf16), delayed or current scaling
    (Hopper), mxfp8 (Blackwell). Needs layer_backend te (or auto resolving to it)."""
    compile: bool = False
    """torch.compile each module application (the L and H stacks) on GPU."""
    recompute: str = "none"
    """Activation recompute in the applications with grad: none, selective (core attention) or
    full (every layer's input is kept, the layer recomputed in backward)."""
    loss_chunk_tokens: int = 0
    """Tokens per chunk of the fused head + cross-entropy used in training (0: plain head and
    loss over the whole micro-batch). Chunking keeps the full fp32 logits from existing at once."""
    seed: int = 1234
    """Seed of the weight initialisation (the same weights for every TP size)."""
    tokenizer: str | None = None
    """Optional Hugging Face tokenizer directory, copied next to exported models."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def depth(self) -> int:
        """Module applications per forward pass: H_cycles * (L_cycles + 1)."""
        return self.h_cycles * (self.l_cycles + 1)

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by * self.tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def effective_embedding_scale(self) -> float:
        if self.embedding_scale is None:
            return math.sqrt(self.hidden_size)
        return self.embedding_scale

    @property
    def uses_sequence_parallel(self) -> bool:
        return self.sequence_parallel and self.tensor_parallel_size > 1

    def errors(self) -> list[str]:
        """Every invalid value, one message each (empty when valid)."""
        errs: list[str] = []
        positive = ("vocab_size", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                    "num_layers_L", "num_layers_H", "max_position_embeddings",
                    "make_vocab_size_divisible_by", "tensor_parallel_size")
        for name in positive:
            if getattr(self, name) < 1:
                errs.append(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.h_cycles < 1:
            errs.append(f"model.h_cycles must be >= 1, got {self.h_cycles}")
        if self.l_cycles < 1:
            errs.append(f"model.l_cycles must be >= 1, got {self.l_cycles}")
        if self.num_attention_heads >= 1 and self.hidden_size % self.num_attention_heads:
            errs.append(
                f"model.hidden_size ({self.hidden_size}) is not divisible by "
                f"model.num_attention_heads ({self.num_attention_heads})"
            )
        elif self.num_attention_heads >= 1 and self.head_dim % 2:
            errs.append(f"head dim {self.head_dim} must be even for RoPE")
        tp = self.tensor_parallel_size
        if tp >= 1:
            if self.num_attention_heads % tp:
                errs.append(
                    f"model.tensor_parallel_size ({tp}) does not divide "
                    f"model.num_attention_heads ({self.num_attention_heads})"
                )
            if self.ffn_hidden_size % tp:
                errs.append(
                    f"model.tensor_parallel_size ({tp}) does not divide "
                    f"model.ffn_hidden_size ({self.ffn_hidden_size})"
                )
        if self.h_cycles >= 1 and self.l_cycles >= 1 and not 1 <= self.bp_window <= self.depth:
            errs.append(
                f"model.bp_window must be in 1..{self.depth} (h_cycles * (l_cycles + 1)), "
                f"got {self.bp_window}"
            )
        if self.window_policy not in WINDOW_POLICIES:
            errs.append(
                f"model.window_policy must be one of {', '.join(WINDOW_POLICIES)}, "
                f"got {self.window_policy!r}"
            )
        if self.params_dtype not in PARAMS_DTYPES:
            errs.append(f"model.params_dtype must be one of {PARAMS_DTYPES}, got {self.params_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            errs.append(
                f"model.attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        for name, allowed in (("layer_backend", LAYER_BACKENDS), ("fp8", FP8_RECIPES)):
            if getattr(self, name) not in allowed:
                errs.append(f"model.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.fp8 != "none" and self.layer_backend == "local":
            errs.append(f"model.fp8={self.fp8} needs model.layer_backend te (or auto), not local")
        if self.recompute not in RECOMPUTE:
            errs.append(f"model.recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.loss_chunk_tokens < 0:
            errs.append(f"model.loss_chunk_tokens must be >= 0, got {self.loss_chunk_tokens}")
        if self.norm_eps <= 0:
            errs.append(f"model.norm_eps must be > 0, got {self.norm_eps}")
        if self.rope_theta <= 0:
            errs.append(f"model.rope_theta must be > 0, got {self.rope_theta}")
        return errs

    def validate(self) -> "ModelConfig":
        errs = self.errors()
        if errs:
            raise ConfigError("invalid model configuration:\n  - " + "\n  - ".join(errs))
        if self.padded_vocab_size != self.vocab_size:
            log.info(
                "vocab_size %d padded to %d (multiple of %d x TP %d) for the vocab-parallel "
                "embedding and head; the padded logits are masked out of the loss",
                self.vocab_size, self.padded_vocab_size,
                self.make_vocab_size_divisible_by, self.tensor_parallel_size,
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _structured_merge(schema: type, sources: Sequence[Any], what: str) -> Any:
    """Merge YAML/dict/dotlist sources onto a typed schema, turning OmegaConf errors into one line."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), *sources)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"invalid {what} configuration{f' at {key}' if key else ''}: {msg}") from None


def model_config_from_dict(values: dict[str, Any], overrides: Sequence[str] = ()) -> ModelConfig:
    """Typed ModelConfig from a plain dict plus `key=value` overrides, validated."""
    sources = [OmegaConf.create(values)]
    if overrides:
        sources.append(OmegaConf.from_dotlist([_strip_prefix(o, "model.") for o in overrides]))
    cfg = _structured_merge(ModelConfig, sources, "model")
    return cfg.validate()


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ModelConfig:
    """Load a model YAML (``configs/model/*.yaml``) with ``key=value`` overrides and validate it.

    A YAML with a top-level ``model:`` section (a run config) is accepted too; its model part
    is returned.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as exc:  # YAML syntax errors
        raise ConfigError(f"cannot parse {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of model settings")
    if "model" in raw and isinstance(raw["model"], dict):
        raw = raw["model"]
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown model setting(s): {', '.join(unknown)}")
    return model_config_from_dict(raw, overrides)


def _strip_prefix(override: str, prefix: str) -> str:
    return override[len(prefix):] if override.startswith(prefix) else override

