"""Memory per GPU of one training step of this trainer, term by term.

What the trainer holds (train/step.py, train/optim.py), per tensor-parallel rank (every weight
of this model is TP-split: vocab-parallel embedding and head, TP linears in the stacks):

- weights: in ``params_dtype``: fp32 (they are also the master weights: bf16 compute is
  autocast, so there is no separate master copy), or bf16 with ``optim.distributed_optimizer``
  (Megatron's mixed precision), whose fp32 main copy is kept by rows (below);
- gradients: megatron DDP's fp32 buffer (``grad_reduce_in_fp32``);
- optimizer: Adam's two fp32 moments; with ``optim.shard_state`` and DP > 1, torch's
  ZeroRedundancyOptimizer owns whole tensors per rank, assigned greedily (largest first, to the
  least-loaded rank, group by group), so the largest rank's share is counted, not P / DP;
- EMA: an fp32 copy, not sharded;
- with ``optim.distributed_optimizer`` (train/dist_optim.py) the fp32 main weights (none when
  the weights are fp32: views of them), Adam's moments and the EMA are kept for one
  data-parallel rank's rows of every tensor: the rank with the most rows counts (16 / DP bytes
  a weight when rows divide evenly); the gradients are reduce-scattered to those rows in place
  in the fp32 buffer (which stays whole, as megatron's does), the norm reads the rows only; its
  optimizer phase adds the all-gather's input copy;
- with ``optim.fully_shard`` (FSDP2, train/fsdp.py) the weights themselves are fp32 rows
  (``torch.chunk``: the first rank keeps ``ceil(rows / DP)`` of each), and the gradients, Adam's
  moments and the EMA are kept for the same rows: 20 / DP bytes a weight (no master copy); the
  gradient shards of earlier micro-batches are alive at the last one's backward (planned for
  accumulation >= 2; with one micro-batch the plan is 4 / DP bytes a weight high). FSDP2's
  buffers are temporaries: the root unit's weights (the head) gathered in the compute dtype for
  the whole step and its unsharded gradient until the end of backward, the layer running, and
  one layer's gradient in the compute dtype and in fp32 for its reduce-scatter; with full
  recompute and a stack applied twice in the window, every layer gathered and its gradient
  unsharded until backward ends (measured, see :func:`temporaries`);
- activations: what autograd keeps for the largest window of the schedule (below);
- temporaries: the loss's buffers, the head's weight gradient before DDP takes it, the backward
  working set of one layer, the bf16 weight copies autocast caches on a GPU, the dense attention
  mask (CPU), and, after backward, the optimizer's scratch (whichever phase is larger counts).

Activations, elements per token of one layer application with grad (D hidden, F FFN width,
a heads; t = TP size, divides the TP-region terms; with sequence parallelism the
residual-region terms too):
  residual region: the layer input and the mid-layer residual (kept by the norms in the residual
  stream's dtype: the weights', so fp32 under autocast with fp32 weights, bf16 with bf16
  weights), two fp32 rsqrt per token;
  matmul inputs: both norm outputs (2D, compute dtype);
  TP region: the attention block (:func:`attention_kept`: 6D for flex and dense: q and k after
  RoPE, v and the gate copied out of the fused projection so that it is freed, the attention
  output, the gated product; fp32 keeps the gate's sigmoid in the gate's place), the MLP's
  first projection (2F) and SwiGLU's output (F; its silu is recomputed in backward), the
  attention kernel's log-sum-exp (a, fp32).
Per application, the exit norm keeps its input (D, the residual stream's dtype) and its rsqrt.
Dense attention (SDPA, the CPU's kernel) also keeps an additive copy of the b x s x s mask per
layer, in the compute dtype.
Recompute ``full`` keeps only each layer's input (and the exit norm's) and recomputes one
layer in backward; ``selective`` keeps the core attention's inputs before RoPE (views of the
fused projection) and no log-sum-exp (the core attention is recomputed). No-grad applications
keep nothing. tests/unit/test_saved_activations.py counts what autograd keeps of one stack
application, kernel by kernel, against these terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mimir_megatron.config import ModelConfig

GB = 1e9
"""The unit of every memory figure of the plan (its table, its JSON, MLflow): 1e9 bytes, as GPU
datasheets give memory (a "180 GB" B200)."""
FP32 = 4
VARLEN_KEYS_MAX = 2.0
"""The varlen kernel's keys per token at most: a sample's prefix tokens are keys of both passes."""


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
    attention: str = "flex"
    """The PrefixLM kernel as it runs (``execution.attention_backend``; ``auto`` is flex on a GPU,
    dense on a CPU): dense keeps a b x s x s mask, varlen gathered copies (:func:`attention_kept`)."""
    varlen_keys: float = VARLEN_KEYS_MAX
    """varlen: keys (and values) the two passes gather per token; planned at the most, 2."""
    fp8_weight_copies: bool = False
    """FP8 (Transformer Engine): an fp8 copy of each stack weight and of its transpose."""
    params_bytes: int = 4
    """Bytes of a weight as the model stores it (``model.params_dtype``): 4 fp32, 2 bf16."""
    distributed_optimizer: bool = False
    """``optim.distributed_optimizer``: fp32 main weights (unless the weights are fp32), Adam's
    moments and the EMA for this data-parallel rank's rows of every weight."""
    fully_shard: bool = False
    """``optim.fully_shard`` (FSDP2): fp32 weights, gradients, Adam's moments and EMA for this
    data-parallel rank's rows of every weight; weights gathered in ``params_bytes`` for use."""

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def residual_bytes(self) -> int:
        """The residual stream's dtype: that of the embedding's output, so of the weights (fp32
        weights keep it fp32 under autocast)."""
        return self.params_bytes

    @property
    def dense_attention(self) -> bool:
        """The dense PrefixLM mask: b x s x s booleans, and SDPA's additive copy of it per layer."""
        return self.attention == "dense"

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


