"""Build an inference engine from a training checkpoint, project weights or a transformers directory.

Never imports the trainer: a training checkpoint's weights (or its EMA) are read through the
sharded-state layout of :mod:`mimir_megatron.model.sharded`, the one the trainer writes.
Weights are read with dist_checkpointing (training checkpoints: its metadata is read by torch's
checkpoint reader, which unpickles, so load only checkpoints you trust) or safetensors (project
weights, transformers directories: nothing is unpickled).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from mimir_megatron.errors import UserError
from mimir_megatron.inference.engine import InferenceEngine

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"


def _inference_overrides(tensor_parallel_size: int) -> list[str]:
    # Decoding feeds one token per row, so the sequence is never split across TP ranks. (Kernels
    # and layer implementation stay this machine's defaults: recorded shapes carry none.)
    return [f"parallel.tensor_parallel_size={tensor_parallel_size}", "parallel.sequence_parallel=false"]


def load_checkpoint_model(path: str | Path, ema: bool = False, tensor_parallel_size: int = 1):
    """The model of a training checkpoint directory (``step_N``, or a run's checkpoint directory,
    whose ``latest`` is followed), with its trained or EMA weights."""
    from megatron.core import dist_checkpointing

    from mimir_megatron.config import model_config_from_record
    from mimir_megatron.model import build_model
    from mimir_megatron.model.sharded import ema_sharded_state, model_sharded_state

    path = resolve_checkpoint(Path(path))
    state = json.loads((path / TRAINER_STATE).read_text())
    if ema and state["config"]["optim"]["ema_decay"] == 0:
        raise UserError(f"{path} was trained without an EMA (optim.ema_decay = 0)")
    cfg = model_config_from_record(state["model"], _inference_overrides(tensor_parallel_size))
    model = build_model(cfg)
    model_sd = model_sharded_state(model)
    sharded = {"model": model_sd}
    shadow = None
    if ema:
        shadow = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        sharded["ema"] = ema_sharded_state(model, model_sd, shadow)
    loaded = dist_checkpointing.load(sharded, str(path))
    model.load_state_dict(loaded["model"], strict=False)
    if shadow is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(loaded["ema"][name])
    return model


def resolve_checkpoint(path: Path) -> Path:
    """``path`` itself if it is one checkpoint, else the one its ``latest`` file names."""
    if (path / TRAINER_STATE).is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        named = path / latest.read_text().strip()
        if (named / TRAINER_STATE).is_file():
            return named
        raise UserError(f"{latest} names {named.name}, which is not a complete checkpoint")
    raise UserError(f"{path} is not a training checkpoint (no {TRAINER_STATE}, no latest)")


def _tokenizer(directory: str | Path | None):
    if not directory or not (Path(directory) / "tokenizer.json").is_file():
        return None
    from mimir_megatron.chat import load_tokenizer

    return load_tokenizer(directory)


def load_engine(
    *,
    checkpoint: str | Path | None = None,
    ema: bool = False,
    weights: str | Path | None = None,
    hf: str | Path | None = None,
    tokenizer: str | Path | None = None,
    tensor_parallel_size: int = 1,
    max_batch_size: int = 32,
    max_context: int | None = None,
) -> InferenceEngine:
    """An engine over exactly one of: a training ``checkpoint`` (optionally its ``ema`` weights),
    project ``weights`` (``mimir import`` output) or a transformers ``hf`` directory.

    The tokenizer comes from ``tokenizer``, else from the model's own directory or config.
    """
    sources = [s for s in (checkpoint, weights, hf) if s is not None]
    if len(sources) != 1:
        raise UserError("give exactly one of a training checkpoint, project weights or an HF directory")
    source = Path(sources[0])
    if not source.is_dir():
        raise UserError(f"model directory not found: {source}")
    if ema and checkpoint is None:
        raise UserError("--ema needs a training checkpoint (project weights and HF directories hold no EMA)")
    overrides = _inference_overrides(tensor_parallel_size)
    if checkpoint is not None:
        model = load_checkpoint_model(source, ema=ema, tensor_parallel_size=tensor_parallel_size)
        fallback = model.cfg.tokenizer
    elif weights is not None:
        from mimir_megatron.interop import load_weights

        model = load_weights(source, overrides)
        fallback = source if (source / "tokenizer.json").is_file() else model.cfg.tokenizer
    else:
        from mimir_megatron.interop import import_hf

        model = import_hf(source, overrides)
        fallback = source
    tok = _tokenizer(tokenizer or fallback)
    if tok is None:
        log.warning("no tokenizer found for %s: the engine takes and returns token ids only", source)
    name = source.name if source.name not in ("latest", "") else source.parent.name
    return InferenceEngine(
        model, tok, max_batch_size=max_batch_size, max_context=max_context, model_name=name
    )
