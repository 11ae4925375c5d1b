"""The transformers ``hrm_text`` peer, given the same weights, batch, window and step work:
forward over all applications, backward over the window, gradient-norm clipping, the same
optimizer (one group: the peer has no per-module learning rates), EMA.

The peer's window is expressed through its ``L_bp_cycles`` (its H-applications always get
gradients), which matches ``last_k`` exactly for k = 5..8 (k=5: ``L_bp = [0, 3]``); other k are
reported with the peer's nearest window. The peer is never compiled.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mimir_megatron.bench.measure import (
    BenchResult,
    BenchSetup,
    SharedWeights,
    autocast,
    failed,
    measure_windows,
    release,
    result,
    time_steps,
)

if TYPE_CHECKING:
    from mimir_megatron.config import ModelConfig

PEER_NAME = "transformers hrm_text"


def peer_l_bp_cycles(h_cycles: int, l_cycles: int, k: int) -> list[int]:
    """transformers' per-H-cycle trailing L iterations with grad that match last_k for k."""
    remaining = max(0, k - h_cycles)  # H-applications always get gradients in the peer
    cycles = []
    for _ in range(h_cycles):
        take = min(l_cycles, remaining)
        cycles.append(take)
        remaining -= take
    return list(reversed(cycles))


PeerStepFor = Callable[[int], tuple[Callable[[], None], list[int]]]
"""``step_for(k)``: one peer step with the window nearest k, and its ``L_bp_cycles``."""


def peer_steps(cfg: ModelConfig, setup: BenchSetup, weights: SharedWeights,
               checkpointing: bool) -> tuple[PeerStepFor, dict[str, Any]]:
    """The peer on ``setup``'s batch with ``weights``: ``(step_for, settings)``. Raises what
    loading it raises."""
    import torch
    from transformers import AutoModelForCausalLM

    from mimir_megatron.interop import export_hf
    from mimir_megatron.train.optim import AdamAtan2

    s = setup.step
    release(setup.device)
    # Checked before the export and load, which take minutes at the Mimir shape.
    if int(setup.batch.segment_ids.max()) > 1:
        raise ValueError("the transformers peer cannot express packed samples "
                         "(use --samples-per-context 1, or --no-peer)")
    with tempfile.TemporaryDirectory() as tmp:
        plain = replace(cfg.execution, layer_backend="local", fp8="none", compile=False)
        local = replace(cfg, execution=plain)  # never compiled
        export_hf(weights.model(local, torch.device("cpu")), Path(tmp) / "hf")
        peer = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32,
                                                    attn_implementation="sdpa")
    peer = peer.to(setup.device).train()
    if checkpointing:  # non-reentrant: the first grad application's inputs need no grad
        peer.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in peer.parameters() if p.requires_grad]
    opt = (AdamAtan2(params, lr=s.lr, weight_decay=0.1) if s.optimizer == "adam_atan2"
           else torch.optim.AdamW(params, lr=s.lr, weight_decay=0.1))
    shadow = [p.detach().clone() for p in params] if s.ema_decay > 0 else []
    batch, cast = setup.batch, autocast(setup)
    valid = batch.segment_ids > 0
    settings = {"attention": "sdpa", "gradient_checkpointing": checkpointing, "optimizer": s.optimizer,
                "clip_grad": s.clip_grad, "ema_decay": s.ema_decay}

    def step() -> None:
        with cast:
            out = peer(input_ids=batch.input_ids, attention_mask=valid.long(),
                       token_type_ids=batch.prefix_mask.long(), labels=batch.labels, use_cache=False)
        out.loss.backward()
        if s.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, s.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if shadow:
            with torch.no_grad():
                torch._foreach_lerp_(shadow, [p.detach() for p in params], 1 - s.ema_decay)

    def step_for(k: int):
        bp = peer_l_bp_cycles(cfg.h_cycles, cfg.l_cycles, k)
        peer.model.L_bp_cycles_padded = bp
        return step, bp

    return step_for, settings


def bench_peer(cfg: ModelConfig, setup: BenchSetup, weights: SharedWeights,
               checkpointing: bool) -> list[BenchResult]:
    from mimir_megatron.train.flops import flops_per_token

    try:
        step_for, settings = peer_steps(cfg, setup, weights, checkpointing)
    except Exception as exc:  # noqa: BLE001
        return [failed(PEER_NAME, exc, setup.device, k) for k in setup.windows]

    def measure(k: int) -> BenchResult:
        step, bp = step_for(k)
        k_L, k_H = sum(bp), cfg.h_cycles
        times = time_steps(step, setup.warmup, setup.steps, setup.device)
        fpt = flops_per_token(cfg, k_L, k_H, setup.seq_len, attended_keys=setup.attended_keys)
        return result(PEER_NAME, times, setup, fpt, f"L_bp={bp} (k_L={k_L}, k_H={k_H})", settings, k)

    return list(measure_windows(PEER_NAME, setup, measure))
