"""The run's plan: its window phases, the layouts a cluster allows, each layout's memory and
time, and which fit; the configured layout is checked and the fitting ones ranked by tokens/s.

A layout is TP (inside a node), DP = GPUs / TP, a micro-batch, the accumulation that makes the
global batch, and an activation-recompute choice. Memory is planned at the largest window of
the schedule (its activations are the largest); time phase by phase, each window at its own
FLOPs per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from mimir_megatron.errors import UserError
from mimir_megatron.gpus import GpuSpec
from mimir_megatron.train.plan.memory import GB, MemoryPlan, StepShape, params_per_rank, plan_memory
from mimir_megatron.train.plan.timing import (
    Cluster,
    StepTime,
    efficiency_from_mean_step,
    efficiency_from_step,
    step_time,
)

RECOMPUTE = ("none", "selective", "full")
MAX_MARGIN = 0.5
"""The largest share of memory `--margin` may keep free (more plans a GPU of half its size)."""


@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int
    micro_batch: int
    accumulation: int
    recompute: str
    fully_shard: bool = False
    """FSDP2 (``optim.fully_shard``, TP=1 only) in place of the config's other sharding."""

    def describe(self, seq_len: int) -> str:
        return (f"TP={self.tp} DP={self.dp} micro {self.micro_batch}x{seq_len} accum {self.accumulation} "
                f"recompute {self.recompute}" + (" FSDP2" if self.fully_shard else ""))

    @property
    def sharding(self) -> str:
        return "fsdp2" if self.fully_shard else "dp"


@dataclass(frozen=True)
class Phase:
    """Steps run at one window size."""

    k: int
    k_L: int
    k_H: int
    steps: int


@dataclass
class LayoutPlan:
    layout: Layout
    memory: MemoryPlan
    fits: bool
    phases: list[tuple[Phase, StepTime]]
    seconds: float
    """The whole schedule."""
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def last_step(self) -> StepTime:
        return self.phases[-1][1]


@dataclass
class RunSettings:
    """What the plan is asked for, besides the config."""

    gpu: GpuSpec
    gpus: int
    nodes: int = 1
    precision: str = "bf16"
    efficiency: float = 0.30
    """Fraction of the peak the step's hardware FLOPs achieve (calibrate: docs/planning.md)."""
    margin: float = 0.10
    """Share of the GPU's memory kept free (CUDA context, NCCL buffers, fragmentation)."""
    step_time_s: float | None = None
    """A measured step (the final window, the configured layout): sets ``efficiency``."""
    mean_step_time_s: float | None = None
    """A whole run's average step (wall-clock / steps, as papers report it; the configured
    layout, every window phase): sets ``efficiency``."""
    tp: int | None = None
    micro_batch: int | None = None
    recompute: str | None = None
    efficiency_from: str | None = None
    """Where ``efficiency`` comes from when it was not assumed (a stage after the first: the
    first stage's measured step)."""


@dataclass
class RunPlan:
    source: str
    settings: RunSettings
    cluster: Cluster
    seq_len: int
    global_batch: int
    steps: int
    phases: list[Phase]
    configured: LayoutPlan
    ranked: list[LayoutPlan] = field(default_factory=list)
    """Layouts that fit, fastest first."""
    efficiency: float = 0.30
    """The efficiency the times are at (``settings.efficiency``, or the one a measured step implies)."""
    implied_mfu: float | None = None
    """The final window's MFU a measured step time implies (``settings.step_time_s`` or
    ``settings.mean_step_time_s``)."""

    @property
    def usable_bytes(self) -> float:
        return self.settings.gpu.memory_gb * GB * (1 - self.settings.margin)


def window_phases(cfg) -> list[Phase]:
    """The window schedule of a TrainConfig as runs of steps at one k (train/schedules.py's
    step function, evaluated at every phase boundary)."""
    from mimir_megatron.model.window import plan_window
    from mimir_megatron.train.schedules import window_at

    w, m, steps = cfg.window, cfg.model, cfg.train.steps

    def k_at(step: int) -> int:
        return window_at(step, steps, w.schedule, w.k, w.k0, w.k1, w.ramp_fraction)

    phases, start = [], 0
    while start < steps:
        k = k_at(start)
        low, high = start, steps  # the first step with another k (k is monotone in the step)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if k_at(mid) == k else (low, mid)
        plan = plan_window(m.h_cycles, m.l_cycles, k, m.window_policy)
        phases.append(Phase(k=k, k_L=plan.k_L, k_H=plan.k_H, steps=high - start))
        start = high
    return phases


