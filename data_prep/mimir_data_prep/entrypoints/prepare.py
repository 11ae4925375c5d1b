"""`mimir prepare`: chat JSONL/Parquet into a prepared dataset (:func:`mimir_data_prep.prepare.prepare`),
or every dataset of a prepare config (:func:`mimir_data_prep.prepare_config.run_prepare_config`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..layouts import INPUT_FORMATS
from ..personal_data import POLICIES as PERSONAL_DATA_POLICIES
from ..records import CONTROL_CHAR_POLICIES
from ..settings import TOO_LONG_POLICIES, PrepareOptions
from .provenance_flags import add_provenance_flags, given_provenance_flags, provenance_from_flags

DEFAULTS = PrepareOptions()  # the one list of prepare's options and their defaults


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
    p.add_argument("--seq-len", type=int, default=DEFAULTS.seq_len,
                   help=f"context length (default {DEFAULTS.seq_len})")
    p.add_argument(
        "--too-long",
        choices=TOO_LONG_POLICIES,
        default=DEFAULTS.too_long,
        help=f"what to do with samples longer than the context (default {DEFAULTS.too_long})",
    )
    p.add_argument("--min-response-tokens", type=int, default=DEFAULTS.min_response_tokens,
                   help=f"reject samples whose assistant turns hold fewer tokens "
                   f"(default {DEFAULTS.min_response_tokens})")
    p.add_argument(
        "--input-format",
        choices=INPUT_FORMATS,
        default=DEFAULTS.input_format,
        help=f"input layout; auto decides per file from its first lines (default {DEFAULTS.input_format})",
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
        choices=CONTROL_CHAR_POLICIES,
        default=DEFAULTS.control_chars,
        help=f"lines with NUL or other control characters: reject them or strip the characters "
        f"(default {DEFAULTS.control_chars})",
    )
    p.add_argument(
        "--denylist",
        default=None,
        metavar="FILE",
        help="drop documents holding benchmark text that `mimir audit contamination --denylist` found "
        "(rejected as benchmark_overlap; docs/contamination.md)",
    )
    p.add_argument(
        "--personal-data",
        choices=PERSONAL_DATA_POLICIES,
        default=None,
        help="documents holding personal data (e-mail, phone, IBAN, payment card, national id incl. "
        "the Danish "
        "CPR, IP address): reject those with a direct identifier (default), redact every one found, or only "
        "report the counts (the manifest's personal_data; docs/data-governance.md); with --config it "
        "replaces the file's setting",
    )
    p.add_argument("--strict", action="store_true", help="stop at the first bad line")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: cores)")
    p.add_argument("--shard-mb", type=float, default=64.0, help="JSONL shard size in MiB")
    p.add_argument("--part", default=None, metavar="I/N|START:END",
                   help="prepare only these shards (the I-th of N ranges from 0, or shard ids START:END) and "
                   "write no manifest: one job of a Slurm array (launchers/prepare_array.sh)")
    p.add_argument("--merge", action="store_true",
                   help="after every --part finished: check all shards are there and write the manifest")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_provenance_flags(p)
    p.set_defaults(handler=cmd_prepare)


def _check_combination(args: argparse.Namespace) -> None:
    """One line for flags that do not go together (argparse cannot say these)."""
    from mimir_megatron.errors import UserError

    if args.part and args.merge:
        raise UserError("--part prepares a range of shards, --merge assembles them afterwards: give one")
    if args.config:
        if args.part or args.merge:
            raise UserError("--part/--merge prepare one dataset over several jobs: "
                            "use -i/-t/-o, not --config")
        if args.input or args.output or args.tokenizer:
            raise UserError("--config names inputs, outputs and the tokenizer; drop -i/-o/-t")
        if flags := given_provenance_flags(args):
            raise UserError("--config declares provenance per dataset (a provenance section); "
                            f"drop {', '.join(flags)}")
        return
    missing = [
        flag for flag, value in (("-i", args.input), ("-t", args.tokenizer), ("-o", args.output)) if not value
    ]
    if missing:
        raise UserError(f"mimir prepare needs {', '.join(missing)} (or --config FILE.yaml)")


def cmd_prepare(args: argparse.Namespace) -> int:
    _check_combination(args)
    if args.config:
        from mimir_data_prep.prepare_config import run_prepare_config

        run_prepare_config(args.config, progress=not args.no_progress, workers=args.workers,
                           denylist=args.denylist, personal_data=args.personal_data)
        return 0
    from mimir_data_prep.prepare import prepare

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
        provenance=provenance_from_flags(args, default_id=Path(args.output).name, output=args.output),
        denylist=args.denylist,
        personal_data=args.personal_data or DEFAULTS.personal_data,
        part=args.part,
        merge=args.merge,
    )
    return 0
