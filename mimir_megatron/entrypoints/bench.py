"""`mimir bench`: its arguments; the run is :func:`mimir_megatron.bench.run.run_bench`.

Reports tokens/s, TFLOP/s (formula: :mod:`mimir_megatron.train.flops`), MFU when the device's
peak is known (``--peak-tflops``, else the GPU table of :mod:`mimir_megatron.gpus`),
step-time median and spread, and peak memory, as a table and as JSON.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mimir_megatron.bench.run import BenchRequest, Variant
from mimir_megatron.bench.shapes import SHAPES


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


def cmd_bench(args: argparse.Namespace) -> int:
    from mimir_megatron.bench.run import run_bench

    report = run_bench(BenchRequest(
        shape=args.shape, config=args.config, windows=tuple(args.window), seq_len=args.seq_len,
        micro_batch=args.micro_batch, samples_per_context=args.samples_per_context, steps=args.steps,
        warmup=args.warmup, precision=args.precision, optimizer=args.optimizer, lr=args.lr,
        clip_grad=args.clip_grad, ema_decay=args.ema_decay,
        variants=tuple(parse_variant(v) for v in args.variant), overrides=tuple(args.overrides),
        peer=not args.no_peer, peer_checkpointing=args.peer_checkpointing, peak_tflops=args.peak_tflops,
        json_path=Path(args.json) if args.json else None))
    return 0 if all(r.error is None for r in report.results) else 1