def allowed_tp(cfg, gpus: int, gpus_per_node: int) -> list[int]:
    m = cfg.model
    return [t for t in range(1, min(m.num_attention_heads, gpus_per_node, gpus) + 1)
            if m.num_attention_heads % t == 0 and m.ffn_hidden_size % t == 0 and gpus % t == 0]


def step_shape(cfg, layout: Layout, phase: Phase, on_gpu: bool = True, precision: str = "bf16") -> StepShape:
    """The memory model's input for a TrainConfig, a layout and a window."""
    m = cfg.model
    attention = m.execution.attention_backend
    if attention == "auto":  # backend.attention_backend's choice (the planner imports no torch)
        attention = "flex" if on_gpu else "dense"
    params_bytes = 2 if m.params_dtype == "bfloat16" else 4
    autocast = on_gpu and cfg.train.precision != "fp32"
    return StepShape(
        micro_batch=layout.micro_batch, seq_len=cfg.data.seq_len, tp=layout.tp, dp=layout.dp,
        k_L=phase.k_L, k_H=phase.k_H, recompute=layout.recompute,
        compute_bytes=2 if (autocast or params_bytes == 2) else 4, on_gpu=on_gpu,
        params_bytes=params_bytes, fully_shard=layout.fully_shard,
        # A config run with FSDP2, planned without it: the distributed optimizer (bf16 weights need it).
        distributed_optimizer=cfg.optim.distributed_optimizer or (cfg.optim.fully_shard
                                                                  and not layout.fully_shard),
        shard_optimizer=cfg.optim.shard_state, ema=cfg.optim.ema_decay > 0,
        loss_chunk_tokens=m.execution.loss_chunk_tokens, sequence_parallel=m.parallel.sequence_parallel,
        attention=attention, fp8_weight_copies=precision in ("fp8", "mxfp8"))


def one_process_step(cfg, micro_batch: int, k_L: int, k_H: int, on_gpu: bool) -> MemoryPlan:
    """The memory plan of one micro-batch's step of ``cfg`` on one process (no TP, no DP, the
    config's recompute), as `mimir bench` runs it: the figure to set beside its measured peak."""
    layout = Layout(tp=1, dp=1, micro_batch=micro_batch, accumulation=1,
                    recompute=str(cfg.model.execution.recompute))
    precision = "bf16" if cfg.model.execution.fp8 == "none" else "fp8"
    return plan_memory(cfg.model, step_shape(cfg, layout, Phase(k_L + k_H, k_L, k_H, 1), on_gpu, precision))


def plan_layout(cfg, layout: Layout, phases: list[Phase], cluster: Cluster, settings: RunSettings,
                usable: float, efficiency: float) -> LayoutPlan:
    largest = max(phases, key=lambda p: (p.k_L * cfg.model.num_layers_L + p.k_H * cfg.model.num_layers_H))
    memory = plan_memory(cfg.model, step_shape(cfg, layout, largest, precision=settings.precision))
    weights = params_per_rank(cfg.model, layout.tp)
    timed = [(p, step_time(cfg.model, cluster, tp=layout.tp, micro_batch=layout.micro_batch,
                           accumulation=layout.accumulation, seq_len=cfg.data.seq_len, k_L=p.k_L,
                           k_H=p.k_H, recompute=layout.recompute, efficiency=efficiency,
                           weights_per_rank=weights, zero=cfg.optim.shard_state and layout.dp > 1,
                           gather_bytes=(2 if cfg.model.params_dtype == "bfloat16" else 4)
                           if cfg.optim.distributed_optimizer or cfg.optim.fully_shard else None,
                           fully_shard=layout.fully_shard,
                           sequence_parallel=cfg.model.parallel.sequence_parallel))
             for p in phases]
    seconds = sum(p.steps * t.seconds for p, t in timed)
    tokens = sum(p.steps for p in phases) * cfg.train.global_batch_size * cfg.data.seq_len
    return LayoutPlan(layout=layout, memory=memory, fits=memory.peak <= usable, phases=timed,
                      seconds=seconds, tokens=tokens)


