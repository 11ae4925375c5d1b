"""``mimir serve``: the OpenAI-compatible server over a checkpoint, project weights or an HF directory."""

from __future__ import annotations

import argparse

from mimir_megatron.checkpoint import add_model_arguments
from mimir_megatron.inference.api_keys import ENV_VAR, add_api_key_arguments


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (127.0.0.1:8000 by default)",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/responses, "
                    "/v1/score, "
                    "/v1/models, /v1/stats, /health. Extra body fields h_cycles / l_cycles choose the "
                    "recurrence schedule per request.")
    add_model_arguments(p)
    p.add_argument("--tokenizer", help="tokenizer directory (default: the one found with the model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; anything else exposes the model on the network "
                        "and needs an API key, or --allow-unauthenticated)")
    add_api_key_arguments(p, "file of API keys, one a line: every /v1 request then needs "
                             f"'Authorization: Bearer <key>' (also {ENV_VAR}, one key; never on the "
                             "command line)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve without an API key: anyone who reaches the port may use the model (on "
                        "127.0.0.1, every user of this machine). Without it and without a key, a loopback "
                        "server uses the key of ~/.config/mimir/api-key (made on first use, mode 600), and "
                        "any other --host is refused")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--max-batch-size", type=int, default=32, help="rows decoded together in one step")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait for a batch; beyond this the server answers 503")
    p.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask (default: min(4096, the context))")
    p.add_argument("--max-context", type=int, default=None,
                   help="prompt + generated tokens per request (default: the model's position limit)")
    p.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw",
                   help="returned log-probs: raw (the model's, temperature 1; default) or processed (of the "
                        "distribution the token was drawn from: after penalties, logit_bias, the "
                        "structured-output "
                        "mask and the sampling filters, vLLM's processed_logprobs)")
    p.add_argument("--max-stored-responses", type=int, default=1024,
                   help="responses kept in memory for /v1/responses previous_response_id (oldest dropped)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body; larger ones are answered 413 before they are read (default: "
                        "64 bytes per context token, at least 1 MiB)")
    p.add_argument("--compile-decode", action="store_true",
                   help="run decoding-only steps through torch.compile: CUDA graphs on a GPU; on CPU "
                        "Inductor with dynamic shapes, one compile per schedule (1-5 min on 2 cores), "
                        "measured 0.45-0.9x eager's speed there (docs/performance.md); measure it with "
                        "bench/bench_serve.py before turning it on")
    p.add_argument("--max-cycles-factor", type=int, default=4,
                   help="a request's h_cycles / l_cycles may be at most this many times the trained ones "
                        "(default 4; the paper's schedule sweep needs 2)")
    p.set_defaults(handler=_serve, extra="serve", setup="megatron")


def _serve(args: argparse.Namespace) -> int:
    import logging

    from mimir_megatron.errors import UserError
    from mimir_megatron.inference.api_keys import own_keys, server_keys
    from mimir_megatron.inference.loading import load_engine
    from mimir_megatron.inference.server import serve

    for name in ("max_batch_size", "max_queue", "max_tokens_limit", "max_context", "max_stored_responses",
                 "max_body_bytes", "max_cycles_factor"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    keys = server_keys(args.api_key_file)
    log = logging.getLogger(__name__)
    if keys is not None and args.allow_unauthenticated:
        raise UserError(f"--allow-unauthenticated with an API key (--api-key-file or {ENV_VAR}): give one "
                        "or the other")
    if keys is None and not _loopback(args.host) and not args.allow_unauthenticated:
        raise UserError(f"--host {args.host} without an API key would serve the model to anyone who reaches "
                        f"the port: give --api-key-file PATH or {ENV_VAR}, or --allow-unauthenticated")
    if keys is not None:
        log.info("requests need an API key (%d accepted)", len(keys))
    elif args.allow_unauthenticated:
        log.warning("no API key (--allow-unauthenticated): %s may use the model on %s",
                    "every user of this machine" if _loopback(args.host) else "anyone who reaches the port",
                    args.host)
    engine = load_engine(model=args.model, checkpoint=args.checkpoint, ema=args.ema, weights=args.weights,
                         hf=args.hf, tokenizer=args.tokenizer, max_batch_size=args.max_batch_size,
                         max_context=args.max_context, compile_decode=args.compile_decode)
    engine.logprobs_mode = args.logprobs_mode
    if keys is None and not args.allow_unauthenticated:
        # On a shared node 127.0.0.1 is every user's: the user's own key, made once, after the
        # model loaded (a command that fails on its input leaves no file behind).
        keys, key_file, made = own_keys()
        log.info("requests need the API key in %s (%s): clients send it as 'Authorization: Bearer <key>', "
                 'e.g. export %s="$(cat %s)"; --api-key-file or %s choose another',
                 key_file, "made now, mode 600" if made else "yours", ENV_VAR, key_file, ENV_VAR)
    serve(engine, host=args.host, port=args.port, api_keys=keys, max_tokens_limit=args.max_tokens_limit,
          max_queue=args.max_queue, max_stored_responses=args.max_stored_responses,
          max_body_bytes=args.max_body_bytes, max_cycles_factor=args.max_cycles_factor)
    return 0


def _loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (reachable from this machine only)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface
