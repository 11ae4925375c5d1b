"""Attention and loss kernels for PrefixLM packed batches, with their CPU references.

Installed as the package ``mimir_kernels`` (not ``kernels``, which would shadow Hugging Face's
``kernels`` library). Imports only torch.
"""

from mimir_kernels.attention import (
    ATTENTION_BACKENDS,
    PrefixLMLayout,
    build_layout,
    cached_prefix_lm_attention,
    prefix_lm_attention,
)
from mimir_kernels.prefix_lm import dense_prefix_lm_attention, prefix_lm_mask
from mimir_kernels.vocab_loss import chunked_vocab_parallel_cross_entropy

__all__ = [
    "ATTENTION_BACKENDS",
    "PrefixLMLayout",
    "build_layout",
    "cached_prefix_lm_attention",
    "chunked_vocab_parallel_cross_entropy",
    "dense_prefix_lm_attention",
    "prefix_lm_attention",
    "prefix_lm_mask",
]
