"""`mimir bench`: training-step throughput of this model next to the transformers `hrm_text` peer.

Both run the same shape, batch and window on one device: forward over all applications,
backward over the window, AdamW step. The peer's window is expressed through its
``L_bp_cycles`` (its H-applications always get gradients), which matches ``last_k`` exactly for
k = 5..8 (k=5: ``L_bp = [0, 3]``); other k are reported with the peer's nearest window.

Reports tokens/s, TFLOP/s (formula: :mod:`mimir_megatron.train.flops`), MFU when the device's
peak is known, step-time median and spread, and peak memory, as a table and as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch is imported when the command runs, not when the CLI starts
    import torch

log = logging.getLogger(__name__)

SHAPES = {"tiny": "configs/model/tiny.yaml", "mimir": "configs/model/mimir.yaml"}
# Dense bf16 peaks (TFLOP/s) of devices we know; MFU is left out elsewhere unless --peak-tflops.
PEAK_BF16 = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "A100": 312.0}


@dataclass
class BenchResult:
    name: str
    tokens_per_s: float
    tflops_per_s: float
    mfu: float | None
    step_median_s: float
    step_spread_s: float
    peak_memory_gb: float
    window: str


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="training-step throughput vs the transformers hrm_text peer")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--config", help="model YAML instead of --shape")
    p.add_argument("--window", type=int, default=5, help="bp window k (default 5)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("overrides", nargs="*", help="model key=value overrides")
    p.set_defaults(handler=cmd_bench)


def _repo_path(relative: str) -> Path:
    here = Path(relative)
    return here if here.is_file() else Path(__file__).resolve().parent.parent / relative


def _batch(vocab: int, micro_batch: int, seq_len: int, device: torch.device):
    import torch

    from mimir_megatron.batch import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (micro_batch, seq_len), generator=g)
    prefix = torch.zeros(micro_batch, seq_len, dtype=torch.bool)
    prefix[:, : seq_len // 2] = True
    labels = torch.randint(0, vocab, (micro_batch, seq_len), generator=g)
    labels[:, : seq_len // 2 - 1] = -100
    return Batch(ids, torch.arange(seq_len).repeat(micro_batch, 1),
                 torch.ones(micro_batch, seq_len, dtype=torch.long), prefix, labels).to(device)


def _time_steps(step: Callable[[], None], warmup: int, steps: int, device: torch.device) -> list[float]:
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _result(name: str, times: list[float], tokens: int, flops_per_token: float, peak: float | None,
            window: str) -> BenchResult:
    from mimir_megatron.backend import peak_memory_gb

    median = statistics.median(times)
    tflops = flops_per_token * tokens / median / 1e12
    return BenchResult(name=name, tokens_per_s=tokens / median, tflops_per_s=tflops,
                       mfu=tflops / peak if peak else None, step_median_s=median,
                       step_spread_s=max(times) - min(times), peak_memory_gb=peak_memory_gb(),
                       window=window)


def peer_l_bp_cycles(h_cycles: int, l_cycles: int, k: int) -> list[int]:
    """transformers' per-H-cycle trailing L iterations with grad that match last_k for k."""
    remaining = max(0, k - h_cycles)  # H-applications always get gradients in the peer
    cycles = []
    for _ in range(h_cycles):
        take = min(l_cycles, remaining)
        cycles.append(take)
        remaining -= take
    return list(reversed(cycles))


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from mimir_megatron import backend
    from mimir_megatron.config import load_config
    from mimir_megatron.model import build_model
    from mimir_megatron.train.flops import flops_per_token

    cfg = load_config(_repo_path(args.config or SHAPES[args.shape]), args.overrides)
    device = backend.device()
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    tokens = args.micro_batch * args.seq_len
    batch = _batch(cfg.vocab_size, args.micro_batch, args.seq_len, device)
    results = []

    model = build_model(cfg)
    plan = model.window_plan(args.window)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def ours() -> None:
        with autocast:
            out = model(batch, window=args.window, return_logits=False, validate=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    fpt = flops_per_token(cfg, plan.k_L, plan.k_H, args.seq_len)
    results.append(_result("mimir-megatron", _time_steps(ours, args.warmup, args.steps, device),
                           tokens, fpt, peak, plan.describe()))

    if not args.no_peer:
        results.append(_bench_peer(model, cfg, args, batch, tokens, peak, device, autocast))
    _report(results, args)
    return 0


def _bench_peer(model, cfg, args, batch, tokens, peak, device, autocast) -> BenchResult:
    import torch
    from transformers import AutoModelForCausalLM

    from mimir_megatron.interop import export_hf
    from mimir_megatron.train.flops import flops_per_token

    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model, Path(tmp) / "hf")
        peer = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32,
                                                    attn_implementation="sdpa").to(device).train()
    bp = peer_l_bp_cycles(cfg.h_cycles, cfg.l_cycles, args.window)
    peer.model.L_bp_cycles_padded = bp
    k_L, k_H = sum(bp), cfg.h_cycles
    opt = torch.optim.AdamW(peer.parameters(), lr=1e-4)
    valid = batch.segment_ids > 0

    def step() -> None:
        with autocast:
            out = peer(input_ids=batch.input_ids, attention_mask=valid.long(),
                       token_type_ids=batch.prefix_mask.long(), labels=batch.labels, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = _time_steps(step, args.warmup, args.steps, device)
    window = f"L_bp={bp} (k_L={k_L}, k_H={k_H})"
    return _result("transformers hrm_text", times, tokens,
                   flops_per_token(cfg, k_L, k_H, args.seq_len), peak, window)


def _report(results: list[BenchResult], args: argparse.Namespace) -> None:
    import torch

    header = (f"{'implementation':<24}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'step (s)':>10}"
              f"{'spread':>9}{'peak GB':>9}  window")
    print(header)
    print("-" * len(header))
    for r in results:
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
        print(f"{r.name:<24}{r.tokens_per_s:>12,.0f}{r.tflops_per_s:>10.3f}{mfu:>8}"
              f"{r.step_median_s:>10.3f}{r.step_spread_s:>9.3f}{r.peak_memory_gb:>9.2f}  {r.window}")
    if len(results) == 2:
        ratio = results[0].tokens_per_s / results[1].tokens_per_s
        print(f"ratio mimir-megatron / transformers (tokens/s): {ratio:.2f}")
    if args.json:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        payload = {"shape": args.config or args.shape, "window": args.window, "seq_len": args.seq_len,
                   "micro_batch": args.micro_batch, "device": device,
                   "date": time.strftime("%Y-%m-%d"), "results": [asdict(r) for r in results]}
        Path(args.json).write_text(json.dumps(payload, indent=2))
