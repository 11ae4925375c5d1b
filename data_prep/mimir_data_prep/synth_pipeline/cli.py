"""`mimir synth run`: the parser (light imports) and its handler.

``register_synth_run(synth_subparsers)`` adds ``run`` to the ``mimir synth`` group; ``main()``
is the same command standalone (``python -m mimir_data_prep.synth_pipeline``).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pipeline", help="pipeline YAML (see configs/synth/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, e.g. endpoints.generator.base_url=http://host:8000/v1")
    p.add_argument("--output", "-o", default=None,
                   help="state and output directory (default: output.dir of the YAML, else synth/NAME)")
    p.add_argument("--concurrency", "-n", type=int, default=None, help="rows in flight (default: YAML)")
    p.add_argument("--retry-errors", action="store_true",
                   help="redo rows recorded with status error (requests the server refused)")
    p.add_argument("--allow-pipeline-change", action="store_true",
                   help="resume although prompts/models/checks changed (finished rows are kept)")
    p.add_argument("--check", action="store_true", help="validate the pipeline and exit")
    p.add_argument("--no-progress", action="store_true")


def register_synth_run(synth_subparsers: argparse._SubParsersAction) -> None:
    p = synth_subparsers.add_parser(
        "run",
        help="run a generate-and-audit pipeline (resumable)",
        description="Generate candidates with one OpenAI-compatible endpoint, run the deterministic "
        "checks, audit with another, keep accepted rows in the chat format `mimir prepare` reads. "
        "Row-level evidence goes to an append-only state file; rerunning resumes.",
    )
    _add_arguments(p)
    p.set_defaults(handler=run_command, extra="synth")


# The `mimir synth` group (data_prep/mimir_data_prep/cli.py) calls ``register_synth`` of each module it lists.
register_synth = register_synth_run


def run_command(args: argparse.Namespace) -> int:
    from mimir_megatron.errors import UserError

    try:
        import openai  # noqa: F401
    except ImportError:
        raise UserError("`mimir synth run` needs the openai client: "
                        "pip install 'mimir-megatron[synth]'") from None
    from .acceptance import format_report
    from .pipeline import load_pipeline
    from .runner import RunOptions, default_output_dir, run_pipeline

    import logging

    if not getattr(args, "verbose", False):  # one line per HTTP request otherwise
        for name in ("httpx", "httpx2", "openai"):
            logging.getLogger(name).setLevel(logging.WARNING)
    pipeline = load_pipeline(args.pipeline, args.overrides)
    if args.check:
        print(f"{args.pipeline}: valid ({pipeline.config.name}, source {pipeline.source_path})")
        return 0
    out = Path(args.output) if args.output else default_output_dir(pipeline)
    report = run_pipeline(pipeline, RunOptions(
        output_dir=out, concurrency=args.concurrency, retry_errors=args.retry_errors,
        allow_pipeline_change=args.allow_pipeline_change, progress=not args.no_progress))
    print(format_report(report))
    print(f"accepted rows: {out / 'accepted.jsonl'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point with the same error handling as `mimir`."""
    import logging

    from mimir_megatron.errors import UserError
    from mimir_megatron.logging_setup import setup_logging

    parser = argparse.ArgumentParser(prog="python -m mimir_data_prep.synth_pipeline",
                                     description="Run a generate-and-audit pipeline.")
    parser.add_argument("-v", "--verbose", action="store_true")
    _add_arguments(parser)
    args = parser.parse_intermixed_args(argv)  # KEY=VALUE may also follow the options here
    setup_logging(verbose=args.verbose)
    try:
        return run_command(args)
    except KeyboardInterrupt:
        return 130
    except UserError as exc:
        if args.verbose:
            raise
        logging.getLogger("mimir").error("%s", exc)
        return 2
