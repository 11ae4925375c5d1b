"""The one place that chooses the layer implementation (megatron "spec") for a backend."""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mimir_megatron.model.attention import PrefixLMCoreAttention
from mimir_megatron.model.norm import ParameterlessRMSNorm

BACKENDS = ("local",)


def block_spec(num_layers: int, backend: str = "local") -> TransformerBlockSubmodules:
    """Layers of one stack: pre-norm gated attention + SwiGLU MLP, then a parameterless exit norm.

    ``local`` uses megatron's own parallel linears (CPU and GPU); the Transformer Engine spec for
    GPUs plugs in here.
    """
    if backend != "local":
        raise ValueError(f"unknown layer backend {backend!r}; available: {BACKENDS}")
    provider = LocalSpecProvider()
    layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ParameterlessRMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                # The mask is always given explicitly (PrefixLM over packed samples).
                params={"attn_mask_type": AttnMaskType.arbitrary},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=provider.column_parallel_linear(),
                    core_attention=PrefixLMCoreAttention,
                    linear_proj=provider.row_parallel_linear(),
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=ParameterlessRMSNorm,
            mlp=get_mlp_module_spec_for_backend(backend=provider),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=ParameterlessRMSNorm)
