"""Memory per GPU of one training step of this trainer, term by term.

What the trainer holds (train/step.py, train/optim.py), per tensor-parallel rank (every weight
of this model is TP-split: vocab-parallel embedding and head, TP linears in the stacks):

- weights: fp32 (``params_dtype`` float32; they are also the master weights: bf16 compute is
  autocast, so there is no separate master copy);
- gradients: megatron DDP's fp32 buffer (``grad_reduce_in_fp32``);
- optimizer: Adam's two fp32 moments; with ``optim.shard_state`` and DP > 1, torch's
  ZeroRedundancyOptimizer owns whole tensors per rank, assigned greedily (largest first, to the
  least-loaded rank, group by group), so the largest rank's share is counted, not P / DP;
- EMA: an fp32 copy, not sharded;
- activations: what autograd keeps for the largest window of the schedule (below);
- temporaries: the loss's buffers, the head's weight gradient before DDP takes it, the backward
  working set of one layer, the bf16 weight copies autocast caches on a GPU, the dense attention
  mask (CPU), and, after backward, the optimizer's scratch (whichever phase is larger counts).

Activations, elements per token of one layer application with grad (D hidden, F FFN width,
a heads; t = TP size, divides the TP-region terms; with sequence parallelism the
residual-region terms too):
  residual region: the layer input and the mid-layer residual (kept by the norms, fp32 on a
  GPU: the residual stream stays fp32 under autocast), two rsqrt per token;
  matmul inputs: both norm outputs (2D, compute dtype);
  TP region: q, k, v and the output gate from the fused projection (4D), q and k after RoPE
  (2D), the attention output (D), sigmoid of the gate (D), the gated product (D), the MLP's
  first projection (2F), SwiGLU's activated half (F) and output (F), the attention kernel's
  log-sum-exp (a).
Per application, the exit norm keeps its input (D, fp32) and its rsqrt.
On a CPU (dense attention), SDPA also keeps an fp32 copy of the b x s x s mask per layer.
Recompute ``full`` keeps only each layer's input (and the exit norm's) and recomputes one
layer in backward; ``selective`` drops q and k after RoPE and the log-sum-exp (the core
attention is recomputed). No-grad applications keep nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mimir_megatron.config import ModelConfig

GB = 1e9
FP32 = 4


@dataclass(frozen=True)
class StepShape:
    """What one GPU computes in one micro-batch, and how the run is split."""

    micro_batch: int
    seq_len: int
    tp: int
    dp: int
    k_L: int
    """L-applications in the window (the largest window of the schedule)."""
    k_H: int
    recompute: str = "none"
    compute_bytes: int = 2
    """2: bf16 autocast (GPU); 4: fp32 (CPU)."""
    on_gpu: bool = True
    shard_optimizer: bool = True
    ema: bool = True
    loss_chunk_tokens: int = 0
    sequence_parallel: bool = True
    dense_attention: bool = False
    """The dense PrefixLM mask (CPU backend): b x s x s booleans."""
    fp8_weight_copies: bool = False
    """FP8 (Transformer Engine): an fp8 copy of each stack weight and of its transpose."""

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def sp(self) -> int:
        """What divides residual-region activations: TP with sequence parallelism, else 1."""
        return self.tp if self.sequence_parallel and self.tp > 1 else 1


@dataclass
class MemoryPlan:
    """Bytes per GPU, by term; ``peak`` is what must fit."""

    weights: float
    gradients: float
    optimizer: float
    master_weights: float
    ema: float
    activations: float
    temporaries: dict[str, float] = field(default_factory=dict)
    """Working buffers at the peak (the larger of the step's two phases)."""
    optimizer_phase: dict[str, float] = field(default_factory=dict)
    """Scratch of the optimizer phase (counted when larger than the backward's)."""

    @property
    def static(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.master_weights + self.ema

    @property
    def peak(self) -> float:
        # The optimizer phase's buffers come one after the other (the norm's scratch is freed
        # before Adam runs): its peak is the largest of them.
        return self.static + max(self.activations + sum(self.temporaries.values()),
                                 max(self.optimizer_phase.values(), default=0.0))

    def terms_gb(self) -> dict[str, float]:
        terms = {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                 "master_weights": self.master_weights, "ema": self.ema, "activations": self.activations,
                 **{f"temp.{k}": v for k, v in self.temporaries.items()},
                 **{f"optimizer_phase.{k}": v for k, v in self.optimizer_phase.items()},
                 "peak": self.peak}
        return {k: round(v / GB, 3) for k, v in terms.items()}


# -- parameters ---------------------------------------------------------------------------------


def padded_vocab(cfg: ModelConfig, tp: int) -> int:
    multiple = cfg.make_vocab_size_divisible_by * tp
    return -(-cfg.vocab_size // multiple) * multiple


def tensor_sizes(cfg: ModelConfig, tp: int) -> dict[str, list[int]]:
    """Elements of each weight tensor on one TP rank, by optimizer group (train/optim.py's
    embedding, head, L, H), in that order."""
    d, f = cfg.hidden_size, cfg.ffn_hidden_size
    layer = [4 * d * d // tp, d * d // tp, 2 * f * d // tp, f * d // tp]  # qkv+gate, proj, fc1, fc2
    vocab_rows = padded_vocab(cfg, tp) // tp * d
    return {"embedding": [vocab_rows], "head": [vocab_rows],
            "L": layer * cfg.num_layers_L, "H": layer * cfg.num_layers_H}


def params_per_rank(cfg: ModelConfig, tp: int) -> int:
    return sum(sum(sizes) for sizes in tensor_sizes(cfg, tp).values())


def largest_zero_shard(groups: dict[str, list[int]], dp: int) -> int:
    """Elements of the largest ZeroRedundancyOptimizer partition: group by group, tensors
    largest first, each to the rank with the fewest elements so far (torch's own rule)."""
    loads = [0] * dp
    for sizes in groups.values():
        for size in sorted(sizes, reverse=True):
            loads[loads.index(min(loads))] += size
    return max(loads)


# -- activations -------------------------------------------------------------------------------


def layer_activation_bytes(cfg: ModelConfig, s: StepShape) -> float:
    """Bytes one layer application with grad keeps for backward, for the micro-batch."""
    d, f, a, t, c = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads, s.tp, s.compute_bytes
    residual = FP32 * (2 * d + 2) / s.sp            # layer input, mid residual, two rsqrt
    matmul_inputs = c * 2 * d / s.sp                # the two norm outputs, as the linears keep them
    if s.recompute == "full":
        return s.tokens * FP32 * d / s.sp           # the checkpoint keeps the layer input only
    roped = 0 if s.recompute == "selective" else 2 * d
    lse = 0 if s.recompute == "selective" else a
    tp_region = c * (4 * d + roped + 3 * d + 4 * f) / t + FP32 * lse / t
    per_layer = s.tokens * (residual + matmul_inputs + tp_region)
    if s.dense_attention and s.recompute == "none":
        # CPU SDPA turns the boolean mask into an additive fp32 one and keeps it for backward.
        per_layer += s.micro_batch * s.seq_len * s.seq_len * FP32
    return per_layer


def activation_bytes(cfg: ModelConfig, s: StepShape) -> float:
    """Activations kept at the end of the forward pass of one micro-batch."""
    layers = s.k_L * cfg.num_layers_L + s.k_H * cfg.num_layers_H
    exit_norms = (s.k_L + s.k_H) * s.tokens * FP32 * (cfg.hidden_size + 1) / s.sp
    return layers * layer_activation_bytes(cfg, s) + exit_norms


def temporaries(cfg: ModelConfig, s: StepShape) -> dict[str, float]:
    """Working buffers alive at the start of backward, next to the activations."""
    d, tp, c = cfg.hidden_size, s.tp, s.compute_bytes
    vocab_local = padded_vocab(cfg, tp) // tp
    head_params = vocab_local * d
    stack_params = (cfg.num_layers_L + cfg.num_layers_H) * (5 * d * d + 3 * d * cfg.ffn_hidden_size) // tp
    temps: dict[str, float] = {}
    if s.loss_chunk_tokens:
        # One chunk's fp32 logits (and the matmul's output in the compute dtype), the head's
        # fp32 weight gradient and the hidden-state gradient, kept from forward to backward.
        chunk = min(s.loss_chunk_tokens, s.tokens)
        temps["loss"] = chunk * vocab_local * (FP32 + c) + head_params * FP32 + s.tokens * d * c
    else:
        # Logits in the compute dtype and their fp32 copy (none when they are fp32 already);
        # the cross-entropy works in place, its gradient too.
        temps["loss"] = s.tokens * vocab_local * (c + (FP32 if c != FP32 else 0))
    # The head's weight gradient, made at the start of backward (all activations still alive)
    # before DDP's hook adds it to the fp32 buffer: the largest weight gradient of the step.
    temps["head_grad"] = FP32 * head_params
    # Backward of the first layer: its recomputed activations (full recompute) or its
    # gradients' working set, about one layer's activations either way.
    full = StepShape(**{**s.__dict__, "recompute": "none"})
    temps["backward"] = layer_activation_bytes(cfg, full)
    if s.on_gpu and s.compute_bytes == 2:
        temps["autocast_weights"] = 2 * (stack_params + head_params)  # bf16 copies, cached
    if s.fp8_weight_copies:
        temps["fp8_weights"] = 2 * stack_params
    if s.dense_attention:
        temps["attention_mask"] = s.micro_batch * s.seq_len * s.seq_len
    return temps


def optimizer_phase(cfg: ModelConfig, s: StepShape) -> dict[str, float]:
    """Scratch after backward: the gradient norm's buffer (the largest tensor, fp32) and Adam's
    intermediates (a GPU runs torch's foreach kernels over a whole group: about two fp32 copies
    of the largest group; a CPU goes tensor by tensor)."""
    groups = tensor_sizes(cfg, s.tp)
    largest = max(max(sizes) for sizes in groups.values())
    if s.on_gpu:
        group = max(sum(sizes) for sizes in groups.values())
        if s.shard_optimizer and s.dp > 1:
            group = largest_zero_shard(groups, s.dp)
        adam = 2 * FP32 * group
    else:
        adam = 2 * FP32 * largest
    return {"grad_norm": FP32 * largest, "adam": adam}


def plan_memory(cfg: ModelConfig, s: StepShape) -> MemoryPlan:
    """Every term of the peak memory of one GPU."""
    groups = tensor_sizes(cfg, s.tp)
    params = sum(sum(sizes) for sizes in groups.values())
    owned = largest_zero_shard(groups, s.dp) if s.shard_optimizer and s.dp > 1 else params
    return MemoryPlan(
        weights=FP32 * params + FP32 * cfg.hidden_size,  # + the z_L_init buffer
        gradients=FP32 * params,
        optimizer=2 * FP32 * owned,
        master_weights=0.0,
        ema=FP32 * params if s.ema else 0.0,
        activations=activation_bytes(cfg, s),
        temporaries=temporaries(cfg, s),
        optimizer_phase=optimizer_phase(cfg, s),
    )
