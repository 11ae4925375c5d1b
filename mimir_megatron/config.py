"""Model configuration: what the model is, how it computes, and how it is split over ranks.

:class:`ModelShape` is what a checkpoint records and a resume must match. A
:class:`ModelConfig` is a shape plus two sub-objects that are this run's or this machine's choice:
``execution`` (:class:`ExecutionConfig`: kernels, FP8, compile, recompute, loss chunking) and
``parallel`` (:class:`ParallelConfig`: tensor and sequence parallelism). A model YAML holds the
shape; the two sub-objects are YAML sections of their own::

    hidden_size: 256                          # shape, top level
    execution: {attention_backend: dense}     # overrides: execution.attention_backend=dense
    parallel: {tensor_parallel_size: 2}       # overrides: parallel.tensor_parallel_size=2

Sections are typed and merged key by key (:func:`typed_section`), so every mistake found, of
every kind, is reported together, one line each, in a single :class:`ConfigError`.
"""

from __future__ import annotations

import logging
import math
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mimir_megatron.errors import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")


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
        return {f.name: _plain(getattr(self, f.name)) for f in fields(ModelShape)}


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
        return _plain(asdict(self))


# Keys a model section held before the split: named in the error, never silently accepted.
_MOVED = {**{f.name: f"execution.{f.name}" for f in fields(ExecutionConfig)},
          **{f.name: f"parallel.{f.name}" for f in fields(ParallelConfig)}}


# -- typed sections, every mistake collected ---------------------------------------------------


def typed_section(schema: type[T], values: Any, prefix: str, errors: list[str]) -> T:
    """``values`` (a mapping from YAML) typed by the dataclass ``schema``, key by key: each
    unknown key and each value of the wrong type appends one line to ``errors`` and leaves that
    field at its default, so that one pass reports every mistake. Nested dataclass fields are
    sections of their own (``prefix.field.key``)."""
    node = OmegaConf.structured(schema)
    _fill(node, schema, values, prefix, errors)
    return OmegaConf.to_object(node)


def _fill(node: DictConfig, schema: type, values: Any, prefix: str, errors: list[str]) -> None:
    if values is None:
        return
    if not isinstance(values, dict):
        errors.append(f"{prefix} must be a mapping of settings, got {values!r}")
        return
    hints = typing.get_type_hints(schema)
    known = [f.name for f in fields(schema)]
    for key, value in values.items():
        name = f"{prefix}.{key}"
        if key not in known:
            moved = _MOVED.get(key) if issubclass(schema, ModelShape) else None
            errors.append(f"{name} is not a setting: it is now {prefix}.{moved}" if moved else
                          f"{name} is not a setting (known: {', '.join(known)})")
        elif is_dataclass(hints[key]):
            _fill(node[key], hints[key], value, name, errors)
        else:
            try:
                OmegaConf.update(node, key, value, merge=False)
            except OmegaConfBaseException as exc:
                errors.append(_type_error(name, hints[key], value, exc))


def _type_error(name: str, hint: Any, value: Any, exc: Exception) -> str:
    choices = [a for a in typing.get_args(hint) if isinstance(a, type) and issubclass(a, Enum)]
    enum = hint if isinstance(hint, type) and issubclass(hint, Enum) else (choices[0] if choices else None)
    if enum is not None:
        return f"{name} must be one of {', '.join(m.value for m in enum)}, got {value!r}"
    return f"{name}: {str(exc).splitlines()[0]}"


def raise_errors(errors: Sequence[str], what: str) -> None:
    """One :class:`ConfigError` listing every mistake, one line each."""
    if errors:
        raise ConfigError(f"{what}:\n  - " + "\n  - ".join(errors))


def _plain(value: Any) -> Any:
    """Enums to their strings, recursively (JSON, YAML and MLflow params hold plain values)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


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
    tree = dict(values)
    if overrides:
        try:
            dotlist = OmegaConf.from_dotlist([_strip_prefix(o, "model.") for o in overrides])
            tree = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(tree), dotlist))
        except OmegaConfBaseException as exc:
            errors.append(f"model overrides {list(overrides)}: {str(exc).splitlines()[0]}")
    cfg = typed_section(ModelConfig, tree, "model", errors)
    errors += cfg.errors()
    return cfg


def model_config_from_record(record: dict[str, Any], overrides: Sequence[str] = ()) -> ModelConfig:
    """A recorded shape (a checkpoint's ``trainer_state.json``, project weights' ``model.yaml``)
    with this machine's default execution and the given overrides (e.g. the parallel layout).

    Records written before the split also hold execution and layout keys: those were the
    writer's choices, not the model's, and are dropped."""
    shape = {f.name for f in fields(ModelShape)}
    return model_config_from_dict({k: v for k, v in record.items() if k in shape}, overrides)


def yaml_problem(path: str | Path, exc: BaseException) -> str:
    """One line for a YAML file that cannot be read: the file and line, and what is wrong."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"{path}:{mark.line + 1}: invalid YAML ({getattr(exc, 'problem', None) or 'syntax error'})"
    if isinstance(exc, UnicodeDecodeError):
        return f"{path}: not UTF-8 text (byte {exc.start})"
    if isinstance(exc, OSError):
        return f"{path}: cannot read ({exc.strerror or exc})"
    return f"cannot parse {path}: {' '.join(str(exc).split())}"


def read_yaml(path: str | Path, what: str, overrides: Sequence[str] = (), kind: str = "config file"
              ) -> dict[str, Any]:
    """A YAML file's mapping with ``key=value`` ``overrides`` merged in (interpolations resolved),
    or a one-line ConfigError naming the file (and line). Every configuration the project reads
    (model, train, mixture, eval suite, prepare, synth pipeline, GPU table) comes through here;
    what a file holds is then checked by :func:`typed_section` and listed by :func:`raise_errors`.
    ``what``: what the mapping holds; ``kind``: what the file is, for a missing one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{kind} not found: {path}")
    try:
        loaded = OmegaConf.load(path)
        # In place, key by key: ``section.key=v`` sets a setting, ``datasets.0.repeat=2`` an item.
        loaded.merge_with_dotlist(list(overrides))
        raw = OmegaConf.to_container(loaded, resolve=True)
    except Exception as exc:  # YAML syntax, not UTF-8, unreadable, malformed overrides
        problem = yaml_problem(path, exc)
        if problem.startswith("cannot parse") and overrides:
            problem += f" (overrides {list(overrides)})"
        raise ConfigError(problem) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of {what}")
    return raw


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


def _strip_prefix(override: str, prefix: str) -> str:
    return override[len(prefix):] if override.startswith(prefix) else override
