"""`mimir train --config configs/train/FILE.yaml [key=value ...]`."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train (or resume) an HRM-Text model",
        description="Runs as one process, under torchrun, or under Slurm srun (rank and world "
        "size from RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS; MASTER_ADDR/MASTER_PORT from "
        "the environment). Resumes from <run.dir>/checkpoints/latest when present.",
    )
    p.add_argument("--config", required=True, help="train YAML, e.g. configs/train/demo.yaml")
    p.add_argument("--allow-data-change", action="store_true",
                   help="resume even though the data mixture changed")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume even though train/window/optim settings changed (recorded in MLflow)")
    p.add_argument("--skip-data-verify", action="store_true",
                   help="check the prepared data's structure only, not its sha256 against the manifests "
                        "(data.verify=false: for trusted, very large corpora)")
    p.add_argument("--reverify-data", action="store_true",
                   help="hash every prepared file, also those unchanged since an earlier start verified them "
                        "(data.verify_cache=false)")
    p.add_argument("overrides", nargs="*", help="OmegaConf dotlist overrides: section.key=value")
    p.set_defaults(handler=cmd_train, early_stop_signals=True)


def overrides_from(args: argparse.Namespace) -> list[str]:
    """The dotlist overrides, with the flags' settings appended."""
    overrides = list(args.overrides)
    if args.allow_data_change:
        overrides.append("checkpoint.allow_data_change=true")
    if args.allow_config_change:
        overrides.append("checkpoint.allow_config_change=true")
    if args.skip_data_verify:
        overrides.append("data.verify=false")
    if args.reverify_data:
        overrides.append("data.verify_cache=false")
    return overrides


def cmd_train(args: argparse.Namespace) -> int:
    from mimir_megatron.train.config import load_train_config

    # The config first: it imports neither torch nor megatron-core, so a mistake in it is reported
    # in well under a second; then the backend, explicitly, before the trainer imports the model.
    cfg = load_train_config(args.config, overrides_from(args))
    from mimir_megatron.process import setup_process

    setup_process(verbose=args.verbose, megatron=True)
    import torch.distributed as dist

    from mimir_megatron.train.loop import train

    try:
        result = train(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if result.exact_match is not None:
        print(f"exact match on the held-out split: {result.exact_match:.3f}")
    return 0
