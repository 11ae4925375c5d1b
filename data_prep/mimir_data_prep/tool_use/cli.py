"""`mimir synth tools`: registered into the `synth` group by mimir_data_prep.cli."""

from __future__ import annotations

import argparse


def register_synth(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
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
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=_tools)


def _tools(args: argparse.Namespace) -> int:
    from .convert import convert_files

    report = convert_files(
        args.input, args.output, fmt=args.format, dangling=args.dangling, progress=not args.no_progress
    )
    print(
        f"{report['lines_read']} lines: {report['accepted']} accepted, {report['repaired']} repaired, "
        f"{report['rejected']} rejected; report: {args.output.removesuffix('.jsonl')}.report.json"
    )
    return 0
