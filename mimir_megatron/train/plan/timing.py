"""Step time, communication and the whole schedule's wall-clock for one layout.

Compute: the hardware FLOPs of a step (``train/flops.py``'s model FLOPs, plus what recompute
runs again) at ``efficiency`` x the GPU's peak. Communication is added, not overlapped: this
trainer reduces gradients once after the whole backward (L and H run several times a step, so
a gradient is complete only at the end) and megatron's TP collectives sit on the critical path.
  - DP: a ring all-reduce of the fp32 gradient buffer (2 (DP-1)/DP x 4 bytes x weights), plus,
    with ZeRO-1, the owners' broadcast of updated weights ((DP-1)/DP x 4 bytes x weights); with
    the distributed optimizer a reduce-scatter of the fp32 gradients to the rows' keepers
    ((DP-1)/DP x 4 bytes x weights) and the all-gather of the updated rows ((DP-1)/DP x 2 bytes x
    weights for bf16 weights);
    with FSDP2 (``optim.fully_shard``) per micro-batch an all-gather of each unit for every use
    (every application's forward, the window's backward: (DP-1)/DP x the compute dtype's bytes
    x the unit) and a reduce-scatter of its gradient in fp32 after each backward through it
    ((DP-1)/DP x 4 bytes), the embedding once each way; the root (the head) gathered once a
    step (it stays gathered), its gradient reduce-scattered each micro-batch;
    over the network when the run spans nodes, else NVLink (TP stays inside a node). Bandwidths
    are one direction: what a GPU sends while it receives as much (NVLink: half the datasheet's
    bidirectional total).
  - TP: per layer and module application, two regions (attention, MLP), each an all-reduce or,
    with sequence parallelism, an all-gather plus a reduce-scatter: 2 (TP-1)/TP x tokens x D x 2
    bytes per region; in forward for every application, again in backward for the window's,
    and once more for full recompute; plus the head's gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mimir_megatron.config import ModelConfig

FP32_BYTES = 4


@dataclass(frozen=True)
class Cluster:
    gpus: int
    nodes: int
    peak_tflops: float
    nvlink_gbps: float
    """One direction (half the datasheet's bidirectional total): a ring collective sends and
    receives its bytes at once, each way at this rate."""
    network_gbps: float
    """One direction, per GPU."""

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes


@dataclass
class StepTime:
    seconds: float
    compute_s: float
    dp_comm_s: float
    tp_comm_s: float
    model_flops: float
    """Model FLOPs of the whole step, all GPUs (the MFU numerator)."""
    hardware_flops: float
    """Including recompute."""
    matmul_flops: float
    """Model FLOPs without attention's QK^T and AV (the paper's convention: 20.1 GFLOP/token at
    k=5 for the Mimir shape)."""
    dp_bytes: float
    """Bytes each GPU sends for the data-parallel reduction (and ZeRO-1 broadcast)."""
    tp_bytes_per_application: float
    """Bytes each GPU moves in the TP collectives of one module application's forward."""

    def mfu(self, cluster: Cluster, flops: float | None = None) -> float:
        flops = self.model_flops if flops is None else flops
        return flops / self.seconds / cluster.gpus / (cluster.peak_tflops * 1e12)

    def matmul_mfu(self, cluster: Cluster) -> float:
        return self.mfu(cluster, self.matmul_flops)


def step_flops(cfg: ModelConfig, k_L: int, k_H: int, seq_len: int, tokens: int, recompute: str
               ) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of a step of ``tokens`` positions. Recompute runs the
    window's forward again: half of its backward, which is flops_per_token(k) - (k = 0)."""
    from mimir_megatron.train.flops import flops_per_token

    model = flops_per_token(cfg, k_L, k_H, seq_len)
    if recompute == "full":
        extra = (model - flops_per_token(cfg, 0, 0, seq_len)) / 2
    elif recompute == "selective":  # the core attention only
        with_attn = model - flops_per_token(cfg, 0, 0, seq_len)
        without = (flops_per_token(cfg, k_L, k_H, seq_len, include_attention=False)
                   - flops_per_token(cfg, 0, 0, seq_len, include_attention=False))
        extra = (with_attn - without) / 2
    else:
        extra = 0.0
    return model * tokens, (model + extra) * tokens


