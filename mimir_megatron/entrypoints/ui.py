"""`mimir ui`: browse training runs in the MLflow UI."""

from __future__ import annotations

import argparse

from mimir_megatron.ops.mlflow_server import DEFAULT_HOST


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ui",
        help="MLflow UI on a run's tracking store (127.0.0.1:5000 by default)",
        description="Start the MLflow UI/server on a training run's store: "
        "sqlite:///<run-dir>/mlflow.db with artifacts in <run-dir>/mlartifacts. "
        "Bound to 127.0.0.1 by default; use an SSH tunnel to reach it from elsewhere.",
    )
    p.add_argument("--run-dir", help="training run directory (run.dir), e.g. runs/demo")
    p.add_argument("--backend-store-uri", help="MLflow store URI instead of the run's sqlite")
    p.add_argument("--artifacts-dir", help="artifact directory (default <run-dir>/mlartifacts)")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"bind address (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=5000, help="port (default 5000)")
    p.set_defaults(handler=_ui, extra="ui")


def _ui(args: argparse.Namespace) -> int:
    from mimir_megatron.ops.ui import serve

    serve(args.run_dir, args.backend_store_uri, args.artifacts_dir, args.host, args.port)
    return 0  # not reached: serve() replaces the process
