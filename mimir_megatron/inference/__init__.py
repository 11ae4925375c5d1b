"""Inference on trained models: the recurrence-aware KV cache, batched decoding, scoring, serving.

Imports the model, never the trainer (the trainer imports this package for its evaluation).

- :mod:`~mimir_megatron.inference.kv_cache`: one cache slot per (module application, layer),
  one row per request.
- :mod:`~mimir_megatron.inference.step`: a generation step as one flattened forward pass
  (decoding rows and joining prompts together).
- :mod:`~mimir_megatron.inference.engine`: the model's forward passes (a generation step, a
  whole batch) and the entry points ``generate`` and ``score``.
- :mod:`~mimir_megatron.inference.requests`: every check of a request (``RequestLimits``,
  ``RequestError``).
- :mod:`~mimir_megatron.inference.session`: decoding sessions, rows joining at step boundaries.
- :mod:`~mimir_megatron.inference.scoring`: continuation log-probabilities.
- :mod:`~mimir_megatron.inference.loading`: engines from checkpoints, weights or HF directories.
- :mod:`~mimir_megatron.inference.grammar`: structured output (llguidance, the ``serve`` extra):
  a grammar per request masks its own row's logits at each decoding step.
- :mod:`~mimir_megatron.inference.tool_calls`: the chat template's tool-call syntax, parsed back.
- :mod:`~mimir_megatron.inference.server`: the OpenAI-compatible ``mimir serve``.
"""

from mimir_megatron.lazy import lazy_exports

# Imported on first use: the CLI imports this package to register its commands.
__getattr__ = lazy_exports(__name__, {
    "DecodeSession": ".session", "InferenceEngine": ".engine", "RequestError": ".requests",
    "KVCache": ".kv_cache",
    "load_engine": ".loading",
    "GenerationRequest": ".types", "GenerationResult": ".types", "SamplingParams": ".types",
    "ScoreResult": ".types", "TokenEvent": ".types",
})
__all__ = [
    "DecodeSession",
    "GenerationRequest",
    "GenerationResult",
    "InferenceEngine",
    "KVCache",
    "RequestError",
    "SamplingParams",
    "ScoreResult",
    "TokenEvent",
    "load_engine",
]
