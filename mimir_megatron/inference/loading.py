"""Build an inference engine from a training checkpoint, project weights or a transformers directory.

Never imports the trainer: a training checkpoint (a ``step_N`` directory or a checkpoints
directory) is read by :mod:`mimir_megatron.checkpoint`, with dist_checkpointing (its metadata is
read by torch's checkpoint reader, which unpickles, so load only checkpoints you trust). Project
weights and transformers directories are read with safetensors (nothing is unpickled).
"""

from __future__ import annotations

import logging
from pathlib import Path

from mimir_megatron import backend
from mimir_megatron import checkpoint as checkpoint_pkg
from mimir_megatron.inference.engine import InferenceEngine

log = logging.getLogger(__name__)


def load_engine(
    *,
    model: str | Path | checkpoint_pkg.ModelDir | None = None,
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
    """An engine over exactly one of: a ``model`` directory of any form (recognised by
    :func:`mimir_megatron.checkpoint.resolve_model_dir`, or the command's model value already
    resolved: a :class:`~mimir_megatron.checkpoint.ModelDir`), a training ``checkpoint`` (optionally its
    ``ema`` weights), project ``weights`` (``mimir import`` output) or a transformers ``hf`` directory.

    The tokenizer comes from ``tokenizer``, else from the model's own directory or config.
    ``compile_decode``: see :class:`InferenceEngine`.

    Loads on a thread of its own (:func:`mimir_megatron.backend.run_in_own_thread`): the thread
    that decodes afterwards, a server's scheduler, then owns the process's only CPU thread pool.
    """
    return backend.run_in_own_thread(lambda: _load(
        model=model, checkpoint=checkpoint, ema=ema, weights=weights, hf=hf, tokenizer=tokenizer,
        tensor_parallel_size=tensor_parallel_size, max_batch_size=max_batch_size,
        max_context=max_context, compile_decode=compile_decode))


def _load(*, model, checkpoint, ema, weights, hf, tokenizer, tensor_parallel_size, max_batch_size,
          max_context, compile_decode) -> InferenceEngine:
    if isinstance(model, checkpoint_pkg.ModelDir) and checkpoint is weights is hf is None:
        found = model
    else:
        found = checkpoint_pkg.resolve_model_dir(model=model, checkpoint=checkpoint, weights=weights, hf=hf)
    source = found.path
    net = found.load(ema=ema, tensor_parallel_size=tensor_parallel_size)
    tok_dir = found.tokenizer_or(tokenizer)
    tok = None
    if tok_dir is not None and (tok_dir / "tokenizer.json").is_file():
        from mimir_megatron.chat import load_tokenizer

        tok = load_tokenizer(tok_dir)
    if tok is None:
        log.warning("no tokenizer found for %s: the engine takes and returns token ids only", source)
    return InferenceEngine(
        net, tok, max_batch_size=max_batch_size, max_context=max_context,
        model_name=found.served_name,
        compile_decode=compile_decode,
    )
