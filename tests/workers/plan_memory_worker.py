"""Worker: real train steps under torch's MemTracker; rank 0 writes each step's measured peak.

Usage: plan_memory_worker.py OUT.json SHAPE MICRO SEQ CASE [CASE ...]
  SHAPE: tiny (configs/model/tiny.yaml) or a `mimir bench` shape (mid);
  CASE: TP:RECOMPUTE:K[,K...][:dist|:fsdp], e.g. 2:full:2,5,8 (DP = world size / TP); ``dist``:
  bf16 weights with the distributed optimizer (fp32 main weights, moments and EMA by rows);
  ``fsdp``: bf16 compute with FSDP2 (optim.fully_shard: fp32 weights, gradients, moments and EMA
  by rows), two micro-batches a step (the gradient shards of the first are alive in the second).
Each case builds its model and trainer once (optimizer state is created eagerly) and measures
one step per window under a fresh tracker: the peak of live tensors (weights, DDP buffers,
optimizer state, EMA, activations, temporaries) that the tracker saw, on rank 0.
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import TINY  # noqa: E402

from mimir_megatron.process import setup_process  # noqa: E402

setup_process(megatron=True)  # a worker is an entry point


class PerMicroBatch:
    """The trainer's model, the tracker's per-module records reset before each micro-batch
    (MemTracker refuses a second forward of the root module; its peak is kept)."""

    def __init__(self, ddp, tracker):
        self.ddp, self.tracker = ddp, tracker

    def __call__(self, *args, **kwargs):
        self.tracker.reset_mod_stats()
        return self.ddp(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.ddp, name)


def storage_bytes(tensors) -> int:
    """Bytes of the storages under ``tensors``, each storage once."""
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


def measure(shape: str, tp: int, recompute: str, windows: list[int], micro: int, seq: int,
            distributed: bool = False, fsdp: bool = False) -> list[dict]:
    import torch
    from megatron.core import parallel_state
    from torch.distributed._tools.mem_tracker import MemTracker

    from mimir_megatron import parallel
    from mimir_megatron.bench.measure import bench_batch
    from mimir_megatron.bench.shapes import model_config
    from mimir_megatron.config import load_config
    from mimir_megatron.model import build_model, plan_window
    from mimir_megatron.train.config import OptimSection
    from mimir_megatron.train.schedules import GROUPS, StepPlan
    from mimir_megatron.train.step import build_trainer, train_step

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel.init_model_parallel(tp)
    overrides = [f"parallel.tensor_parallel_size={tp}", f"execution.recompute={recompute}"]
    overrides += ["params_dtype=bfloat16"] if distributed or fsdp else []
    cfg = load_config(TINY, overrides) if shape == "tiny" else model_config(shape, None, overrides)
    dp_size = parallel_state.get_data_parallel_world_size()
    trainer = build_trainer(build_model(cfg), OptimSection(distributed_optimizer=distributed, fully_shard=fsdp),
                            device=torch.device("cpu"),
                            dp_group=parallel_state.get_data_parallel_group(), dp_size=dp_size)
    batch = bench_batch(cfg.vocab_size, micro, seq)
    external = [] if fsdp else [b.grad_data for b in trainer.ddp.buffers]
    if trainer.ema is not None:
        external += list(trainer.ema.shadow.values())
    if distributed:  # the fp32 main weights (copies: the weights are bf16)
        external += [s.main for s in trainer.optimizer.all_shards()]
    # The static terms, summed from the tensors themselves (the tracker files Adam's temporaries
    # under the optimizer's kind too when the peak falls in its update).
    local = parallel.local_optimizer(trainer.optimizer)
    params = [getattr(p, "to_local", lambda p=p: p)() for p in trainer.model.parameters()]  # FSDP2: the rows
    held = [*params, *trainer.model.buffers(), *external,
            *(t for state in local.state.values() for t in state.values() if torch.is_tensor(t))]
    static = storage_bytes(held)
    results = []
    for k in windows:
        window = plan_window(cfg.h_cycles, cfg.l_cycles, k, cfg.window_policy)
        plan = StepPlan(step=0, window=window, lr=1e-4, group_lr=dict.fromkeys(GROUPS, 1e-4), frozen=())
        tracker = MemTracker()
        # megatron's DDP wrapper has a list attribute named ``buffers``, which the tracker would call.
        track_module = tracker._track_module_params_and_buffers
        tracker._track_module_params_and_buffers = lambda module, *a, _track=track_module, **kw: (
            (0, 0) if not callable(module.buffers) else _track(module, *a, **kw))
        # ZeRO-1's state lives in its local optimizer (the wrapper's ``state`` is empty).
        tracker.track_external(trainer.model, parallel.local_optimizer(trainer.optimizer), *external)
        with tracker:
            train_step(replace(trainer, ddp=PerMicroBatch(trainer.ddp, tracker)) if fsdp else trainer,
                       [batch, batch] if fsdp else [batch], plan, step=0)
        # FSDP2's gradient shards, made in the step (those of the window's weights), are static too.
        grads = storage_bytes([p.grad.to_local() for p in trainer.params if p.grad is not None]) if fsdp else 0
        peak = tracker.get_tracker_snapshot("peak")
        device = next(d for d in peak if d.type == "cpu")
        results.append({"tp": tp, "dp": dp_size, "k": k, "recompute": recompute, "distributed": distributed,
                        "fsdp": fsdp,
                        "peak_bytes": peak[device]["Total"], "static_bytes": static + grads,
                        "by_kind": {str(kind).rpartition(".")[2]: int(v) for kind, v in peak[device].items()
                                    if kind != "Total"}})
    return results


def main() -> None:
    import torch.distributed as dist

    from mimir_megatron import parallel

    out, shape, micro, seq, *cases = sys.argv[1:]
    parallel.init_distributed()
    results = []
    for case in cases:
        tp, recompute, windows, *mode = case.split(":")
        results += measure(shape, int(tp), recompute, [int(k) for k in windows.split(",")], int(micro), int(seq),
                           distributed=mode == ["dist"], fsdp=mode == ["fsdp"])
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
