"""Subcommands `mimir prepare`, `mimir data {report,demo,demo-tokenizer,pack}` and `mimir synth`."""

from __future__ import annotations

import argparse
import importlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# `mimir synth ACTION`: each module listed here exposes ``register_synth(subparsers)`` and adds its
# actions to the group (heavy imports inside the handlers). A new action adds its module here.
SYNTH_REGISTRARS = ("mimir_data_prep.tool_use.cli", "mimir_data_prep.synth_pipeline.cli")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize chat JSONL/Parquet into Megatron indexed datasets",
        description="Render conversations with a tokenizer's chat template and write a prepared "
        "dataset directory (shards/*.bin|.idx, manifest.json, rejects.jsonl).",
    )
    p.add_argument("--input", "-i", nargs="+", help="JSONL or Parquet files")
    p.add_argument("--tokenizer", "-t", help="Hugging Face tokenizer directory")
    p.add_argument("--output", "-o", help="output directory")
    p.add_argument(
        "--config",
        default=None,
        help="YAML listing several datasets (input, output, input_format, columns each); "
        "replaces -i/-t/-o (see data_prep/mimir_data_prep/prepare_config.py)",
    )
    p.add_argument("--seq-len", type=int, default=4096, help="context length (default 4096)")
    p.add_argument(
        "--too-long",
        choices=("drop", "truncate-prefix"),
        default="drop",
        help="what to do with samples longer than the context (default drop)",
    )
    p.add_argument("--min-response-tokens", type=int, default=2)
    p.add_argument(
        "--input-format",
        choices=("auto", "messages", "sharegpt", "alpaca", "columns"),
        default="auto",
        help="input layout; auto decides per file from its first lines (default auto)",
    )
    p.add_argument(
        "--columns",
        default=None,
        metavar="TARGET=COLUMN,...",
        help="column mapping for the columns layout, e.g. prompt=problem,completion=generated_solution "
        "(targets: prompt, completion, system, messages, tools)",
    )
    p.add_argument(
        "--control-chars",
        choices=("reject", "strip"),
        default="reject",
        help="lines with NUL or other control characters: reject them (default) or strip the characters",
    )
    p.add_argument(
        "--denylist",
        default=None,
        metavar="FILE",
        help="drop documents holding benchmark text that `mimir audit contamination --denylist` found "
        "(rejected as benchmark_overlap; docs/contamination.md)",
    )
    p.add_argument("--strict", action="store_true", help="stop at the first bad line")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: cores)")
    p.add_argument("--shard-mb", type=float, default=64.0, help="JSONL shard size in MiB")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=_prepare)

    data = sub.add_parser("data", help="demo data, mixture reports, packing index")
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")

    r = dsub.add_parser("report", help="tokens per epoch by category/language (Tables 1 and 8)")
    r.add_argument("--mixture", "-m", required=True, help="mixture YAML")
    r.add_argument("--top", type=int, default=10, help="datasets in the top list (default 10)")
    r.set_defaults(handler=_report)

    d = dsub.add_parser("demo", help="generate and prepare the bilingual demo data set")
    d.add_argument("--output", "-o", default="data/demo", help="output directory (default data/demo)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--train-per-group", type=int, default=3000)
    d.add_argument("--eval-per-group", type=int, default=100)
    d.add_argument("--tokenizer", default=None, help="default: the bundled demo tokenizer")
    d.add_argument("--seq-len", type=int, default=256)
    d.add_argument("--workers", type=int, default=None)
    d.add_argument("--no-prepare", action="store_true", help="only write the raw JSONL files")
    d.set_defaults(handler=_demo)

    t = dsub.add_parser("demo-tokenizer", help="retrain the demo tokenizer (deterministic)")
    t.add_argument("--output", "-o", default=None, help="default: data_prep/mimir_data_prep/demo/tokenizer")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(handler=_demo_tokenizer)

    k = dsub.add_parser("pack", help="build and cache the packing index ahead of training")
    k.add_argument("--mixture", "-m", required=True)
    k.add_argument("--seq-len", type=int, default=4096)
    k.add_argument("--seed", type=int, default=1234)
    k.add_argument("--pack-window", type=int, default=16384)
    k.add_argument("--index-dir", default=None)
    k.add_argument("--epochs", type=int, default=1, help="epochs to index (default 1)")
    k.set_defaults(handler=_pack)

    register_synth_group(sub)


