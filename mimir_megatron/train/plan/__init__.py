"""`mimir plan`: what a run costs before it is launched.

Modules (the GPU table is :mod:`mimir_megatron.gpus`): :mod:`.memory` (bytes per GPU,
term by term), :mod:`.timing` (step time, communication), :mod:`.layouts` (window phases,
candidate layouts, the plan), :mod:`.table` (table and JSON), :mod:`.startup` (the trainer's plan
of its own run); the command is :mod:`mimir_megatron.entrypoints.plan`. Importing this package
imports neither torch nor megatron-core.
"""
