"""A run plan as a table (for people) and as JSON (for tools, MLflow's plan.json)."""

from __future__ import annotations

from typing import Any

from mimir_megatron.train.plan.layouts import LayoutPlan, RunPlan
from mimir_megatron.train.plan.memory import GB

DAY = 86_400.0
EFFICIENCY_NOTE = ("the efficiency is one figure for every layout: its dependence on the micro-batch "
                   "(smaller matmuls run further from peak) is not modelled, so layouts that differ "
                   "only in micro-batch plan the same time")


def percent(fraction: float) -> str:
    """A fraction as the percentage it is, to 0.01 % (0.3042 -> 30.42%, 0.3 -> 30%): a given
    efficiency or margin is printed as given, not rounded to a whole percent."""
    return f"{round(fraction * 100, 2):g}%"


def layout_dict(p: LayoutPlan, plan: RunPlan) -> dict[str, Any]:
    lay, final = p.layout, p.last_step
    return {
        "tp": lay.tp, "dp": lay.dp, "micro_batch": lay.micro_batch, "accumulation": lay.accumulation,
        "recompute": lay.recompute, "sharding": lay.sharding, "fits": p.fits,
        "memory_gb": p.memory.terms_gb(),
        "step_time_s": round(final.seconds, 4),
        "step_compute_s": round(final.compute_s, 4),
        "dp_comm_s": round(final.dp_comm_s, 4), "dp_bytes_per_gpu": final.dp_bytes,
        "tp_comm_s": round(final.tp_comm_s, 4),
        "tp_bytes_per_application": final.tp_bytes_per_application,
        "tokens_per_s": round(p.tokens_per_s, 1),
        "tokens_per_s_per_gpu": round(p.tokens_per_s / plan.cluster.gpus, 1),
        "mfu": round(final.mfu(plan.cluster), 4),
        "mfu_matmul_only": round(final.matmul_mfu(plan.cluster), 4),
        "flops_per_step": final.model_flops, "matmul_flops_per_step": final.matmul_flops,
        "phases": [{"k": ph.k, "k_L": ph.k_L, "k_H": ph.k_H, "steps": ph.steps,
                    "step_time_s": round(t.seconds, 4), "flops_per_step": t.model_flops,
                    "hours": round(ph.steps * t.seconds / 3600, 2)} for ph, t in p.phases],
        "days": round(p.seconds / DAY, 2),
        "gpu_hours": round(p.seconds * plan.cluster.gpus / 3600, 0),
    }


def stage_dict(plan: RunPlan) -> dict[str, Any]:
    """One stage of a sequence of runs: its configured layout's cost."""
    c = plan.configured
    return {"config": plan.source, "steps": plan.steps, "tokens": c.tokens, "fits": c.fits,
            "peak_memory_gb": round(c.memory.peak / GB, 3), "step_time_s": round(c.last_step.seconds, 4),
            "efficiency": round(plan.efficiency, 4), "days": round(c.seconds / DAY, 2),
            "gpu_hours": round(c.seconds * plan.cluster.gpus / 3600, 0)}


def stages_total(stages: list[RunPlan]) -> dict[str, Any]:
    seconds = sum(p.configured.seconds for p in stages)
    return {"steps": sum(p.steps for p in stages), "days": round(seconds / DAY, 2),
            "gpu_hours": round(sum(p.configured.seconds * p.cluster.gpus for p in stages) / 3600, 0),
            "fits": all(p.configured.fits for p in stages)}


def to_dict(plan: RunPlan, top: int = 10, stages: list[RunPlan] | None = None) -> dict[str, Any]:
    """The plan as a dict; with ``stages`` (the runs this one starts, itself first), each
    stage's cost and their sum too (one stage, this plan's, otherwise)."""
    s, gpu = plan.settings, plan.settings.gpu
    stages = stages or [plan]
    return {
        "config": plan.source,
        "gpu": {"key": gpu.key, "name": gpu.name, "memory_gb": gpu.memory_gb,
                "peak_tflops": plan.cluster.peak_tflops, "precision": s.precision,
                "nvlink_gbps": gpu.nvlink_gbps, "nvlink_one_way_gbps": plan.cluster.nvlink_gbps,
                "network_gbps": gpu.network_gbps, "source": gpu.source},
        "gpus": s.gpus, "nodes": s.nodes, "margin": s.margin,
        "usable_gb": round(plan.usable_bytes / GB, 2),
        "efficiency": round(plan.efficiency, 4),
        "measured_step_time_s": s.step_time_s,
        "measured_mean_step_time_s": s.mean_step_time_s,
        "efficiency_model": EFFICIENCY_NOTE,
        "implied_mfu": None if plan.implied_mfu is None else round(plan.implied_mfu, 4),
        "seq_len": plan.seq_len, "global_batch": plan.global_batch, "steps": plan.steps,
        "tokens": plan.configured.tokens,
        "windows": [{"k": p.k, "k_L": p.k_L, "k_H": p.k_H, "steps": p.steps} for p in plan.phases],
        "configured": layout_dict(plan.configured, plan),
        "layouts": [layout_dict(p, plan) for p in plan.ranked[:top]],
        "stages": [stage_dict(p) for p in stages],
        "stages_total": stages_total(stages),
    }


def _gb(value: float) -> str:
    return f"{value / GB:.1f}"


