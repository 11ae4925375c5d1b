"""Usage: python bench/bench_plan_fake_memory.py SHAPE MICRO SEQ_LEN K RECOMPUTE [dist]

``dist``: bf16 weights with the distributed optimizer (the paper's recipes' configs): fp32 main
weights, moments and EMA by rows, bf16 compute (on CPU: the weights' dtype, no autocast).

The trainer's step at any shape (the full Mimir one included) on fake tensors, under torch's
MemTracker, next to `mimir plan`'s memory model: no weights are allocated, so the 1.78B shape at
4 x 4,096 tokens needs ~1 GB of host memory and ~40 s. Run as one process (it starts a 1-rank
gloo group itself). Prints the tracker's peak by kind and the plan's, in GB.

What fake tensors cannot run, and what is changed here for it (docs/planning.md):
- the weight initialisation (truncated normal reads values): skipped, values do not matter;
- ``build_model``'s ``.to(device)`` (parameters cannot be swapped): the model is built in place;
- the chunked loss kernel (it indexes by target values): the plain loss is used
  (``loss_chunk_tokens=0``), so the plan is compared with that setting too;
- collectives (no fake kernels; one rank, so identities): stubbed;
- the step's host read of its scalars and the optimizer update after it: the step stops there,
  so the measured peak is that of forward, backward and the gradient norm, not of Adam's update.
It runs on CPU semantics: fp32 compute (no autocast) and the dense attention backend.
"""

import dataclasses
import json
import os
import sys

os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29581")

from mimir_megatron.process import setup_process  # noqa: E402

setup_process(megatron=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402

from mimir_megatron import parallel  # noqa: E402
from mimir_megatron.bench.measure import bench_batch  # noqa: E402
from mimir_megatron.bench.shapes import model_config  # noqa: E402
from mimir_megatron.model import hrm, plan_window  # noqa: E402
from mimir_megatron.train.plan.memory import StepShape, plan_memory  # noqa: E402
from mimir_megatron.train import step as step_module  # noqa: E402
from mimir_megatron.train.config import OptimSection  # noqa: E402
from mimir_megatron.train.schedules import GROUPS, StepPlan  # noqa: E402


def main() -> None:
    shape, recompute = sys.argv[1], sys.argv[5]
    micro, seq, k = (int(v) for v in sys.argv[2:5])
    distributed = sys.argv[6:] == ["dist"]
    parallel.init_distributed()
    parallel.init_model_parallel(1)
    cfg = model_config(shape, None, [f"execution.recompute={recompute}", "execution.loss_chunk_tokens=0"]
                       + (["params_dtype=bfloat16"] if distributed else []))
    hrm.lecun_normal_ = lambda t, *a, **kw: t
    hrm.vocab_rows_init = lambda vocab: (lambda t, *a, **kw: t)
    hrm.z_l_init_ = lambda t, *a, **kw: t
    batch = bench_batch(cfg.vocab_size, micro, seq)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        trainer = step_module.build_trainer(hrm.HRMTextModel(cfg.validate()),
                                            OptimSection(distributed_optimizer=distributed),
                                            device=torch.device("cpu"), dp_size=1,
                                            dp_group=parallel_state.get_data_parallel_group())
        values = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
        fake = type(batch)(**{name: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                              for name, v in values.items()})
        window = plan_window(cfg.h_cycles, cfg.l_cycles, k, cfg.window_policy)
        plan = StepPlan(step=0, window=window, lr=1e-4, group_lr=dict.fromkeys(GROUPS, 1e-4), frozen=())
        dist.all_reduce = lambda *a, **kw: None
        trainer.ddp.finish_grad_sync = lambda: None
        tracker = MemTracker()
        track_module = tracker._track_module_params_and_buffers  # megatron DDP's ``buffers`` is a list
        tracker._track_module_params_and_buffers = lambda m, *a, **kw: (
            (0, 0) if not callable(m.buffers) else track_module(m, *a, **kw))
        external = [b.grad_data for b in trainer.ddp.buffers] + list(trainer.ema.shadow.values())
        if distributed:  # the fp32 main weights (copies of the bf16 weights)
            external += [s.main for s in trainer.optimizer.all_shards()]
        tracker.track_external(trainer.model, parallel.local_optimizer(trainer.optimizer), *external)
        with tracker:
            try:
                step_module.train_step(trainer, [fake], plan, step=0)
            except Exception as exc:  # the host read of the step's scalars (data-dependent)
                print(f"step stopped at the host read: {type(exc).__name__}", file=sys.stderr)
    peak = tracker.get_tracker_snapshot("peak")
    measured = {str(kind).rpartition(".")[2]: v / 1e9 for kind, v in next(iter(peak.values())).items()}
    width = 2 if distributed else 4
    planned = plan_memory(cfg, StepShape(micro, seq, 1, 1, window.k_L, window.k_H, recompute,
                                         compute_bytes=width, on_gpu=False, loss_chunk_tokens=0,
                                         attention="dense", params_bytes=width,
                                         distributed_optimizer=distributed))
    print(json.dumps({"measured_gb": {k: round(v, 2) for k, v in measured.items()},
                      "plan_gb": planned.terms_gb()}, indent=1))


if __name__ == "__main__":
    main()
