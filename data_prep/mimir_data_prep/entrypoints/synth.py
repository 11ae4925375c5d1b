"""`mimir synth ACTION`: build training data. ``tools`` converts public function-calling data
(:func:`mimir_data_prep.tool_use.convert.convert_files`); ``run`` runs a generate-and-audit
pipeline (:func:`mimir_data_prep.synth_pipeline.runner.run_pipeline`). A new action adds its
parser and handler here."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    synth = sub.add_parser("synth", help="build training data: convert tool-use traces, generate and audit")
    ssub = synth.add_subparsers(dest="synth_command", required=True, metavar="ACTION")
    _register_tools(ssub)
    _register_run(ssub)


def _register_tools(ssub: argparse._SubParsersAction) -> None:
    p = ssub.add_parser(
        "tools",
        help="convert public function-calling data (xLAM, Glaive, Hermes, ToolACE) to native tool use",
        description="Read function-calling JSONL in xLAM, Glaive, Hermes or ToolACE format and write "
        "the chat format `mimir prepare` reads (tools, assistant tool_calls, tool messages with "
        "tool_call_id, final answer). Writes OUTPUT, OUTPUT's .rejects.jsonl and .report.json.",
    )
    p.add_argument("--input", "-i", nargs="+", required=True, help="JSONL or Parquet files")
    p.add_argument("--output", "-o", required=True, help="converted JSONL file")
    p.add_argument(
        "--format",
        choices=("auto", "xlam", "glaive", "hermes", "toolace"),
        default="auto",
        help="input format; auto detects it per line (default auto)",
    )
    p.add_argument(
        "--dangling",
        choices=("drop-part", "drop-sample"),
        default="drop-part",
        help="a call without a result or a result without a call: cut it out and keep the sample "
        "(counted as repaired; default), or reject the sample",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=cmd_tools)


def _register_run(ssub: argparse._SubParsersAction) -> None:
    p = ssub.add_parser(
        "run",
        help="run a generate-and-audit pipeline (resumable)",
        description="Generate candidates with one OpenAI-compatible endpoint, run the deterministic "
        "checks, audit with another, keep accepted rows in the chat format `mimir prepare` reads. "
        "Row-level evidence goes to an append-only state file; rerunning resumes.",
    )
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
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=cmd_run, extra="synth")


def cmd_tools(args: argparse.Namespace) -> int:
    from mimir_data_prep.tool_use.convert import convert_files, report_path

    report = convert_files(
        args.input, args.output, fmt=args.format, dangling=args.dangling, progress=not args.no_progress
    )
    print(
        f"{report['lines_read']} lines: {report['accepted']} accepted, {report['repaired']} repaired, "
        f"{report['rejected']} rejected; report: {report_path(Path(args.output))}"
    )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import logging

    from mimir_data_prep.synth_pipeline.acceptance import format_report
    from mimir_data_prep.synth_pipeline.pipeline import load_pipeline
    from mimir_data_prep.synth_pipeline.runner import RunOptions, default_output_dir, run_pipeline

    if not args.verbose:  # one line per HTTP request otherwise
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