def register_synth_group(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The `mimir synth` group, filled by every module in SYNTH_REGISTRARS; returns its subparsers."""
    synth = sub.add_parser("synth", help="build training data: convert tool-use traces, generate and audit")
    ssub = synth.add_subparsers(dest="synth_command", required=True, metavar="ACTION")
    for module_name in SYNTH_REGISTRARS:
        importlib.import_module(module_name).register_synth(ssub)
    return ssub


def _prepare(args: argparse.Namespace) -> int:
    from mimir_megatron.errors import UserError

    if args.config:
        if args.input or args.output or args.tokenizer:
            raise UserError("--config names inputs, outputs and the tokenizer; drop -i/-o/-t")
        from .prepare_config import run_prepare_config

        run_prepare_config(args.config, progress=not args.no_progress, workers=args.workers,
                           denylist=args.denylist)
        return 0
    missing = [
        flag for flag, value in (("-i", args.input), ("-t", args.tokenizer), ("-o", args.output)) if not value
    ]
    if missing:
        raise UserError(f"mimir prepare needs {', '.join(missing)} (or --config FILE.yaml)")
    from .prepare import prepare

    prepare(
        args.input,
        args.tokenizer,
        args.output,
        seq_len=args.seq_len,
        too_long=args.too_long,
        min_response_tokens=args.min_response_tokens,
        strict=args.strict,
        input_format=args.input_format,
        columns=args.columns,
        control_chars=args.control_chars,
        workers=args.workers,
        shard_bytes=max(1, int(args.shard_mb * 1024 * 1024)),
        progress=not args.no_progress,
        denylist=args.denylist,
    )
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import report

    print(report(args.mixture, args.top))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo_data import write_demo
    from .demo_tokenizer import DEMO_TOKENIZER_DIR

    out = Path(args.output)
    train_paths, eval_path = write_demo(out, args.seed, args.train_per_group, args.eval_per_group)
    log.info("wrote %d train files and %s", len(train_paths), eval_path)
    if args.no_prepare:
        return 0
    from .prepare import prepare

    tokenizer = args.tokenizer or DEMO_TOKENIZER_DIR
    for path in train_paths + [eval_path]:
        prepare(
            [path],
            tokenizer,
            out / path.stem,
            seq_len=args.seq_len,
            workers=args.workers or 1,
            progress=False,
        )
    return 0


def _demo_tokenizer(args: argparse.Namespace) -> int:
    from .demo_tokenizer import DEMO_TOKENIZER_DIR, train_demo_tokenizer

    out = train_demo_tokenizer(Path(args.output) if args.output else DEMO_TOKENIZER_DIR, args.seed)
    log.info("demo tokenizer written to %s", out)
    return 0


def _pack(args: argparse.Namespace) -> int:
    from mimir_megatron.data import DataConfig, PackedMixture, padding_fraction

    cfg = DataConfig(
        mixture=args.mixture,
        seq_len=args.seq_len,
        seed=args.seed,
        pack_window=args.pack_window,
        index_dir=args.index_dir,
    )
    stream = PackedMixture(cfg)
    for epoch in range(args.epochs):
        index = stream.epoch(epoch)
        pad = padding_fraction(index, stream.sample_lengths, cfg.seq_len)
        print(f"epoch {epoch}: {index.num_contexts:,} contexts, padding {100 * pad:.2f} %")
    print(f"index cached in {stream.index_dir}")
    return 0