def step_time(cfg: ModelConfig, cluster: Cluster, *, tp: int, micro_batch: int, accumulation: int,
              seq_len: int, k_L: int, k_H: int, recompute: str, efficiency: float,
              weights_per_rank: int, zero: bool, sequence_parallel: bool = True,
              compute_bytes: int = 2, gather_bytes: int | None = None, fully_shard: bool = False
              ) -> StepTime:
    """One optimizer step of the layout on ``cluster`` (see the module docstring);
    ``fully_shard``: FSDP2, whose gathers move ``gather_bytes`` a weight (4 if None)."""
    dp = cluster.gpus // tp
    tokens_step = micro_batch * seq_len * accumulation * dp
    model, hardware = step_flops(cfg, k_L, k_H, seq_len, tokens_step, recompute)
    from mimir_megatron.train.flops import flops_per_token

    matmul = flops_per_token(cfg, k_L, k_H, seq_len, include_attention=False) * tokens_step
    compute = hardware / cluster.gpus / (cluster.peak_tflops * 1e12 * efficiency)

    dp_bytes = 0.0
    if dp > 1 and fully_shard:
        dp_bytes = (dp - 1) / dp * fsdp_bytes_per_step(cfg, k_L, k_H, gather_bytes or 4, accumulation)
    elif dp > 1:
        if gather_bytes is not None:  # the distributed optimizer: reduce-scatter, all-gather rows
            dp_bytes = (dp - 1) / dp * (4 + gather_bytes) * weights_per_rank
        else:  # all-reduce, and ZeRO-1's broadcast
            dp_bytes = (2 + (1 if zero else 0)) * (dp - 1) / dp * 4 * weights_per_rank
    dp_bw = cluster.network_gbps if cluster.nodes > 1 else cluster.nvlink_gbps
    per_app = 0.0
    tp_total = 0.0
    if tp > 1:
        micro_tokens = micro_batch * seq_len
        region = 2 * (tp - 1) / tp * micro_tokens * cfg.hidden_size * compute_bytes
        layers_L, layers_H = cfg.num_layers_L, cfg.num_layers_H
        apps_L, apps_H = cfg.h_cycles * cfg.l_cycles, cfg.h_cycles
        forward = 2 * region * (apps_L * layers_L + apps_H * layers_H)
        window = 2 * region * (k_L * layers_L + k_H * layers_H)
        passes = forward + window * (2 if recompute == "full" else 1)
        head = 2 * (tp - 1) / tp * micro_tokens * cfg.hidden_size * compute_bytes
        tp_total = (passes + head) * accumulation
        per_app = 2 * region * max(layers_L, layers_H)
    return StepTime(seconds=compute + dp_bytes / (dp_bw * 1e9) + tp_total / (cluster.nvlink_gbps * 1e9),
                    compute_s=compute, dp_comm_s=dp_bytes / (dp_bw * 1e9),
                    tp_comm_s=tp_total / (cluster.nvlink_gbps * 1e9), model_flops=model,
                    hardware_flops=hardware, matmul_flops=matmul, dp_bytes=dp_bytes,
                    tp_bytes_per_application=per_app)


def fsdp_bytes_per_step(cfg: ModelConfig, k_L: int, k_H: int, gather_bytes: int, accumulation: int) -> float:
    """Bytes FSDP2 gathers and reduce-scatters in one step, before the (DP-1)/DP of a ring.
    Each micro-batch: every layer gathered for each application and again for each backward
    through it, its gradient reduce-scattered in fp32 after each; the embedding gathered for its
    forward and its backward, its gradient and the root's (the head's) reduce-scattered. The root
    is gathered once a step (train/fsdp.py keeps it gathered for the whole step)."""
    from mimir_megatron.train.plan.memory import fsdp_units

    units = fsdp_units(cfg)
    apps = cfg.h_cycles * cfg.l_cycles * cfg.num_layers_L + cfg.h_cycles * cfg.num_layers_H
    window = k_L * cfg.num_layers_L + k_H * cfg.num_layers_H
    gathered = (apps + window) * units["layer"] + 2 * units["embedding"]
    reduced = window * units["layer"] + units["embedding"] + units["root"]
    return accumulation * (gather_bytes * gathered + FP32_BYTES * reduced) + gather_bytes * units["root"]


def efficiency_from_step(measured_s: float, at: StepTime, efficiency: float) -> float:
    """The efficiency at which the plan's step (computed at ``efficiency``) takes ``measured_s``:
    communication as planned, the rest compute."""
    compute = measured_s - at.dp_comm_s - at.tp_comm_s
    if compute <= 0:
        return math.inf
    return efficiency * at.compute_s / compute


def efficiency_from_mean_step(mean_s: float, phases: list, efficiency: float) -> float:
    """The efficiency at which the plan's whole schedule (``phases``: (phase, its step at
    ``efficiency``) pairs) averages ``mean_s`` a step: communication as planned, compute scaled
    by one factor in every phase (a paper's "1.1 s a step" is such an average, not the final
    window's step)."""
    steps = sum(phase.steps for phase, _ in phases)
    compute = sum(phase.steps * t.compute_s for phase, t in phases)
    comm = sum(phase.steps * (t.dp_comm_s + t.tp_comm_s) for phase, t in phases)
    left = mean_s * steps - comm
    if left <= 0:
        return math.inf
    return efficiency * compute / left
