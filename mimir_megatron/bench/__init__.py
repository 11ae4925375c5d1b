"""`mimir bench`: the trainer's own step next to the transformers `hrm_text` peer.

Modules (the command itself is :mod:`mimir_megatron.entrypoints.bench`): :mod:`.shapes` (the named model
shapes, shipped as code so an installed wheel needs no checkout), :mod:`.measure` (batch,
timing, shared weights, results), :mod:`.ours` (our model through
:func:`mimir_megatron.train.step.train_step`), :mod:`.peer` (transformers), :mod:`.report`
(table, ratios, JSON) and :mod:`.run` (one run as a function: :func:`.run.run_bench`). Importing
this package imports neither torch nor transformers.
"""
