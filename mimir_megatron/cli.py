"""`mimir` command line: one entry point; the commands live in :mod:`mimir_megatron.entrypoints`.

Each command module exposes ``register(subparsers)``; heavy imports happen inside the handlers so
that building the parser imports neither torch nor any optional extra (the packages they reach
export lazily, see :mod:`mimir_megatron.lazy`): ``mimir --help`` and ``mimir CMD --help`` answer
on a bare install. A command that needs an extra says so with
``set_defaults(extra="eval")``; run without it, it stops with one line naming the extra.
Packages built on this one (data preparation: ``prepare``, ``data``, ``synth``) add their
commands through the entry-point group ``mimir.commands`` (pyproject.toml), so this package
imports none of them.

Every command, wherever registered, runs through :func:`run_command`: one process set-up
(:func:`~mimir_megatron.process.setup_process`), one error rule (a ``UserError`` is one line and
exit code 2; ``-v`` shows the traceback) and one ``--help`` shape (a description, every argument
with a help line; tests/unit/test_commands.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path

# The command modules (mimir_megatron/entrypoints/), each adding its subcommands.
_REGISTRARS = tuple(f"mimir_megatron.entrypoints.{name}" for name in (
    "model_files", "train", "plan", "bench", "ui", "generate", "serve", "audit", "evaluate"))
# What a command needs is declared where it is registered, with ``set_defaults``: ``extra`` (the
# optional dependencies it needs), ``setup="megatron"`` (it runs megatron-core in this process:
# its input paths are checked, then the CPU backend is set up, explicitly and once, before its
# handler imports the model; `train` sets it up itself once its config is read, so that a config
# mistake is reported before torch loads), ``early_stop_signals`` (a pre-emption signal during
# start-up must not kill a training rank: the loop honours it).

# The input paths of those commands, by argument name, checked before the backend loads torch and
# megatron-core (~5 s): a mistyped path is one line at once, not after the imports.
_INPUT_PATHS = {"config": "config file", "checkpoint": "checkpoint", "weights": "model directory",
                "hf": "model directory", "model": "model", "input": "input file"}

# Entry points ``NAME = "module:register"`` of installed packages that add subcommands.
COMMAND_GROUP = "mimir.commands"


class _VersionAction(argparse.Action):
    """``--version``: the version and the commit (asked of git or of the build only when given)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and the git commit it was built from, and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        from mimir_megatron.version import describe

        print(describe())  # stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mimir", description="Train, prepare data for, and convert HRM-Text models."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in _REGISTRARS:
        importlib.import_module(module_name).register(sub)
    for entry_point in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        entry_point.load()(sub)
    _describe_every_command(parser)
    return parser


def command_groups(parser: argparse.ArgumentParser) -> list[argparse._SubParsersAction]:
    """The subcommand groups of ``parser`` (one at most: ``COMMAND``, ``ACTION``, ``AUDIT``)."""
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def _describe_every_command(parser: argparse.ArgumentParser) -> None:
    """Every ``mimir ... --help`` opens with what the command does: a command registered with
    only its one-line ``help`` takes it, as a sentence, for its description."""
    for group in command_groups(parser):
        helps = {choice.dest: choice.help for choice in group._choices_actions}
        for name, command in group.choices.items():
            line = helps.get(name) or ""
            if not command.description and line:
                command.description = line[0].upper() + line[1:] + ("" if line.endswith(".") else ".")
            _describe_every_command(command)


def _extras() -> dict[str, list[str]]:
    """This package's extras, each with the distribution names it requires (``{}`` where the
    package metadata is absent, e.g. run from a source tree: then the import error speaks)."""
    try:
        requires = importlib.metadata.requires("mimir-megatron") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    extras: dict[str, list[str]] = {}
    for line in requires:
        spec, _, marker = line.partition(";")
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if extra:
            extras.setdefault(extra.group(1), []).append(spec.strip())
    return extras


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_requirements(extra: str) -> list[str]:
    """The distributions of ``extra`` (and of the extras it includes) that are not installed."""
    missing: set[str] = set()
    for spec in _extras().get(extra, []):
        name = re.match(r"[A-Za-z0-9._-]+", spec).group(0)
        included = re.search(r"\[([^\]]+)\]", spec)
        if _normal(name) == "mimir-megatron" and included:
            for sub in included.group(1).split(","):
                missing.update(missing_requirements(sub.strip()))
            continue
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.add(name)
    return sorted(missing)


def _extra_providing(module: str) -> str | None:
    """The first extra that requires a distribution named like import name ``module``."""
    for extra, specs in _extras().items():
        if any(_normal(re.match(r"[A-Za-z0-9._-]+", s).group(0)) == _normal(module) for s in specs):
            return extra
    return None


def _install_hint(extra: str) -> str:
    return f"pip install 'mimir-megatron[{extra}]'"


def check_input_paths(args: argparse.Namespace) -> None:
    """One :class:`UserError` line for the first input path of :data:`_INPUT_PATHS` that does not exist."""
    from mimir_megatron.errors import UserError

    for name, what in _INPUT_PATHS.items():
        value = getattr(args, name, None)
        if isinstance(value, str) and value and not Path(value).exists():
            raise UserError(f"{what} not found: {value}")


def subcommand_parser(*path: str) -> argparse.ArgumentParser:
    """The parser of ``mimir PATH...`` (e.g. ``"synth", "run"``), from a fresh :func:`build_parser`:
    for an entry point that offers one command under another name."""
    parser = build_parser()
    for name in path:
        (group,) = command_groups(parser)
        parser = group.choices[name]
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from mimir_megatron.process import setup_process

    # The import hook and the noise filters first (cheap, no torch), so that they hold even when
    # parsing exits (--help) in a process that goes on to import megatron-core.
    setup_process(configure_logging=False)
    return run_command(build_parser().parse_args(argv))  # imports no torch: the modules export lazily


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command: its process set-up, its extra's check, its handler, and the one error
    rule: a :class:`~mimir_megatron.errors.UserError` (or a missing optional package) is one line
    and exit code 2, unless ``-v`` asks for the traceback; Ctrl-C is 130."""
    from mimir_megatron import stop_signals
    from mimir_megatron.process import setup_process

    previous = stop_signals.catch_early() if getattr(args, "early_stop_signals", False) else {}
    setup_process(verbose=args.verbose)
    say = logging.getLogger("mimir").error
    extra = getattr(args, "extra", None)
    try:
        if extra and (missing := missing_requirements(extra)):
            say("mimir %s needs the optional '%s' dependencies (missing: %s): %s",
                args.command, extra, ", ".join(missing), _install_hint(extra))
            return 2
        if getattr(args, "setup", None) == "megatron":
            check_input_paths(args)
            setup_process(verbose=args.verbose, megatron=True)
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:  # an optional package the command reached for
        module = (exc.name or "").partition(".")[0]
        if args.verbose or not module or module.startswith("mimir_"):
            raise
        owner = extra or _extra_providing(module)
        hint = _install_hint(owner) if owner else f"pip install {module}"
        say("mimir %s needs the Python package %s, which is not installed: %s", args.command, module, hint)
        return 2
    except Exception as exc:  # one clear line for user errors; traceback with -v
        from mimir_megatron.errors import UserError

        if isinstance(exc, UserError) and not args.verbose:
            say("%s", exc)
            return 2
        raise
    finally:
        stop_signals.restore(previous)


if __name__ == "__main__":
    sys.exit(main())
