"""`mimir info`, `mimir export`, `mimir import`: model inspection and conversion commands."""

from __future__ import annotations

import argparse
import json
import logging

from mimir_megatron.checkpoint import add_model_arguments, model_dir_from_args

log = logging.getLogger("mimir")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="parameter counts of a model config (no weights allocated)")
    p.add_argument("--config", required=True, help="model YAML, e.g. configs/model/mimir.yaml")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the model config")
    p.set_defaults(handler=cmd_info, setup="megatron")

    p = sub.add_parser("export", help="write a transformers hrm_text model directory")
    p.add_argument("--config", help="model YAML (with --seed: a freshly initialised model)")
    src = add_model_arguments(p)
    src.add_argument("--seed", type=int, help="a freshly initialised model from this seed (with --config)")
    p.add_argument("--output", required=True, help="directory to write")
    p.add_argument("--tokenizer", help="tokenizer directory to copy alongside")
    card = p.add_argument_group(
        "model card", "README.md (a Hugging Face model card) and training_data_summary.md/.json are "
        "written beside the weights; from a training checkpoint they hold its data lineage")
    card.add_argument("--name", help="the model's name in the card (default: the output directory's name)")
    card.add_argument("--license", help="the model's licence, an SPDX id (default: 'other', unspecified)")
    card.add_argument("--provider", help="who places the model on the market (the EU summary's provider)")
    card.add_argument("--provider-contact", help="how to reach the provider (the EU summary's contact)")
    card.add_argument("--model-version", help="the model's version (default: the checkpoint's step)")
    card.add_argument("--placed-on-market", metavar="YYYY-MM-DD",
                      help="the date the model is placed on the EU market (the EU summary's section 1)")
    card.add_argument("--accept-licence-risk", action="store_true",
                      help="release under a --license that drops copyleft, non-commercial or other terms "
                      "of the training data (refused otherwise); the card states it")
    card.add_argument("--base-model", help="Hub id of the weights training started from (default: the "
                      "init_from path the checkpoint records)")
    card.add_argument("--contamination", nargs="+", metavar="REPORT",
                      help="`mimir audit contamination` reports (files or directories) for the summary's "
                      "decontamination section (default: those in the training run's contamination/)")
    tracking = p.add_argument_group(
        "MLflow", "an export of a training checkpoint becomes a LoggedModel of its training run (its files, "
        "the run's metrics at the checkpoint's step, the lineage), card and summary also in the run")
    tracking.add_argument("--register", metavar="NAME",
                          help="also register it in the MLflow model registry as NAME, with the card")
    tracking.add_argument("--no-mlflow", action="store_true", help="do not log the export to MLflow")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the model config")
    p.set_defaults(handler=cmd_export, extra="hf", setup="megatron")

    p = sub.add_parser("import", help="convert a transformers hrm_text model into project weights")
    p.add_argument("--hf", required=True, help="transformers hrm_text model directory")
    p.add_argument("--output", required=True, help="project weights directory to write")
    p.set_defaults(handler=cmd_import, setup="megatron")


def cmd_info(args: argparse.Namespace) -> int:
    from mimir_megatron.config import load_config
    from mimir_megatron.model import build_model, count_parameters

    cfg = load_config(args.config, args.overrides)
    counts = count_parameters(build_model(cfg, device="meta"))
    info = {
        "total": counts.total,
        "embedding": counts.embedding,
        "head": counts.head,
        "non_embedding": counts.non_embedding,
        "stack_L": counts.stack_L,
        "stack_H": counts.stack_H,
        "fixed_buffers": counts.buffers,
        "schedule": "".join(("L" * cfg.l_cycles + "H") * cfg.h_cycles),
        "padded_vocab_size": cfg.padded_vocab_size,
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            text = f"{value:,}" if isinstance(value, int) else str(value)
            print(f"{key:<{width}}  {text:>15}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from mimir_megatron.config import load_config
    from mimir_megatron.errors import UserError
    from mimir_megatron.model import build_model
    from mimir_megatron.release.export import ReleaseDetails, export_model

    record = None
    if args.seed is not None:
        if not args.config:
            raise UserError("--seed needs --config (the model shape to initialise)")
        model = build_model(load_config(args.config, [*args.overrides, f"seed={args.seed}"]))
        origin = f"freshly initialised weights (seed {args.seed})"
        tokenizer = args.tokenizer or model.cfg.tokenizer  # a model with no directory: its config's
    else:
        source = model_dir_from_args(args)
        model = source.load(ema=args.ema, overrides=args.overrides)
        record = source.record
        origin = f"{source.kind} ({source.path})"
        tokenizer = source.tokenizer_or(args.tokenizer)
    details = ReleaseDetails(
        name=args.name, license=args.license, provider=args.provider, provider_contact=args.provider_contact,
        model_version=args.model_version, placed_on_market=args.placed_on_market, base_model=args.base_model,
        accept_licence_risk=args.accept_licence_risk, contamination=args.contamination)
    export_model(model, args.output, details, record=record, origin=origin, ema=args.ema,
                 tokenizer=tokenizer, register=args.register, mlflow=not args.no_mlflow)
    print(f"exported to {args.output}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from mimir_megatron.interop import import_hf, save_weights

    model = import_hf(args.hf)
    save_weights(model, args.output)
    print(f"imported {args.hf} -> {args.output}")
    return 0
