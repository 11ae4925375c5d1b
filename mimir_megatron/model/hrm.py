"""HRM-Text on megatron-core: two transformer stacks applied in the LLLHLLLH recurrence.

Layout: megatron's ``[seq, batch, hidden]`` inside the model (sequence-sharded across TP ranks
when sequence parallel is on); ``[batch, seq, ...]`` at the interface (the Batch and the logits).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from mimir_kernels import PrefixLMLayout, build_layout, chunked_vocab_parallel_cross_entropy

from mimir_megatron import backend
from mimir_megatron.batch import IGNORE_INDEX, Batch, BatchError
from mimir_megatron.config import ModelConfig
from mimir_megatron.model.init import lecun_normal_, vocab_rows_init, z_l_init_
from mimir_megatron.model.attention import RotaryLayout
from mimir_megatron.model.rope import RotaryTable, rotary_angles
from mimir_megatron.model.spec import block_spec
from mimir_megatron.model.window import WindowPlan, plan_window, schedule


@dataclass
class ModelOutput:
    logits: torch.Tensor | None
    """``[batch, seq, vocab_size]`` (full vocabulary, gathered across TP), unless not requested."""
    loss: torch.Tensor | None
    """Sum of response-token cross-entropy divided by the supervised-token count."""
    num_supervised: torch.Tensor | None
    """Supervised tokens in this batch (labels != -100)."""
    window: WindowPlan
    """The applications that ran with grad."""


def transformer_config(cfg: ModelConfig, num_layers: int) -> TransformerConfig:
    """Megatron's config for one stack of the HRM-Text layer."""
    dtype = torch.bfloat16 if cfg.params_dtype == "bfloat16" else torch.float32
    recompute = {
        "none": {},
        "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
        "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    }[cfg.execution.recompute]
    # TE recipes: e4m3 forward / e5m2 gradients ("hybrid"); MXFP8 blocks use e4m3 throughout.
    fp8 = {
        "none": {},
        "delayed": dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024,
                        fp8_amax_compute_algo="max"),
        "current": dict(fp8="hybrid", fp8_recipe="tensorwise"),
        "mxfp8": dict(fp8="e4m3", fp8_recipe="mxfp8"),
    }[cfg.execution.fp8]
    return TransformerConfig(
        **recompute,
        **fp8,
        num_layers=num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_attention_heads,
        kv_channels=cfg.head_dim,
        tensor_model_parallel_size=cfg.parallel.tensor_parallel_size,
        sequence_parallel=cfg.uses_sequence_parallel,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        # Megatron's MLP then calls the activation module of the spec (model/swiglu.py: SwiGLU in
        # one autograd node, bit-identical to its unfused glu); the flag's name says TE, the slot
        # takes any module.
        use_te_activation_func=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        attention_output_gate=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        perform_initialization=True,
        init_method=lecun_normal_,
        output_layer_init_method=lecun_normal_,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        # The loss is divided by the global supervised-token count, so DP gradients are summed.
        calculate_per_token_loss=True,
    )