def row_sizes(cfg: ModelConfig, tp: int) -> dict[str, list[tuple[int, int]]]:
    """(rows, elements a row) of each weight tensor on one TP rank, by optimizer group, as
    :func:`tensor_sizes` orders them: the distributed optimizer cuts every weight by rows."""
    d, f = cfg.hidden_size, cfg.ffn_hidden_size
    layer = [(4 * d // tp, d), (d, d // tp), (2 * f // tp, d), (d, f // tp)]  # qkv+gate, proj, fc1, fc2
    vocab = (padded_vocab(cfg, tp) // tp, d)
    return {"embedding": [vocab], "head": [vocab], "L": layer * cfg.num_layers_L,
            "H": layer * cfg.num_layers_H}


def largest_row_shard(cfg: ModelConfig, tp: int, dp: int) -> tuple[int, int, int]:
    """(elements, largest group's elements, largest tensor's elements) of the data-parallel rank
    that keeps the most rows: rank r keeps rows r * n // DP to (r + 1) * n // DP of each tensor."""
    def rows(n: int, r: int) -> int:
        return (r + 1) * n // dp - r * n // dp

    best = (0, 0, 0)
    for r in range(dp):
        groups = {g: [rows(n, r) * width for n, width in sizes] for g, sizes in row_sizes(cfg, tp).items()}
        total = sum(sum(sizes) for sizes in groups.values())
        best = max(best, (total, max(sum(sizes) for sizes in groups.values()),
                          max(max(sizes) for sizes in groups.values())))
    return best


def largest_chunk_shard(cfg: ModelConfig, tp: int, dp: int) -> tuple[int, int, int]:
    """:func:`largest_row_shard` for FSDP2's rows (``torch.chunk``: ``ceil(rows / DP)`` to every
    rank but the last ones): the first rank keeps the most."""
    groups = {g: [-(-n // dp) * width for n, width in sizes] for g, sizes in row_sizes(cfg, tp).items()}
    return (sum(sum(sizes) for sizes in groups.values()), max(sum(sizes) for sizes in groups.values()),
            max(max(sizes) for sizes in groups.values()))


def fsdp_units(cfg: ModelConfig) -> dict[str, int]:
    """Elements of FSDP2's units (train/fsdp.py, TP=1): the root (the head), the embedding, one
    layer of each stack (the L and H layers have the same shape)."""
    sizes = tensor_sizes(cfg, 1)
    return {"root": sizes["head"][0], "embedding": sizes["embedding"][0], "layer": sum(sizes["L"][:4])}


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
    # The norms keep the layer input and the mid-layer residual in the residual stream's dtype
    # (model/norm.py) and their two fp32 rsqrt.
    residual = (s.residual_bytes * 2 * d + FP32 * 2) / s.sp
    matmul_inputs = c * 2 * d / s.sp                # the two norm outputs, as the linears keep them
    if s.recompute == "full":                       # the checkpoint keeps the layer input only,
        return s.tokens * s.residual_bytes * d / s.sp  # the residual stream's own tensor
    lse = 0 if s.recompute == "selective" else a
    # SwiGLU keeps fc1's output (2F; silu is recomputed in backward) and fc2 its input (F).
    tp_region = c * (attention_kept(d, s) + 3 * f) / t + FP32 * lse / t
    per_layer = s.tokens * (residual + matmul_inputs + tp_region)
    if s.dense_attention and s.recompute == "none":
        # SDPA turns the boolean mask into an additive one in the query's dtype (the compute
        # dtype: bf16 with bf16 weights) and keeps it for backward.
        per_layer += s.micro_batch * s.seq_len * s.seq_len * c
    if s.recompute == "selective":
        per_layer += 4  # megatron's core-attention checkpoint keeps the mask type, an int32 tensor
    return per_layer


def attention_kept(d: int, s: StepShape) -> float:
    """Elements a token (compute dtype, before TP) that one layer's attention block keeps for
    backward, from the fused q/gate/k/v projection to the output projection's input."""
    if s.recompute == "selective":
        # The checkpoint keeps q, k and v before RoPE, and the output gate its gate: views of the
        # fused projection (4D); then the attention output and the gated product, and in fp32
        # megatron's sigmoid (model/gate.py recomputes it in backward otherwise).
        return 4 * d + (3 * d if s.compute_bytes == FP32 else 2 * d)
    if s.attention == "varlen":
        # q (each token once) and k and v (varlen_keys times) gathered into the passes' order,
        # the passes' outputs and their gather back to token order (the gate's input), the gate
        # and the gated product. RoPE's q and k are not kept: the gathers need only indices.
        return (1 + 2 * s.varlen_keys + 1 + 1 + 1 + 1) * d
    # q and k after RoPE (fresh tensors), v and the gate copied out of the fused projection
    # (model/gate.py: the projection, with the q and k before RoPE, is freed), the kernel's
    # output (also the gate's input: its reshape is a view) and the gated product. fp32 keeps
    # the gate's sigmoid in place of the gate.
    return 6 * d


def activation_bytes(cfg: ModelConfig, s: StepShape) -> float:
    """Activations kept at the end of the forward pass of one micro-batch."""
    layers = s.k_L * cfg.num_layers_L + s.k_H * cfg.num_layers_H
    exit_norms = (s.k_L + s.k_H) * s.tokens * (s.residual_bytes * cfg.hidden_size + FP32) / s.sp
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
    # The head's weight gradient (in the weights' dtype), made at the start of backward (all
    # activations still alive) before DDP's hook adds it to the fp32 buffer: the largest weight
    # gradient of the step. (FSDP2: unsharded, until the root's reduce-scatter ends backward.)
    temps["head_grad"] = s.params_bytes * head_params
    if s.fully_shard:
        units, layers = fsdp_units(cfg), cfg.num_layers_L + cfg.num_layers_H
        if s.recompute == "full" and max(s.k_L, s.k_H) > 1:
            # Measured (tests/integration/test_plan_memory.py): with megatron's reentrant
            # recompute and a stack applied twice in the window, FSDP2 keeps every layer gathered
            # and its gradient unsharded until the reduce-scatters at the end of backward.
            temps["gathered"] = s.params_bytes * (units["root"] + layers * units["layer"])
            temps["unsharded_grads"] = s.params_bytes * layers * units["layer"]
        else:
            # The root and the layer running; a layer's gradient in the compute dtype and in
            # fp32 for its reduce-scatter.
            temps["gathered"] = s.params_bytes * (units["root"] + units["layer"])
            temps["reduce_scatter"] = (s.params_bytes + FP32) * units["layer"]
    # Backward of the first layer: its recomputed activations (full recompute) or its
    # gradients' working set, about one layer's activations either way.
    full = StepShape(**{**s.__dict__, "recompute": "none"})
    temps["backward"] = layer_activation_bytes(cfg, full)
    if s.on_gpu and s.compute_bytes == 2 and s.params_bytes == FP32:
        temps["autocast_weights"] = 2 * (stack_params + head_params)  # bf16 copies of fp32 weights, cached
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
    if s.fully_shard:  # every tensor's rows: the norm reads the gradient's, Adam updates the weight's
        _, group_rows, tensor_rows = largest_chunk_shard(cfg, s.tp, s.dp)
        return {"grad_norm": FP32 * tensor_rows, "adam": 2 * FP32 * (group_rows if s.on_gpu else tensor_rows)}
    if s.distributed_optimizer:
        # The norm over this rank's reduced rows, Adam over them (a group's on a GPU, a tensor's
        # on a CPU); then the all-gather's input, a copy of the largest row shard in the
        # weights' dtype.
        _, group_rows, tensor_rows = largest_row_shard(cfg, s.tp, s.dp)
        phase = {"grad_norm": FP32 * tensor_rows,
                 "adam": 2 * FP32 * (group_rows if s.on_gpu else tensor_rows)}
        if s.dp > 1:
            phase["gather"] = s.params_bytes * tensor_rows
        return phase
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
    if s.fully_shard:
        owned = largest_chunk_shard(cfg, s.tp, s.dp)[0]
        return MemoryPlan(
            weights=FP32 * owned + s.params_bytes * cfg.hidden_size,  # + z_L_init, not sharded
            gradients=FP32 * owned, optimizer=2 * FP32 * owned, master_weights=0.0,
            ema=FP32 * owned if s.ema else 0.0, activations=activation_bytes(cfg, s),
            temporaries=temporaries(cfg, s), optimizer_phase=optimizer_phase(cfg, s))
    if s.distributed_optimizer:
        owned = largest_row_shard(cfg, s.tp, s.dp)[0]
    else:
        owned = largest_zero_shard(groups, s.dp) if s.shard_optimizer and s.dp > 1 else params
    rows_kept = s.distributed_optimizer
    return MemoryPlan(
        weights=s.params_bytes * (params + cfg.hidden_size),  # + the z_L_init buffer
        gradients=FP32 * params,
        optimizer=2 * FP32 * owned,
        master_weights=FP32 * owned if rows_kept and s.params_bytes != FP32 else 0.0,
        ema=(FP32 * (owned if rows_kept else params)) if s.ema else 0.0,
        activations=activation_bytes(cfg, s),
        temporaries=temporaries(cfg, s),
        optimizer_phase=optimizer_phase(cfg, s),
    )