def candidate_layouts(cfg, gpus: int, gpus_per_node: int) -> list[Layout]:
    out = []
    for tp in allowed_tp(cfg, gpus, gpus_per_node):
        dp = gpus // tp
        if cfg.train.global_batch_size % dp:
            continue
        per_rank = cfg.train.global_batch_size // dp
        # FSDP2 shards over data-parallel ranks only: planned next to the config's own
        # sharding at TP=1 (and the config's FSDP2 next to the distributed optimizer).
        shardings = (False, True) if tp == 1 else (False,)
        for micro in (m for m in range(1, per_rank + 1) if per_rank % m == 0):
            for recompute in RECOMPUTE:
                out += [Layout(tp, dp, micro, per_rank // micro, recompute, fsdp) for fsdp in shardings]
    return out


def ranked(plans: list[LayoutPlan]) -> list[LayoutPlan]:
    """The layouts that fit, fastest first. The efficiency does not depend on the micro-batch,
    so equal times list the larger micro-batch first (larger matmuls run closer to peak)."""
    return sorted((p for p in plans if p.fits),
                  key=lambda p: (-round(p.tokens_per_s, 6), -p.layout.micro_batch, p.memory.peak))


def closest(fitting: list[LayoutPlan], tp: int, micro: int, recompute: str) -> LayoutPlan | None:
    """The fitting layout nearest the asked one (TP and micro-batch ratios, recompute), fastest
    among equals."""
    def distance(p: LayoutPlan) -> tuple[float, float]:
        lay = p.layout
        return (abs(math.log2(lay.tp / tp)) + abs(math.log2(lay.micro_batch / micro))
                + (lay.recompute != recompute), -p.tokens_per_s)

    return min(fitting, key=distance, default=None)


def plan_run(cfg, settings: RunSettings) -> RunPlan:
    """The plan of a TrainConfig on a cluster; raises :class:`UserError` (one line) for a
    layout the cluster cannot run and for a config that fits no layout."""
    s, gpu = settings, settings.gpu
    if s.gpus < 1 or s.nodes < 1 or s.gpus % s.nodes:
        raise UserError(f"--gpus ({s.gpus}) must be a positive multiple of --nodes ({s.nodes})")
    if not 0 < s.efficiency <= 1:
        raise UserError(f"--efficiency must be in (0, 1], got {s.efficiency}")
    if not 0 <= s.margin <= MAX_MARGIN:
        raise UserError(f"--margin is the share of GPU memory kept free, in [0, {MAX_MARGIN:g}]; "
                        f"got {s.margin:g}")
    if s.step_time_s is not None and s.mean_step_time_s is not None:
        raise UserError("give --step-time (the final window's step) or --mean-step-time (the whole "
                        "run's average), not both")
    for flag, value in (("--step-time", s.step_time_s), ("--mean-step-time", s.mean_step_time_s)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be > 0, got {value:g}")
    cluster = Cluster(gpus=s.gpus, nodes=s.nodes, peak_tflops=gpu.peak_tflops(s.precision),
                      nvlink_gbps=gpu.nvlink_one_way_gbps, network_gbps=gpu.network_gbps)
    phases = window_phases(cfg)
    usable = gpu.memory_gb * GB * (1 - s.margin)
    tp = s.tp or cfg.model.parallel.tensor_parallel_size
    micro = s.micro_batch or cfg.train.micro_batch_size
    recompute = s.recompute or str(cfg.model.execution.recompute)
    efficiency = s.efficiency

    candidates = candidate_layouts(cfg, s.gpus, cluster.gpus_per_node)
    if not candidates:
        tps = allowed_tp(cfg, s.gpus, cluster.gpus_per_node)
        dps = ", ".join(str(s.gpus // t) for t in tps)
        raise UserError(f"train.global_batch_size ({cfg.train.global_batch_size}) does not split over "
                        f"{s.gpus} GPUs: it must be a multiple of DP = GPUs / TP (DP {dps} for TP "
                        f"{', '.join(map(str, tps))}); use a GPU count whose DP divides it, or another "
                        "global batch")
    plans = [plan_layout(cfg, lay, phases, cluster, s, usable, efficiency) for lay in candidates]
    fitting = ranked(plans)
    where = f"{s.gpus} x {gpu.key.upper()} ({gpu.memory_gb:g} GB)"

    def nearest() -> str:
        near = closest(fitting, tp, micro, recompute)
        if near is None:
            return "no layout fits"
        return f"closest layout that fits: {near.layout.describe(cfg.data.seq_len)}"

    allowed = allowed_tp(cfg, s.gpus, cluster.gpus_per_node)
    if tp not in allowed:
        raise UserError(f"TP={tp} is not possible for {cfg.model.num_attention_heads} heads and FFN "
                        f"{cfg.model.ffn_hidden_size} on {s.gpus} GPUs, {cluster.gpus_per_node} per node "
                        f"(allowed: {', '.join(map(str, allowed))}); {nearest()}")
    dp = s.gpus // tp
    if cfg.optim.fully_shard and tp != 1:
        raise UserError(f"optim.fully_shard (FSDP2) shards over data-parallel ranks only: TP={tp} is not "
                        f"possible with it; {nearest()}")
    if cfg.train.global_batch_size % (micro * dp):
        raise UserError(f"train.global_batch_size ({cfg.train.global_batch_size}) is not a multiple of "
                        f"micro-batch {micro} x DP {dp}; {nearest()}")
    if not fitting:
        smallest = min(plans, key=lambda p: p.memory.peak, default=None)
        need = f"; the smallest layout, {smallest.layout.describe(cfg.data.seq_len)}, needs " \
               f"{smallest.memory.peak / GB:.1f} GB" if smallest else ""
        raise UserError(f"{cfg.source or 'the config'} fits no layout on {where} with a "
                        f"{s.margin:.0%} margin ({usable / GB:.0f} GB usable){need}")
    layout = Layout(tp, dp, micro, cfg.train.global_batch_size // (micro * dp), recompute,
                    cfg.optim.fully_shard)
    configured = next(p for p in plans if p.layout == layout)

    implied = None
    measured = s.step_time_s if s.step_time_s is not None else s.mean_step_time_s
    if measured is not None:
        if s.step_time_s is not None:
            efficiency = efficiency_from_step(s.step_time_s, configured.last_step, efficiency)
        else:
            efficiency = efficiency_from_mean_step(measured, configured.phases, efficiency)
        if not 0 < efficiency <= 1:
            raise UserError(f"a {measured:g} s step is faster than this GPU's peak allows for the "
                            "plan's FLOPs and communication: check --gpus, --gpu and the config")
        plans = [plan_layout(cfg, lay, phases, cluster, s, usable, efficiency) for lay in candidates]
        fitting = ranked(plans)
        configured = next(p for p in plans if p.layout == layout)
        final = configured.last_step
        implied = final.model_flops / final.seconds / s.gpus / (cluster.peak_tflops * 1e12)
    return RunPlan(source=cfg.source, settings=settings, cluster=cluster, seq_len=cfg.data.seq_len,
                   global_batch=cfg.train.global_batch_size, steps=cfg.train.steps, phases=phases,
                   configured=configured, ranked=fitting, efficiency=efficiency,
                   implied_mfu=implied)


def plan_stages(cfgs: list, settings: RunSettings) -> list[RunPlan]:
    """The plans of runs that follow one another on the same cluster (the paper's v1, then v1.5
    from its weights). A measured step (``step_time_s`` or ``mean_step_time_s``) calibrates the
    efficiency on the first stage; the later ones are planned at the efficiency it implies."""
    plans = [plan_run(cfgs[0], settings)]
    measured = settings.step_time_s is not None or settings.mean_step_time_s is not None
    later = replace(settings, efficiency=plans[0].efficiency, step_time_s=None, mean_step_time_s=None,
                    efficiency_from=f"{plans[0].source}'s measured step" if measured else None)
    return plans + [plan_run(cfg, later) for cfg in cfgs[1:]]
