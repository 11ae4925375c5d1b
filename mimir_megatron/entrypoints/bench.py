"""`mimir bench` arguments and the command: which variants run, in which order, on which batch.

Our model can be measured in several variants in one run (``--variant``), each a set of model
overrides: the speed levers (attention kernel, layer backend and FP8, torch.compile, recompute,
chunked loss) are all model settings. A variant that fails (out of memory, a missing library)
is reported with its error; the others still run. Several windows (``--window 5,8``) are
measured on the same model of each variant, so a run builds, exports and compiles once.

Order (:func:`run_order`): the variants as given, except that compiled ones go last (a compile
takes minutes, so under a time limit it is the one to lose), and the peer runs right after the
first variant, so a run cut short still has a ratio.

Reports tokens/s, TFLOP/s (formula: :mod:`mimir_megatron.train.flops`), MFU when the device's
peak is known (``--peak-tflops``, else the GPU table of :mod:`mimir_megatron.train.plan.gpus`),
step-time median and spread, and peak memory, as a table and as JSON.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from mimir_megatron.bench.shapes import SHAPES


@dataclass
class Variant:
    """One configuration of our model to measure: a name and model ``key=value`` overrides."""

    name: str
    overrides: list[str]


PEER = None
"""Stands for the transformers peer in a run order."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="the trainer's step vs the transformers hrm_text peer")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                   help="tiny (D=256), mid (D=768, 4+4 layers, vocab 32k) or mimir (the 1.78B shape)")
    p.add_argument("--config", help="model YAML instead of --shape")
    p.add_argument("--window", type=parse_windows, default=[5], metavar="K[,K...]",
                   help="bp window k, or several (5,8) measured on the same models (default 5)")
    p.add_argument("--seq-len", type=int, default=256, help="context length (default 256)")
    p.add_argument("--micro-batch", type=int, default=4, help="contexts per step (default 4)")
    p.add_argument("--samples-per-context", type=int, default=1,
                   help="packed samples per context (the PrefixLM kernels' sparsity depends on it)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (and compilation)")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="compute precision: auto = bf16 autocast on GPU, fp32 on CPU")
    p.add_argument("--optimizer", choices=("adamw", "adam_atan2"), default="adamw",
                   help="optimizer of both (ours keeps its per-module groups)")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of both (default 1e-4)")
    p.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clip of both (0: none)")
    p.add_argument("--ema-decay", type=float, default=0.9999, help="EMA of the weights in both (0: none)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                   help="measure our model with these extra overrides (repeatable), e.g. "
                        "'flex+compile:execution.attention_backend=flex,execution.compile=true'")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    p.add_argument("--peer-checkpointing", action="store_true",
                   help="gradient checkpointing in the peer (compare with execution.recompute=full "
                        "variants; the peer needs it to fit the Mimir shape at 4 x 4096 tokens)")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("overrides", nargs="*", help="model key=value overrides for every variant")
    p.set_defaults(handler=cmd_bench, setup="megatron")


def parse_variant(text: str) -> Variant:
    """``NAME:key=value,key=value`` (or just ``NAME`` for the shared settings)."""
    name, _, rest = text.partition(":")
    if not name.strip():
        raise ValueError(f"variant {text!r} needs a name before ':'")
    overrides = [item.strip() for item in rest.split(",") if item.strip()]
    bad = [item for item in overrides if "=" not in item]
    if bad:
        raise ValueError(f"variant {name!r}: expected key=value, got {', '.join(bad)}")
    return Variant(name.strip(), overrides)


def parse_windows(text: str) -> list[int]:
    """``5`` or ``5,8``: the bp windows to measure, in that order."""
    try:
        windows = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K or K,K,..., got {text!r}") from None
    if not windows or any(k < 1 for k in windows):
        raise argparse.ArgumentTypeError(f"windows must be positive integers, got {text!r}")
    return windows


def is_compiled(variant: Variant, shared: Sequence[str] = ()) -> bool:
    """Whether the variant's settings (shared ones first, its own override them) compile."""
    value = None
    for item in [*shared, *variant.overrides]:
        key, _, v = item.partition("=")
        if key.strip().removeprefix("model.") == "execution.compile":
            value = v.strip().lower()
    return value in ("true", "1", "yes", "on")


def run_order(variants: list[Variant], peer: bool, shared: Sequence[str] = ()) -> list[Variant | None]:
    """The measuring order: uncompiled variants as given, then compiled ones; the peer
    (:data:`PEER`) right after the first."""
    order: list[Variant | None] = sorted(variants, key=lambda v: is_compiled(v, shared))
    if peer:
        order.insert(min(1, len(order)), PEER)
    return order


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from mimir_megatron import backend
    from mimir_megatron.bench.measure import BenchSetup, SharedWeights, StepSettings, bench_batch
    from mimir_megatron.bench.ours import bench_ours
    from mimir_megatron.bench.peer import bench_peer
    from mimir_megatron.bench.report import Report
    from mimir_megatron.bench.shapes import model_config
    from mimir_megatron.train.flops import attended_keys_per_token

    variants = [parse_variant(v) for v in args.variant] or [Variant("mimir-megatron", [])]
    configs = {v.name: model_config(args.shape, args.config, [*args.overrides, *v.overrides])
               for v in variants}
    device = backend.device()
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        # The project's one GPU table (mimir_megatron/train/plan/gpus.yaml); unknown: no MFU.
        from mimir_megatron.train.plan.gpus import spec_for_device

        spec = spec_for_device(torch.cuda.get_device_name(device))
        peak = spec.bf16_tflops if spec is not None else None
    first = next(iter(configs.values()))
    batch = bench_batch(first.vocab_size, args.micro_batch, args.seq_len, args.samples_per_context)
    step = StepSettings(optimizer=args.optimizer, lr=args.lr, clip_grad=args.clip_grad,
                        ema_decay=args.ema_decay)
    setup = BenchSetup(windows=args.window, tokens=args.micro_batch * args.seq_len, seq_len=args.seq_len,
                       batch=batch.to(device), device=device, precision=args.precision,
                       peak_tflops=peak, warmup=args.warmup, steps=args.steps,
                       attended_keys=attended_keys_per_token(batch.segment_ids, batch.prefix_mask).item(),
                       step=step)
    report = Report(args, device, setup.attended_keys)
    weights = SharedWeights()
    for item in run_order(variants, peer=not args.no_peer, shared=args.overrides):
        if item is PEER:
            results = bench_peer(first, setup, weights, args.peer_checkpointing)
        else:
            results = bench_ours(item.name, configs[item.name], setup, weights)
        for result in results:
            report.add(result)
    report.finish()
    return 0 if all(r.error is None for r in report.results) else 1
