"""`mimir` command line: one entry point, subcommands registered by the modules that own them.

Each owning module exposes ``register(subparsers)``; heavy imports happen inside the handlers so
that ``mimir --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# (module, attribute): each adds its own subcommands.
_REGISTRARS = (
    "mimir_megatron.commands",
    "mimir_data_prep.cli",
    "mimir_megatron.train.cli",
    "mimir_megatron.bench",
    "mimir_megatron.ops.cli",
    "mimir_megatron.inference.cli",
    "mimir_megatron.inference.serve_cli",
    "mimir_megatron.audits.cli",
    "mimir_megatron.evaluation.cli",
)
# Commands that run megatron-core in this process: the CPU backend is set up (explicitly, once)
# before their handler imports the model. The others (data, ui, eval's client side, ...) never
# import megatron-core; a command missing here is still covered by parallel.init_distributed.
_MEGATRON_COMMANDS = frozenset({"info", "export", "import", "train", "bench", "generate", "serve",
                                "audit", "lm-eval"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mimir", description="Train, prepare data for, and convert HRM-Text models."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in _REGISTRARS:
        importlib.import_module(module_name).register(sub)
    return parser


def _command(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # First, before anything imports torch: a pre-emption signal during start-up must not kill
    # a training rank (the loop honours it), and two known start-up warnings are dropped.
    from mimir_megatron import stop_signals
    from mimir_megatron.logging_setup import quiet_known_noise, setup_logging

    previous = stop_signals.catch_early() if _command(argv) == "train" else {}
    quiet_known_noise()
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(verbose=args.verbose)
    try:
        if args.command in _MEGATRON_COMMANDS:
            from mimir_megatron import backend

            backend.setup()
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one clear line for user errors; traceback with -v
        from mimir_megatron.errors import UserError

        if isinstance(exc, UserError) and not args.verbose:
            logging.getLogger("mimir").error("%s", exc)
            return 2
        raise
    finally:
        stop_signals.restore(previous)


if __name__ == "__main__":
    sys.exit(main())
