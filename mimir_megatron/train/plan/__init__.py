"""`mimir plan`: what a run costs before it is launched.

Modules: :mod:`.gpus` (the shipped GPU table, ``gpus.yaml``), :mod:`.memory` (bytes per GPU,
term by term), :mod:`.timing` (step time, communication), :mod:`.layouts` (window phases,
candidate layouts, the plan), :mod:`.report` (table and JSON), :mod:`.cli`. Importing this
package imports neither torch nor megatron-core.
"""

from mimir_megatron.train.plan.cli import register

__all__ = ["register"]
