"""The data-preparation commands of ``mimir``: one module per command group, like
:mod:`mimir_megatron.entrypoints`.

Each module exposes ``register(subparsers)`` and keeps its heavy imports inside the handlers;
:mod:`mimir_data_prep.cli` collects them for the ``mimir.commands`` entry point, and
:func:`mimir_megatron.cli.main` runs them with the same set-up and error rule as every other
command. A handler only turns its arguments into a call of a library function (the same
function tests and notebooks call).

- :mod:`.prepare`: ``prepare``
- :mod:`.data`: ``data report|demo|demo-tokenizer|declare|keygen|sign|pack``
- :mod:`.synth`: ``synth tools|run``
- :mod:`.provenance_flags`: the provenance flags ``prepare`` and ``data declare`` share
"""
