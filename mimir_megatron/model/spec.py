"""The one place that chooses the layer implementation (megatron "spec") for a layer backend.

Both backends build the same layer: parameterless RMSNorm, then gated attention (megatron's
``attention_output_gate``: a sigmoid gate from the fused qkv projection) with our PrefixLM core
attention from ``kernels/``, then a SwiGLU MLP (``model/swiglu.py`` in megatron's activation
slot), no biases. They differ only in the linears:

- ``local``: megatron's own tensor-parallel linears (CPU and GPU; the reference in tests).
- ``te``: Transformer Engine linears (GPU; bf16 or FP8 through TE recipes). TE's fused
  norm + linear is deliberately not used: it carries a learnable norm weight, and HRM-Text's
  norms have none. Keeping our norm module in the slot keeps its semantics identical on both
  paths; the gate is megatron's arithmetic on both (``model/gate.py``: bf16 keeps no fp32
  sigmoid for backward).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mimir_megatron.model.attention import PrefixLMCoreAttention
from mimir_megatron.model.gate import GatedSelfAttention
from mimir_megatron.model.norm import ParameterlessRMSNorm
from mimir_megatron.model.swiglu import SwiGLU

BACKENDS = ("local", "te")


class GroupedRowParallelLinear(RowParallelLinear):
    """megatron's RowParallelLinear, handing its own TP group to its matmul.

    megatron-core 0.19's ``RowParallelLinear.forward`` passes ``tp_group=None`` to
    ``_forward_impl``, so every call looks the group up again and raises a ``tp_group is None``
    DeprecationWarning (two per layer per forward: 32 per decoded token at the tiny shape).
    """

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group") is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)


class _LocalProvider(LocalSpecProvider):
    def row_parallel_linear(self) -> type[RowParallelLinear]:
        return GroupedRowParallelLinear


def _provider(backend: str) -> BackendSpecProvider:
    if backend == "local":
        return _LocalProvider()
    if backend == "te":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        class UnfusedNormTESpecProvider(TESpecProvider):
            def fuse_layernorm_and_linear(self) -> bool:
                return False  # our parameterless norm stays a separate module

        return UnfusedNormTESpecProvider()
    raise ValueError(f"unknown layer backend {backend!r}; available: {', '.join(BACKENDS)}")


def block_spec(num_layers: int, backend: str = "local") -> TransformerBlockSubmodules:
    """Layers of one stack: pre-norm gated attention + SwiGLU MLP, then a parameterless exit norm."""
    provider = _provider(backend)
    mlp = get_mlp_module_spec_for_backend(backend=provider)
    # Our SwiGLU in megatron's MLP activation slot (read because transformer_config sets
    # use_te_activation_func; without this module megatron would apply a plain silu there).
    submodules = replace(mlp.keywords["submodules"], activation_func=SwiGLU)
    mlp = partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ParameterlessRMSNorm,
            self_attention=ModuleSpec(
                module=GatedSelfAttention,  # megatron's, without an fp32 sigmoid kept
                # The PrefixLM layout over packed samples always comes from the batch.
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
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=ParameterlessRMSNorm)
