"""Model configuration: what the model is, how it computes, and how it is split over ranks.

:class:`ModelShape` is what a checkpoint records and a resume must match. A
:class:`ModelConfig` is a shape plus two sub-objects that are this run's or this machine's choice:
``execution`` (:class:`ExecutionConfig`: kernels, FP8, compile, recompute, loss chunking) and
``parallel`` (:class:`ParallelConfig`: tensor and sequence parallelism). A model YAML holds the
shape; the two sub-objects are YAML sections of their own::

    hidden_size: 256                          # shape, top level
    execution: {attention_backend: dense}     # overrides: execution.attention_backend=dense
    parallel: {tensor_parallel_size: 2}       # overrides: parallel.tensor_parallel_size=2

Sections are typed and merged key by key (:func:`~mimir_megatron.yaml_config.typed_section`), so
every mistake found, of every kind, is reported together, one line each, in a single
:class:`ConfigError`. Reading YAML files and merging overrides is :mod:`mimir_megatron.yaml_config`'s.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, Sequence

from mimir_megatron.yaml_config import merge_overrides, plain, raise_errors, read_yaml, typed_section

log = logging.getLogger(__name__)


# -- choices (str enums: YAML and overrides stay plain strings) ---------------------------------


class WindowPolicy(StrEnum):
    last_k = "last_k"
    h_first = "h_first"


class ParamsDtype(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class AttentionBackend(StrEnum):
    auto = "auto"
    dense = "dense"
    flex = "flex"
    varlen = "varlen"


class LayerBackend(StrEnum):
    auto = "auto"
    local = "local"
    te = "te"


class Fp8Recipe(StrEnum):
    none = "none"
    delayed = "delayed"
    current = "current"
    mxfp8 = "mxfp8"


class Recompute(StrEnum):
    none = "none"
    selective = "selective"
    full = "full"


# -- the three parts -----------------------------------------------------------------------------


@dataclass
class ModelShape:
    """What an HRM-Text model is (defaults: the Mimir "XL" shape); recorded with its weights."""

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
    window_policy: WindowPolicy = WindowPolicy.last_k
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
    params_dtype: ParamsDtype = ParamsDtype.float32
    """Storage dtype of the weights: float32 (CPU, master weights) or bfloat16 (inference, export,
    and training with `optim.distributed_optimizer`, which keeps an fp32 main copy)."""
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
    def effective_embedding_scale(self) -> float:
        if self.embedding_scale is None:
            return math.sqrt(self.hidden_size)
        return self.embedding_scale

    def shape_errors(self) -> list[str]:
        errs: list[str] = []
        positive = ("vocab_size", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                    "num_layers_L", "num_layers_H", "max_position_embeddings",
                    "make_vocab_size_divisible_by", "h_cycles", "l_cycles")
        for name in positive:
            if getattr(self, name) < 1:
                errs.append(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads >= 1 and self.hidden_size % self.num_attention_heads:
            errs.append(
                f"model.hidden_size ({self.hidden_size}) is not divisible by "
                f"model.num_attention_heads ({self.num_attention_heads})"
            )
        elif self.num_attention_heads >= 1 and self.head_dim % 2:
            errs.append(f"head dim {self.head_dim} must be even for RoPE")
        if self.h_cycles >= 1 and self.l_cycles >= 1 and not 1 <= self.bp_window <= self.depth:
            errs.append(
                f"model.bp_window must be in 1..{self.depth} (h_cycles * (l_cycles + 1)), "
                f"got {self.bp_window}"
            )
        if self.norm_eps <= 0:
            errs.append(f"model.norm_eps must be > 0, got {self.norm_eps}")
        if self.rope_theta <= 0:
            errs.append(f"model.rope_theta must be > 0, got {self.rope_theta}")
        return errs

    def shape_dict(self) -> dict[str, Any]:
        """The shape alone, plain values: what checkpoints and project weights record."""
        return {f.name: plain(getattr(self, f.name)) for f in fields(ModelShape)}


@dataclass
class ExecutionConfig:
    """How the model computes: free to change between a checkpoint's save and its resume or export."""

    attention_backend: AttentionBackend = AttentionBackend.auto
    """PrefixLM attention from `kernels/`: `dense` (boolean mask + SDPA, the CPU reference),
    `flex` (FlexAttention block mask, compiled on GPU), `varlen` (two-pass variable-length
    flash attention, GPU); `auto` picks flex on GPU and dense on CPU."""
    layer_backend: LayerBackend = LayerBackend.auto
    """Linear layers of the L/H stacks: `local` (megatron's own, CPU and GPU) or `te`
    (Transformer Engine, needed for FP8); `auto` picks te where it imports on a GPU."""
    fp8: Fp8Recipe = Fp8Recipe.none
    """FP8 recipe of the Transformer Engine linears: none (bf16), delayed or current scaling
    (Hopper), mxfp8 (Blackwell). Needs layer_backend te (or auto resolving to it)."""
    compile: bool = False
    """torch.compile each module application (the L and H stacks) on GPU."""
    recompute: Recompute = Recompute.none
    """Activation recompute in the applications with grad: none, selective (core attention) or
    full (every layer's input is kept, the layer recomputed in backward)."""
    loss_chunk_tokens: int = 0
    """Tokens per chunk of the fused head + cross-entropy used in training (0: plain head and
    loss over the whole micro-batch). Chunking keeps the full fp32 logits from existing at once."""

    def errors(self) -> list[str]:
        errs = []
        if self.fp8 != Fp8Recipe.none and self.layer_backend == LayerBackend.local:
            errs.append(f"model.execution.fp8={self.fp8} needs model.execution.layer_backend te "
                        "(or auto), not local")
        if self.loss_chunk_tokens < 0:
            errs.append(f"model.execution.loss_chunk_tokens must be >= 0, got {self.loss_chunk_tokens}")
        return errs


