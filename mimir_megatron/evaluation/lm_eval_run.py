"""`mimir lm-eval`: lm-eval's own `run` command with this project's model ``mimir``."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from mimir_megatron.errors import UserError
from mimir_megatron.inference.api_keys import ENV_VAR, Endpoint

log = logging.getLogger("mimir")

# set by `mimir lm-eval` itself; everything else after `--` reaches lm-eval unchanged
_OWN = {"--model": "the model is always `mimir`", "--tasks": "use mimir lm-eval --tasks",
        "--batch_size": "use mimir lm-eval --batch-size"}


def lm_eval_argv(base_url: str, tokenizer: str, tasks: str, passthrough: list[str], *,
                 output_path: Path | None = None, batch_size: int = 16, h_cycles: int | None = None,
                 l_cycles: int | None = None) -> list[str]:
    """The arguments of lm-eval's `run` (model args merged with any given after `--`)."""
    rest = list(passthrough)
    for arg in rest:
        name = arg.split("=", 1)[0]
        if name in _OWN:
            raise UserError(f"{name} after `--`: {_OWN[name]}")
    model_args = [f"base_url={base_url}", f"tokenizer={tokenizer}"]
    model_args += [f"{k}={v}" for k, v in (("h_cycles", h_cycles), ("l_cycles", l_cycles)) if v is not None]
    for flag in ("--model_args", "--model-args"):
        while flag in rest:  # the user's model args come after ours, so they win
            i = rest.index(flag)
            if i + 1 == len(rest) or rest[i + 1].lstrip().startswith("{"):
                raise UserError(f"{flag} after `--` takes key=value pairs, e.g. max_length=4096")
            model_args.append(rest[i + 1])
            del rest[i:i + 2]
    argv = ["run", "--model", "mimir", "--model_args", ",".join(model_args), "--tasks", tasks,
            "--batch_size", str(batch_size)]
    if output_path is not None and "--output_path" not in rest and "-o" not in rest:
        argv += ["--output_path", str(output_path)]
    return argv + rest


def require_lm_eval() -> None:
    """One clear line when the extra is missing (checked before a server is started)."""
    try:
        import lm_eval._cli  # noqa: F401
    except ImportError:
        raise UserError("mimir lm-eval needs lm-evaluation-harness: pip install 'mimir-megatron[lmeval]'") \
            from None


def run_lm_eval(endpoint: Endpoint | str, tokenizer: str, tasks: str, passthrough: list[str],
                **kwargs) -> int:
    """Registers the ``mimir`` model and runs lm-eval's CLI; lm-eval prints its results table.

    The endpoint's key reaches the model through ``MIMIR_API_KEY`` for the run, not through its
    ``model_args``, which lm-eval writes into its results and logs."""
    require_lm_eval()
    from lm_eval._cli import HarnessCLI

    from . import lm_eval_model  # noqa: F401  (registers --model mimir)

    endpoint = Endpoint.of(endpoint)
    argv = lm_eval_argv(endpoint.base_url, tokenizer, tasks, passthrough, **kwargs)
    log.info("lm-eval %s", " ".join(argv))
    saved, saved_key = sys.argv, os.environ.get(ENV_VAR)
    sys.argv = ["lm-eval", *argv]  # HarnessCLI reads sys.argv
    if endpoint.api_key:
        os.environ[ENV_VAR] = endpoint.api_key
    try:
        cli = HarnessCLI()
        cli.execute(cli.parse_args())
    finally:
        sys.argv = saved
        if saved_key is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = saved_key
    return 0
