"""Worker: one rank of a real train step under torch's MemTracker; rank 0 writes the measured
peak (bytes, per category) as JSON.

Usage: plan_memory_worker.py OUT.json TP K RECOMPUTE MICRO SEQ [model overrides...]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import TINY  # noqa: E402

from mimir_megatron import backend  # noqa: E402

backend.setup()  # a worker is an entry point


def main() -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.distributed._tools.mem_tracker import MemTracker

    from mimir_megatron import parallel
    from mimir_megatron.bench.measure import bench_batch
    from mimir_megatron.config import load_config
    from mimir_megatron.model import build_model
    from mimir_megatron.train.config import OptimSection
    from mimir_megatron.train.schedules import StepPlan
    from mimir_megatron.model.window import plan_window
    from mimir_megatron.train.step import build_trainer, train_step

    out, tp, k, recompute, micro, seq, *overrides = sys.argv[1:]
    tp, k, micro, seq = int(tp), int(k), int(micro), int(seq)
    parallel.init_distributed()
    parallel.init_model_parallel(tp)
    cfg = load_config(TINY, [f"parallel.tensor_parallel_size={tp}", f"execution.recompute={recompute}",
                             *overrides])
    dp_size = parallel_state.get_data_parallel_world_size()
    trainer = build_trainer(build_model(cfg), OptimSection(), device=torch.device("cpu"),
                            dp_group=parallel_state.get_data_parallel_group(), dp_size=dp_size)
    window = plan_window(cfg.h_cycles, cfg.l_cycles, k, cfg.window_policy)
    plan = StepPlan(step=0, window=window, lr=1e-4, group_lr=dict.fromkeys(("embedding", "head", "L", "H"), 1e-4),
                    frozen=())
    batch = bench_batch(cfg.vocab_size, micro, seq)
    tracker = MemTracker()
    # megatron's DDP wrapper has a list attribute named ``buffers``, which the tracker calls.
    track_module = tracker._track_module_params_and_buffers
    tracker._track_module_params_and_buffers = lambda module, *a, **kw: (
        (0, 0) if not callable(module.buffers) else track_module(module, *a, **kw))
    external = [b.grad_data for b in trainer.ddp.buffers]
    if trainer.ema is not None:
        external += list(trainer.ema.shadow.values())
    tracker.track_external(trainer.model, trainer.optimizer, *external)
    # The first step creates nothing lasting (optimizer state exists from the build): measure the second.
    train_step(trainer, [batch], plan, step=0)
    with tracker:
        train_step(trainer, [batch], plan, step=1)
    peak = tracker.get_tracker_snapshot("peak")
    device = next(d for d in peak if d.type == "cpu")
    result = {"peak_bytes": peak[device]["Total"],
              "by_kind": {str(kind): int(v) for kind, v in peak[device].items() if kind != "Total"}}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
