"""The commands of ``mimir``: one module per command group, together (vLLM's ``entrypoints/``).

Each module exposes ``register(subparsers)``, declares there what its commands need
(``set_defaults``: ``extra``, ``setup="megatron"``, ``early_stop_signals``) and keeps its heavy
imports inside the handlers, so that building the parser imports neither torch nor an extra.
:mod:`mimir_megatron.cli` collects them. Nothing below this package imports it.

- :mod:`.model_files`: ``info``, ``export``, ``import``
- :mod:`.train`: ``train``; :mod:`.plan`: ``plan``; :mod:`.bench`: ``bench``
- :mod:`.generate`: ``generate``; :mod:`.serve`: ``serve``
- :mod:`.evaluate`: ``eval``, ``sweep``, ``lm-eval``, ``eval-fixtures``
- :mod:`.audit`: ``audit index|prefix|continuation|contamination``
- :mod:`.ui`: ``ui``
"""
