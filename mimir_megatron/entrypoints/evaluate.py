"""`mimir eval`, `mimir sweep` and `mimir eval-fixtures`."""

from __future__ import annotations

import argparse
import contextlib
import logging
from pathlib import Path

from mimir_megatron.checkpoint import ModelDir, add_model_arguments, model_dir_from_args
from mimir_megatron.inference.api_keys import ENV_VAR, add_api_key_arguments

log = logging.getLogger("mimir")


def _add_model_source(p: argparse.ArgumentParser) -> None:
    """Where the model comes from: a directory `mimir serve` is started for, or a running server."""
    src = add_model_arguments(p)
    src.add_argument("--base-url", help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    add_api_key_arguments(p, f"with --base-url: file whose first line is the server's API key (default: "
                             f"{ENV_VAR}); a server started here gets a fresh key of its own")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model's own)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for mimir serve")


def _add_source(p: argparse.ArgumentParser) -> None:
    _add_model_source(p)
    p.add_argument("--suite", required=True, help="suite YAML, e.g. configs/eval/mimir_en.yaml")
    p.add_argument("--data-dir", help="directory the tasks' files are under (default: the suite's data_dir)")
    p.add_argument("--limit", type=int, help="first N rows of each task after the seeded shuffle")
    p.add_argument("--tasks", help="comma-separated subset of the suite's tasks")
    p.add_argument("--output", help="directory for tables and logs (default: evals/<suite>/<model>)")
    p.add_argument("--mc-scoring", choices=("generate", "loglik"),
                   help="multiple choice by greedy letter (generate) or letter log-prob via /v1/score")
    p.add_argument("--allow-code-execution", action="store_true",
                   help="run HumanEval's generated code (limited subprocess, no network); off by default")
    p.add_argument("--tracking-uri", help="MLflow store (default: the training run's, else OUTPUT/mlflow.db)")
    p.add_argument("--experiment", help="MLflow experiment (default: the training run's, else mimir-eval)")
    p.add_argument("--contamination", metavar="PATH",
                   help="`mimir audit contamination` report (its <suite>.json, or the directory holding it): "
                        "tables mark benchmarks with contaminated items (default with --checkpoint: "
                        "RUN/contamination/<suite>.json of its training run, if present)")


def _add_schedule(p: argparse.ArgumentParser) -> None:
    p.add_argument("--h-cycles", type=int, help="evaluate under this H (default: trained schedule)")
    p.add_argument("--l-cycles", type=int, help="evaluate under this L (default: trained schedule)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a model on a benchmark suite (InspectAI, tables, MLflow)",
                       description="Starts `mimir serve` on a free 127.0.0.1 port for a checkpoint or "
                       "model directory (or uses --base-url), runs the suite with InspectAI (greedy, "
                       "seed from the suite), stops the server, writes results.md/.csv/.json, the "
                       "per-item outcomes and InspectAI's logs, and logs everything to MLflow.")
    _add_source(p)
    _add_schedule(p)
    p.add_argument("--model-name",
                   help="with --base-url: the model id to request (default: the first listed)")
    p.set_defaults(handler=cmd_eval, extra="eval")

    p = sub.add_parser("sweep", help="evaluate one checkpoint under several (H, L) schedules (Table 5)")
    _add_source(p)
    p.add_argument("--schedules", default="1x3,2x1,2x2,2x3,2x4,2x5,3x3", help="comma-separated HxL")
    p.add_argument("--trained-schedule", help="HxL the weights were trained with (default: read from them)")
    p.add_argument("--model-name", help="with --base-url: the model id to request")
    p.set_defaults(handler=cmd_sweep, extra="eval")

    p = sub.add_parser(
        "lm-eval", help="run lm-evaluation-harness tasks (log-likelihood through /v1/score)",
        usage="mimir lm-eval (--base-url URL --tokenizer DIR | --model DIR | --checkpoint DIR | --hf DIR | "
              "--weights DIR) "
              "--tasks TASKS [options] [-- LM-EVAL OPTIONS]",
        description="Runs lm-evaluation-harness (the `lmeval` extra) with this project's model `mimir`: "
        "log-likelihood goes through the server's /v1/score with lm-eval's own context/continuation "
        "split (context bidirectional, continuation causal: the training mask), generation through "
        "/v1/completions. Starts `mimir serve` for a checkpoint or model directory as `mimir eval` "
        "does, or uses --base-url. Everything after `--` goes to lm-eval's `run` unchanged "
        "(--num_fewshot, --limit, --include_path, --log_samples, --apply_chat_template, ...).")
    _add_model_source(p)
    p.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated (lm-eval's --tasks)")
    _add_schedule(p)
    p.add_argument("--batch-size", type=int, default=16, help="pairs per /v1/score request, prompts per "
                   "/v1/completions request (default 16)")
    p.add_argument("--output", help="directory for lm-eval's results (--output_path) and serve.log "
                   "(default: evals/lm-eval/<model>)")
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER,
                   help="after `--`: lm-eval `run` options, passed through")
    p.set_defaults(handler=cmd_lm_eval, extra="lmeval", setup="megatron")

    p = sub.add_parser("eval-fixtures", help="write small made-up files in every benchmark's layout")
    p.add_argument("--output", required=True, help="directory (use it as --data-dir)")
    p.add_argument("--rows", type=int, default=8, help="rows per split")
    p.set_defaults(handler=cmd_fixtures)


def _model(args: argparse.Namespace) -> ModelDir | None:
    """The model the flags name, resolved once for the whole command (every fact of it is asked
    of this value); None with ``--base-url``."""
    if args.base_url:
        return None
    if args.api_key_file:
        from mimir_megatron.errors import UserError

        raise UserError("--api-key-file is the key of a running server (--base-url); the server started here "
                        "gets a fresh key of its own")
    model = model_dir_from_args(args)
    model.check_ema(args.ema)
    return model


def _suite(args: argparse.Namespace):
    from mimir_megatron.evaluation.suite import load_suite

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    suite = load_suite(args.suite)
    if args.tasks:
        suite = suite.select([t.strip() for t in args.tasks.split(",") if t.strip()])
    return suite


def _source_name(args: argparse.Namespace, model: ModelDir | None) -> str:
    if model is None:
        return getattr(args, "model_name", None) or "server"
    return model.display_name(ema=args.ema)


def _tokenizer_dir(args: argparse.Namespace, model: ModelDir | None) -> str | None:
    """The tokenizer the log-likelihood client renders chat contexts with: the one the server
    loads for the same model (``--tokenizer``, else the model's own)."""
    if model is None:
        return args.tokenizer
    found = model.tokenizer_or(args.tokenizer)
    return str(found) if found is not None else None


def _trained_schedule(args: argparse.Namespace, model: ModelDir | None) -> tuple[int, int] | None:
    """The schedule a sweep marks as trained: ``--trained-schedule``, else what the model's
    directory records (any form: checkpoint, weights, transformers)."""
    from mimir_megatron.evaluation.sweep import parse_schedules

    if args.trained_schedule:
        return tuple(parse_schedules(args.trained_schedule)[0])
    return model.trained_schedule if model is not None else None


@contextlib.contextmanager
def _server(args: argparse.Namespace, model: ModelDir | None, output: Path):
    """The endpoint of ``--base-url`` (with the key of ``--api-key-file`` or the environment), or of
    a `mimir serve` started here for the model."""
    if model is None:
        from mimir_megatron.inference.api_keys import Endpoint, client_key

        yield Endpoint(args.base_url, client_key(args.api_key_file))
        return
    from mimir_megatron.evaluation.serve import launched_server

    with launched_server(**{str(model.kind): str(model.path)}, ema=args.ema, tokenizer=args.tokenizer,
                         log_file=output / "serve.log", startup_timeout_s=args.startup_timeout) as url:
        yield url


def _score_client(args: argparse.Namespace, model: ModelDir | None, endpoint, model_name: str):  # noqa: ANN001
    from mimir_megatron.evaluation.scoring_client import ScoreClient, load_renderer

    render, encode = load_renderer(_tokenizer_dir(args, model))
    return ScoreClient(endpoint, model_name, render, encode)


def _marks(args: argparse.Namespace, suite, model: ModelDir | None):
    """Contamination marks per task (None without a report), read before anything runs."""
    from mimir_megatron.evaluation.contamination import benchmark_marks, find_report

    report = find_report(args.contamination, suite.name, model.run_directory if model else None)
    return benchmark_marks(report, suite, args.data_dir), (str(report.path) if report else None)


def _params(args: argparse.Namespace, suite, model: ModelDir | None) -> dict:
    return {"suite": suite.name, "suite_file": suite.source, "model": "",
            "source": str(model.path) if model else args.base_url,
            "ema": args.ema, "limit": args.limit, "seed": suite.seed,
            "mc_scoring": args.mc_scoring or suite.mc_scoring, "data_dir": args.data_dir or suite.data_dir}


def cmd_eval(args: argparse.Namespace) -> int:
    from mimir_megatron.evaluation.tables import markdown
    from mimir_megatron.evaluation.tracking import tracking_target
    from mimir_megatron.evaluation.workflow import run_eval

    model = _model(args)
    suite = _suite(args)
    marks, report = _marks(args, suite, model)
    schedule = "" if args.h_cycles is None and args.l_cycles is None else f"-h{args.h_cycles}l{args.l_cycles}"
    output = Path(args.output or Path("evals") / suite.name / (_source_name(args, model) + schedule))
    target = tracking_target(output, args.tracking_uri, model.record if model else None, args.experiment)
    done = run_eval(suite, output, _server(args, model, output), target,
                    model_name=args.model_name if args.base_url and args.model_name else None,
                    score_client=lambda endpoint, name: _score_client(args, model, endpoint, name),
                    h_cycles=args.h_cycles, l_cycles=args.l_cycles, marks=marks,
                    params={**_params(args, suite, model), "contamination_report": report},
                    data_dir=args.data_dir, limit=args.limit, allow_code_execution=args.allow_code_execution,
                    mc_scoring=args.mc_scoring)
    print(markdown(done.result, f"{suite.name} — {done.model_name}", marks))
    print(f"tables and logs: {output}   MLflow: {target.uri} (experiment {target.experiment}"
          + (f", run {done.run_id}" if done.run_id else "") + f")   {done.seconds:.0f} s")
    failed = [t for t in done.result.tasks if t.error and not t.skipped]
    return 1 if failed else 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from mimir_megatron.evaluation.sweep import markdown, parse_schedules, run_sweep
    from mimir_megatron.evaluation.tracking import tracking_target
    from mimir_megatron.evaluation.workflow import contamination_metrics

    model = _model(args)
    suite = _suite(args)
    marks, report = _marks(args, suite, model)
    schedules = parse_schedules(args.schedules)
    trained = _trained_schedule(args, model)
    output = Path(args.output or Path("evals") / f"sweep-{suite.name}" / _source_name(args, model))
    target = tracking_target(output, args.tracking_uri, model.record if model else None, args.experiment)
    params = {**_params(args, suite, model), "schedules": args.schedules, "trained_schedule": trained,
              "contamination_report": report}
    done = run_sweep(suite, schedules, output, _server(args, model, output), target,
                     model_name=args.model_name if args.base_url and args.model_name else None,
                     score_client=lambda endpoint, name: _score_client(args, model, endpoint, name),
                     trained=trained, marks=marks, params=params, data_dir=args.data_dir, limit=args.limit,
                     allow_code_execution=args.allow_code_execution, mc_scoring=args.mc_scoring,
                     metrics=contamination_metrics(marks))
    print(markdown(done.sweep))
    print(f"sweep tables, heatmap and logs: {output}   MLflow: {target.uri}   {done.seconds:.0f} s")
    return 0


def cmd_lm_eval(args: argparse.Namespace) -> int:
    from mimir_megatron.evaluation.lm_eval_run import require_lm_eval, run_lm_eval

    require_lm_eval()
    model = _model(args)
    tokenizer = _tokenizer_dir(args, model)
    if tokenizer is None:
        from mimir_megatron.errors import UserError

        raise UserError("mimir lm-eval needs the model's tokenizer: pass --tokenizer DIR")
    output = Path(args.output or Path("evals") / "lm-eval" / _source_name(args, model))
    passthrough = args.lm_eval_args[1:] if args.lm_eval_args[:1] == ["--"] else args.lm_eval_args
    with _server(args, model, output) as endpoint:
        return run_lm_eval(endpoint, tokenizer, args.tasks, passthrough, output_path=output,
                           batch_size=args.batch_size, h_cycles=args.h_cycles, l_cycles=args.l_cycles)


def cmd_fixtures(args: argparse.Namespace) -> int:
    from mimir_megatron.evaluation.fixtures import write_fixtures

    print(write_fixtures(args.output, rows_per_split=args.rows))
    return 0
