"""`mimir bench`: the trainer's own step next to the transformers `hrm_text` peer.

Modules: :mod:`.cli` (arguments, run order, the command), :mod:`.shapes` (the named model
shapes, shipped as code so an installed wheel needs no checkout), :mod:`.measure` (batch,
timing, shared weights, results), :mod:`.ours` (our model through
:func:`mimir_megatron.train.step.train_step`), :mod:`.peer` (transformers) and :mod:`.report`
(table, ratios, JSON). Importing this package imports neither torch nor transformers.
"""

from mimir_megatron.bench.cli import register

__all__ = ["register"]
