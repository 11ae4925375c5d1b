"""``python -m mimir_data_prep.synth_pipeline [-v] PIPELINE.yaml [KEY=VALUE ...] [options]``:
`mimir synth run` under its older name.

The same parser (`mimir synth run`'s, with ``-v`` added since there is no ``mimir`` before it),
the same set-up and the same error rule (:func:`mimir_megatron.cli.run_command`); only the
parsing is intermixed, so that ``KEY=VALUE`` overrides may also follow the options.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from mimir_megatron.cli import run_command, subcommand_parser
    from mimir_megatron.process import setup_process

    setup_process(configure_logging=False)  # as `mimir` does before it parses
    parser = subcommand_parser("synth", "run")
    parser.prog = "python -m mimir_data_prep.synth_pipeline"
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_intermixed_args(argv, argparse.Namespace(command="synth", synth_command="run"))
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
