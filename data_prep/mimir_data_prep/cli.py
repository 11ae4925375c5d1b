"""The data-preparation commands' registrar: ``mimir.commands: data_prep`` (pyproject.toml).

``mimir`` (:mod:`mimir_megatron.cli`) imports no module of this package; it loads ``register``
through the entry point, as it loads its own command modules, and runs what it adds under the
same set-up and error rule. The commands live in :mod:`mimir_data_prep.entrypoints`.
"""

from __future__ import annotations

import argparse
import importlib

# The command modules (mimir_data_prep/entrypoints/), each adding its subcommands.
_REGISTRARS = ("mimir_data_prep.entrypoints.prepare", "mimir_data_prep.entrypoints.data",
               "mimir_data_prep.entrypoints.synth")


def register(sub: argparse._SubParsersAction) -> None:
    for module_name in _REGISTRARS:
        importlib.import_module(module_name).register(sub)