class HRMTextModel(MegatronModule):
    """Embedding -> recurrence of L and H stacks -> untied head, with PrefixLM attention."""

    def __init__(self, cfg: ModelConfig):
        config_l = transformer_config(cfg, cfg.num_layers_L)
        super().__init__(config=config_l)
        self.cfg = cfg
        self.layer_backend = backend.layer_backend(cfg.execution.layer_backend)
        self.attention_backend = backend.attention_backend(cfg.execution.attention_backend)
        self.embedding = tensor_parallel.VocabParallelEmbedding(
            cfg.padded_vocab_size,
            cfg.hidden_size,
            init_method=vocab_rows_init(cfg.vocab_size),
            config=config_l,
        )
        self.L = TransformerBlock(config_l, block_spec(cfg.num_layers_L, self.layer_backend))
        self.H = TransformerBlock(
            transformer_config(cfg, cfg.num_layers_H), block_spec(cfg.num_layers_H, self.layer_backend)
        )
        self.head = tensor_parallel.ColumnParallelLinear(
            cfg.hidden_size,
            cfg.padded_vocab_size,
            config=config_l,
            init_method=vocab_rows_init(cfg.vocab_size),
            bias=False,
            gather_output=False,
            skip_bias_add=True,
        )
        # Fixed initial low-level state; saved with the weights, never trained.
        self.register_buffer("z_L_init", torch.empty(cfg.hidden_size, dtype=config_l.params_dtype))
        z_l_init_(self.z_L_init)
        if cfg.execution.compile:
            # In place (keeps parameter names): each module application runs the compiled
            # stack; grad and no-grad applications get one compiled graph each.
            self.L.compile()
            self.H.compile()

    # -- forward -------------------------------------------------------------------------------

    def forward(
        self,
        batch: Batch,
        *,
        window: WindowPlan | int | None = None,
        h_cycles: int | None = None,
        l_cycles: int | None = None,
        num_supervised: torch.Tensor | None = None,
        return_logits: bool = True,
        validate: bool = True,
    ) -> ModelOutput:
        """Run the recurrence on a batch.

        Args:
            batch: the packed PrefixLM batch (see :mod:`mimir_megatron.batch`).
            window: the bp window: a plan (the trainer's, for this step), or its size k (default:
                ``cfg.bp_window``, clipped to the schedule's depth).
            h_cycles, l_cycles: schedule for this call (default: the config's); any values work,
                whatever the weights were trained with.
            num_supervised: denominator of the loss, e.g. the supervised-token count of the whole
                global batch (all-reduced by the caller); default: this batch's count.
            return_logits: gather and return full ``[batch, seq, vocab]`` logits.
            validate: check the batch's shapes, dtypes and token ranges first.
        """
        cfg = self.cfg
        if validate:
            batch.validate(cfg.vocab_size)
            self._check_sequence_split(batch.shape[1])
        plan = self.window_plan(window, h_cycles, l_cycles)
        # Built once, shared by every layer of every application.
        layout = build_layout(self.attention_backend, batch.segment_ids, batch.prefix_mask)
        z_H = self.recurrence(batch.input_ids, batch.position_ids, layout, plan)

        if batch.labels is not None and not return_logits and cfg.execution.loss_chunk_tokens:
            loss, count = self._chunked_loss(z_H, batch.labels, num_supervised)
            return ModelOutput(logits=None, loss=loss, num_supervised=count, window=plan)

        logits_parallel, _ = self.head(z_H)  # [s, b, V/tp]
        logits_parallel = self._mask_vocab_padding(logits_parallel)

        logits = self._gather_logits(logits_parallel) if return_logits else None
        loss = count = None
        if batch.labels is not None:
            # megatron's cross-entropy works in place on its input: keep returned logits intact.
            loss_input = logits_parallel.float()
            if return_logits:
                loss_input = loss_input.clone()
            loss, count = self._loss(loss_input, batch.labels, num_supervised)
        return ModelOutput(logits=logits, loss=loss, num_supervised=count, window=plan)

    def recurrence(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        layout: PrefixLMLayout,
        plan: WindowPlan,
        kv_cache=None,
        stacks=None,
    ) -> torch.Tensor:
        """The final high-level state ``z_H`` ``[seq, batch, hidden]`` for ``[batch, seq]`` inputs.

        ``kv_cache`` (decoding, :class:`mimir_megatron.inference.kv_cache.KVCache`) gives every
        module application its own cache slots: the same layer applied at two points of the
        schedule sees different inputs, so it has different keys and values.
        ``stacks`` (inference): an ``(L, H)`` pair called in place of the two blocks, with the
        blocks' arguments (:mod:`mimir_megatron.inference.fast_stack`: the same weights without
        megatron's autograd machinery).
        """
        rotary = RotaryTable(rotary_angles(position_ids, self.cfg.head_dim, self.cfg.rope_theta))
        layout = RotaryLayout.of(layout, rotary)  # RoPE is applied in our attention slot
        z_H = self._embed(input_ids)
        z_L = self.z_L_init.to(z_H.dtype).expand_as(z_H)
        run_L, run_H = (self.L, self.H) if stacks is None else stacks
        for application, (module, grad) in enumerate(zip(plan.schedule, plan.grad)):
            if kv_cache is not None:
                layout = replace(layout, kv_cache=kv_cache.application(application))
            stack_args = dict(attention_mask=None, rotary_pos_emb=None, packed_seq_params=layout)
            with nullcontext() if grad else torch.no_grad():
                if module == "L":
                    z_L = run_L(self._stack_input(z_L + z_H, grad), **stack_args)
                else:
                    z_H = run_H(self._stack_input(z_H + z_L, grad), **stack_args)
        return z_H

    def _stack_input(self, hidden: torch.Tensor, grad: bool) -> torch.Tensor:
        """The input of one application. Full recompute wraps each layer in megatron's reentrant
        checkpoint, an autograd Function whose output needs grad only if an *input* does (the
        weights are not its inputs): the first application of a window that starts after the
        embedding's last use (k < 5 on LLLHLLLH) gets a no-grad input, and without this its
        stack would silently get no weight gradients."""
        if grad and self.cfg.execution.recompute == "full" and not hidden.requires_grad:
            return hidden.detach().requires_grad_()
        return hidden

    def full_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        """A ``[seq, batch, hidden]`` state with every position on this rank (gathers a
        sequence-parallel state; inference only, no gradient)."""
        if not self.cfg.uses_sequence_parallel:
            return hidden
        return tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[batch, seq, vocab_size]`` (gathered across TP) of a
        ``[seq, batch, hidden]`` state that holds every position it names (see
        :meth:`full_sequence`): pass only the positions you need (inference, no gradient)."""
        logits_parallel = torch.matmul(hidden, self.head.weight.t())  # the head without its SP gather
        return self._gather_logits(self._mask_vocab_padding(logits_parallel))

    def window_plan(
        self, window: WindowPlan | int | None = None, h_cycles: int | None = None, l_cycles: int | None = None
    ) -> WindowPlan:
        h = h_cycles or self.cfg.h_cycles
        low = l_cycles or self.cfg.l_cycles
        if isinstance(window, WindowPlan):
            if window.schedule != schedule(h, low):
                raise ValueError(f"a window plan for {''.join(window.schedule)} on the schedule "
                                 f"{''.join(schedule(h, low))}")
            return window
        k = window if window is not None else min(self.cfg.bp_window, h * (low + 1))
        return plan_window(h, low, k, self.cfg.window_policy)

    # -- pieces --------------------------------------------------------------------------------

    def _check_sequence_split(self, seq: int) -> None:
        tp = self.cfg.parallel.tensor_parallel_size
        if self.cfg.uses_sequence_parallel and seq % tp:
            raise BatchError(
                f"input_ids has sequence length {seq}, not divisible by tensor_parallel_size {tp} "
                "(needed by sequence parallelism)"
            )

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb = self.embedding(input_ids).transpose(0, 1).contiguous()  # [s, b, h]
        emb = emb * self.cfg.effective_embedding_scale
        if self.cfg.uses_sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
        return emb

    def _mask_vocab_padding(self, logits_parallel: torch.Tensor) -> torch.Tensor:
        """Padded vocabulary rows exist only for divisibility: keep them out of the softmax."""
        cfg = self.cfg
        if cfg.padded_vocab_size == cfg.vocab_size:
            return logits_parallel
        local = logits_parallel.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * local
        ids = torch.arange(start, start + local, device=logits_parallel.device)
        return logits_parallel.masked_fill(ids >= cfg.vocab_size, float("-inf"))

    def _loss(
        self,
        logits_parallel: torch.Tensor,
        labels: torch.Tensor,
        num_supervised: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        target = labels.transpose(0, 1).contiguous()  # [s, b]
        supervised = target != IGNORE_INDEX
        per_token = tensor_parallel.vocab_parallel_cross_entropy(
            logits_parallel, torch.where(supervised, target, 0)
        )
        return self._normalise((per_token * supervised).sum(), supervised, num_supervised)

    def _chunked_loss(
        self, z_H: torch.Tensor, labels: torch.Tensor, num_supervised: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head and loss chunk by chunk (``kernels/mimir_kernels/vocab_loss.py``): no full logits."""
        cfg = self.cfg
        if cfg.uses_sequence_parallel:  # the head needs every position; grads reduce-scatter back
            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                z_H, tensor_parallel_output_grad=True
            )
        else:  # replicated over TP: grads all-reduce back
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(z_H)
        target = labels.transpose(0, 1).reshape(-1)  # [s * b], the order of hidden's rows
        supervised = target != IGNORE_INDEX
        weight = self.head.weight
        loss_sum = chunked_vocab_parallel_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), weight, target, supervised, cfg.execution.loss_chunk_tokens,
            vocab_start=parallel_state.get_tensor_model_parallel_rank() * weight.shape[0],
            vocab_size=cfg.vocab_size, group=parallel_state.get_tensor_model_parallel_group(),
        )
        return self._normalise(loss_sum, supervised, num_supervised)

    @staticmethod
    def _normalise(
        loss_sum: torch.Tensor, supervised: torch.Tensor, num_supervised: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Divide by the supervised-token count: the caller's (global batch) or this batch's."""
        count = supervised.sum()
        denom = count if num_supervised is None else num_supervised
        return loss_sum / denom.clamp(min=1).to(loss_sum.dtype), count

    def _gather_logits(self, logits_parallel: torch.Tensor) -> torch.Tensor:
        full = tensor_parallel.gather_from_tensor_model_parallel_region(
            logits_parallel, group=parallel_state.get_tensor_model_parallel_group()
        )  # the group passed: megatron warns on every call without one
        return full.transpose(0, 1)[..., : self.cfg.vocab_size].contiguous()