def table(plan: RunPlan, top: int = 10) -> str:
    """The plan as text: the configured layout term by term, then the fitting layouts."""
    s, gpu, c = plan.settings, plan.settings.gpu, plan.configured
    m, final = c.memory, c.last_step
    lines = [
        f"plan of {plan.source} on {s.gpus} x {gpu.name}, {s.nodes} node(s), {s.precision} "
        f"(peak {plan.cluster.peak_tflops:g} TFLOP/s per GPU, {gpu.memory_gb:g} GB, "
        f"{plan.usable_bytes / GB:.1f} GB usable at a {percent(s.margin)} margin; GB = 1e9 bytes)",
        f"global batch {plan.global_batch} x {plan.seq_len} = {plan.global_batch * plan.seq_len:,} tokens "
        f"a step, {plan.steps:,} steps = {c.tokens / 1e9:.1f}B tokens; windows "
        + ", ".join(f"k={p.k} ({p.k_L}L+{p.k_H}H) x {p.steps:,}" for p in plan.phases),
    ]
    if s.step_time_s is not None:
        lines.append(f"a measured {s.step_time_s:g} s step (final window) implies MFU {plan.implied_mfu:.1%} "
                     f"and efficiency {percent(plan.efficiency)} (of peak, on the FLOPs actually run)")
    elif s.mean_step_time_s is not None:
        lines.append(f"a whole-run average of {s.mean_step_time_s:g} s a step implies efficiency "
                     f"{percent(plan.efficiency)} (of peak, on the FLOPs actually run): the final window's "
                     f"step {final.seconds:.3f} s, MFU {plan.implied_mfu:.1%}")
    elif s.efficiency_from:
        lines.append(f"efficiency {percent(plan.efficiency)} of peak, as {s.efficiency_from} implies")
    else:
        lines.append(f"efficiency assumed {percent(plan.efficiency)} of peak (calibrate: docs/planning.md)")
    lines.append(EFFICIENCY_NOTE)
    lines += [
        "",
        f"configured layout: {c.layout.describe(plan.seq_len)}: "
        + ("FITS" if c.fits else "DOES NOT FIT"),
        "  memory per GPU (GB), activations at the largest window:",
        f"    weights {_gb(m.weights)}  gradients {_gb(m.gradients)}  optimizer {_gb(m.optimizer)}  "
        f"master {_gb(m.master_weights)}  EMA {_gb(m.ema)}",
        f"    activations {_gb(m.activations)}  temporaries "
        + ", ".join(f"{k} {_gb(v)}" for k, v in m.temporaries.items()),
        "    optimizer phase " + ", ".join(f"{k} {_gb(v)}" for k, v in m.optimizer_phase.items()),
        f"    peak {_gb(m.peak)} of {plan.usable_bytes / GB:.1f} usable",
        f"  step (final window): {final.model_flops / 1e15:.2f} PFLOP with attention at "
        f"{plan.seq_len // 2} keys a token ({final.matmul_flops / 1e15:.2f} matmuls only), "
        f"{final.seconds:.3f} s (compute {final.compute_s:.3f}, DP comm {final.dp_comm_s:.3f}, "
        f"TP comm {final.tp_comm_s:.3f}), MFU {final.mfu(plan.cluster):.1%} "
        f"({final.matmul_mfu(plan.cluster):.1%} matmuls only)",
        f"  whole schedule: {c.seconds / DAY:.1f} days, {c.seconds * s.gpus / 3600:,.0f} GPU-hours, "
        f"{c.tokens_per_s:,.0f} tokens/s ({c.tokens_per_s / s.gpus:,.0f} a GPU)",
        "",
        f"layouts that fit, fastest first ({len(plan.ranked)} of them, top {min(top, len(plan.ranked))}):",
        f"  {'TP':>2} {'DP':>3} {'shard':>5} {'micro':>5} {'accum':>5} {'recompute':>9} {'peak GB':>7} "
        f"{'step s':>7} {'MFU':>6} {'tokens/s':>10} {'a GPU':>7} {'days':>6} {'GPU-h':>8}",
    ]
    for p in plan.ranked[:top]:
        lay = p.layout
        lines.append(f"  {lay.tp:>2} {lay.dp:>3} {lay.sharding:>5} {lay.micro_batch:>5} "
                     f"{lay.accumulation:>5} {lay.recompute:>9} {p.memory.peak / GB:>7.1f} "
                     f"{p.last_step.seconds:>7.3f} "
                     f"{p.last_step.mfu(plan.cluster):>6.1%} {p.tokens_per_s:>10,.0f} "
                     f"{p.tokens_per_s / s.gpus:>7,.0f} {p.seconds / DAY:>6.1f} "
                     f"{p.seconds * s.gpus / 3600:>8,.0f}")
    return "\n".join(lines)


def stages_table(stages: list[RunPlan]) -> str:
    """The runs one after the other: each stage's configured layout, days and GPU-hours, and
    their sum."""
    total = stages_total(stages)
    lines = [f"stages on {stages[0].settings.gpus} x {stages[0].settings.gpu.name}, one after the other "
             f"(efficiency {percent(stages[0].efficiency)} of peak):",
             f"  {'stage':<5} {'config':<34} {'steps':>10} {'peak GB':>7} {'fits':>4} {'step s':>7} "
             f"{'days':>6} {'GPU-h':>8}"]
    for n, p in enumerate(stages, 1):
        c = p.configured
        lines.append(f"  {n:<5} {p.source:<34} {p.steps:>10,} {c.memory.peak / GB:>7.1f} "
                     f"{'yes' if c.fits else 'NO':>4} {c.last_step.seconds:>7.3f} {c.seconds / DAY:>6.1f} "
                     f"{c.seconds * p.cluster.gpus / 3600:>8,.0f}")
    fits = "yes" if total["fits"] else "NO"
    lines.append(f"  {'total':<5} {'':<34} {total['steps']:>10,} {'':>7} {fits:>4} {'':>7} "
                 f"{total['days']:>6.1f} {total['gpu_hours']:>8,.0f}")
    return "\n".join(lines)