@dataclass
class ParallelConfig:
    """How the model is split over ranks: free to change between save and resume."""

    tensor_parallel_size: int = 1
    """Tensor-parallel ranks that split each layer (must divide the heads and the FFN width)."""
    sequence_parallel: bool = True
    """Shard activations along the sequence between TP regions (only used when TP > 1)."""


@dataclass
class ModelConfig(ModelShape):
    """A model shape plus how it computes (``execution``) and is split (``parallel``)."""

    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def shape(self) -> ModelShape:
        return ModelShape(**{f.name: getattr(self, f.name) for f in fields(ModelShape)})

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by * self.parallel.tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def uses_sequence_parallel(self) -> bool:
        return self.parallel.sequence_parallel and self.parallel.tensor_parallel_size > 1

    def errors(self) -> list[str]:
        """Every invalid value, one message each (empty when valid)."""
        errs = self.shape_errors() + self.execution.errors()
        tp = self.parallel.tensor_parallel_size
        if tp < 1:
            errs.append(f"model.parallel.tensor_parallel_size must be >= 1, got {tp}")
        else:
            for name in ("num_attention_heads", "ffn_hidden_size"):
                if getattr(self, name) >= 1 and getattr(self, name) % tp:
                    errs.append(f"model.parallel.tensor_parallel_size ({tp}) does not divide "
                                f"model.{name} ({getattr(self, name)})")
        return errs

    def validate(self) -> "ModelConfig":
        raise_errors(self.errors(), "invalid model configuration")
        if self.padded_vocab_size != self.vocab_size:
            log.info(
                "vocab_size %d padded to %d (multiple of %d x TP %d) for the vocab-parallel "
                "embedding and head; the padded logits are masked out of the loss",
                self.vocab_size, self.padded_vocab_size,
                self.make_vocab_size_divisible_by, self.parallel.tensor_parallel_size,
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return plain(asdict(self))


# Keys a model section held before the split: named in the error, never silently accepted.
_MOVED = {**{f.name: f"execution.{f.name}" for f in fields(ExecutionConfig)},
          **{f.name: f"parallel.{f.name}" for f in fields(ParallelConfig)}}


# -- loading -------------------------------------------------------------------------------------


def model_config_from_dict(values: dict[str, Any], overrides: Sequence[str] = ()) -> ModelConfig:
    """Typed ModelConfig from a plain dict plus `key=value` overrides, validated."""
    errors: list[str] = []
    cfg = model_section(values, overrides, errors)
    raise_errors(errors, "invalid model configuration")
    return cfg.validate()


def model_section(values: dict[str, Any], overrides: Sequence[str], errors: list[str]) -> ModelConfig:
    """The model section (a dict, then `key=value` overrides on it); mistakes go to ``errors``,
    its value checks included."""
    tree = merge_overrides(values, overrides, "model.", errors)
    cfg = typed_section(ModelConfig, tree, "model", errors, moved=_MOVED)
    errors += cfg.errors()
    return cfg


def model_config_from_record(record: dict[str, Any], overrides: Sequence[str] = ()) -> ModelConfig:
    """A recorded shape (a checkpoint's ``trainer_state.json``, project weights' ``model.yaml``)
    with this machine's default execution and the given overrides (e.g. the parallel layout).

    Records written before the split also hold execution and layout keys: those were the
    writer's choices, not the model's, and are dropped."""
    shape = {f.name for f in fields(ModelShape)}
    return model_config_from_dict({k: v for k, v in record.items() if k in shape}, overrides)


def model_yaml(path: str | Path) -> dict[str, Any]:
    """The settings of a model YAML; a run config's ``model:`` section is accepted too."""
    raw = read_yaml(path, "model settings")
    if "model" in raw and isinstance(raw["model"], dict):
        raw = {k: v for k, v in raw["model"].items() if k != "config"}
    return raw


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ModelConfig:
    """Load a model YAML (``configs/model/*.yaml``) with ``key=value`` overrides and validate it.

    A YAML with a top-level ``model:`` section (a run config) is accepted too; its model part
    is returned.
    """
    raw = model_yaml(path)
    errors: list[str] = []
    cfg = model_section(raw, overrides, errors)
    raise_errors(errors, f"invalid model configuration ({path})")
    return cfg.validate()
