"""One `mimir bench` run as a function: which variants run, in which order, on which batch.

Our model can be measured in several variants in one run, each a set of model overrides: the
speed levers (attention kernel, layer backend and FP8, torch.compile, recompute, chunked loss)
are all model settings. A variant that fails (out of memory, a missing library) is reported with
its error; the others still run. Several windows are measured on the same model of each variant,
so a run builds, exports and compiles once.

Order (:func:`run_order`): the variants as given, except that compiled ones go last (a compile
takes minutes, so under a time limit it is the one to lose), and the peer runs right after the
first variant, so a run cut short still has a ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mimir_megatron.bench.request import BenchRequest, Variant

if TYPE_CHECKING:
    from mimir_megatron.bench.report import Report

__all__ = ["PEER", "BenchRequest", "Variant", "is_compiled", "run_bench", "run_order"]

PEER = None
"""Stands for the transformers peer in a run order."""


def is_compiled(variant: Variant, shared: Sequence[str] = ()) -> bool:
    """Whether the variant's settings (shared ones first, its own override them) compile."""
    value = None
    for item in [*shared, *variant.overrides]:
        key, _, v = item.partition("=")
        if key.strip().removeprefix("model.") == "execution.compile":
            value = v.strip().lower()
    return value in ("true", "1", "yes", "on")


def run_order(variants: list[Variant], peer: bool, shared: Sequence[str] = ()) -> list[Variant | None]:
    """The measuring order: uncompiled variants as given, then compiled ones; the peer
    (:data:`PEER`) right after the first."""
    order: list[Variant | None] = sorted(variants, key=lambda v: is_compiled(v, shared))
    if peer:
        order.insert(min(1, len(order)), PEER)
    return order


def run_bench(request: BenchRequest) -> Report:
    """Measure every variant (and the peer) as ``request`` says; the report, printed and (with
    ``json_path``) written as each result arrives."""
    from mimir_megatron import backend
    from mimir_megatron.bench.measure import BenchSetup, SharedWeights, StepSettings, bench_batch
    from mimir_megatron.bench.ours import bench_ours
    from mimir_megatron.bench.peer import bench_peer
    from mimir_megatron.bench.report import Report
    from mimir_megatron.bench.shapes import model_config
    from mimir_megatron.train.flops import attended_keys_per_token

    configs = {v.name: model_config(request.shape, request.config, [*request.overrides, *v.overrides])
               for v in request.our_variants}
    device = backend.device()
    peak = request.peak_tflops
    if peak is None:  # the GPU table's row of this device (mimir_megatron/gpus.yaml); none: no MFU
        row = backend.gpu_row()
        peak = row.bf16_tflops if row is not None else None
    first = next(iter(configs.values()))
    batch = bench_batch(first.vocab_size, request.micro_batch, request.seq_len, request.samples_per_context)
    step = StepSettings(optimizer=request.optimizer, lr=request.lr, clip_grad=request.clip_grad,
                        ema_decay=request.ema_decay)
    setup = BenchSetup(windows=list(request.windows), tokens=request.micro_batch * request.seq_len,
                       seq_len=request.seq_len, batch=batch.to(device), device=device,
                       precision=request.precision, peak_tflops=peak, warmup=request.warmup,
                       steps=request.steps,
                       attended_keys=attended_keys_per_token(batch.segment_ids, batch.prefix_mask).item(),
                       step=step)
    report = Report(request, device, setup.attended_keys)
    weights = SharedWeights()
    for item in run_order(list(request.our_variants), peer=request.peer, shared=request.overrides):
        if item is PEER:
            results = bench_peer(first, setup, weights, request.peer_checkpointing)
        else:
            results = bench_ours(item.name, configs[item.name], setup, weights)
        for result in results:
            report.add(result)
    report.finish()
    return report
