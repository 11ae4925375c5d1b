"""Build an inference engine from a training checkpoint, project weights or a transformers directory.

Never imports the trainer: a training checkpoint (a ``step_N`` directory or a checkpoints
directory) is read by :mod:`mimir_megatron.checkpoint`, with dist_checkpointing (its metadata is
read by torch's checkpoint reader, which unpickles, so load only checkpoints you trust). Project
weights and transformers directories are read with safetensors (nothing is unpickled).
"""

from __future__ import annotations

import logging
from pathlib import Path

from mimir_megatron import checkpoint as checkpoint_pkg
from mimir_megatron.errors import UserError
from mimir_megatron.inference.engine import InferenceEngine

log = logging.getLogger(__name__)


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
    compile_decode: bool = False,
) -> InferenceEngine:
    """An engine over exactly one of: a training ``checkpoint`` (optionally its ``ema`` weights),
    project ``weights`` (``mimir import`` output) or a transformers ``hf`` directory.

    The tokenizer comes from ``tokenizer``, else from the model's own directory or config.
    ``compile_decode``: see :class:`InferenceEngine`.
    """
    sources = [s for s in (checkpoint, weights, hf) if s is not None]
    if len(sources) != 1:
        raise UserError("give exactly one of a training checkpoint, project weights or an HF directory")
    source = Path(sources[0])
    if not source.is_dir():
        raise UserError(f"model directory not found: {source}")
    if ema and checkpoint is None:
        raise UserError("--ema needs a training checkpoint (project weights and HF directories hold no EMA)")
    overrides = checkpoint_pkg.execution_overrides(tensor_parallel_size)
    if checkpoint is not None:
        model = checkpoint_pkg.load_model(source, ema=ema, tensor_parallel_size=tensor_parallel_size)
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
        model, tok, max_batch_size=max_batch_size, max_context=max_context, model_name=name,
        compile_decode=compile_decode,
    )
