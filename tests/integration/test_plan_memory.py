"""`mimir plan`'s memory model against the memory a real training step allocates.

The tiny shape (configs/model/tiny.yaml), 2 contexts x 64 tokens, windows k = 2, 5 and 8, no
recompute and full recompute, on 1 rank, TP=2 and DP=2 (ZeRO-1) over gloo, and with bf16 weights
and the distributed optimizer (rows of fp32 main weights, moments and EMA) on 1 rank (no and
full recompute) and DP=2 (no recompute). The static terms are summed from the tensors the step
holds (weights, buffers, optimizer state, DDP buffer, EMA, main weights), not from the tracker's
kinds: it files Adam's temporaries under the optimizer's when the peak falls in its update. Each step runs the
trainer's own :func:`mimir_megatron.train.step.train_step` under torch's MemTracker
(``torch.distributed._tools.mem_tracker``), which records every tensor the step allocates, the
weights, DDP buffers, optimizer state and EMA registered with it: the measured peak is the
tracker's, not the plan's arithmetic (tests/workers/plan_memory_worker.py).

Tolerances, and why:
- weights, gradients, optimizer state and EMA (the static terms) are sizes of known tensors:
  equal to the byte (up to the optimizer's step counters, a few bytes);
- the peak: within 5 %;
- the dynamic part (peak minus static: activations plus working buffers) within 30 %. The
  activations are an exact count of what autograd keeps per layer, but which working buffers
  (the loss's, the head's gradient, one layer's backward, the recomputed layer) overlap at the
  peak is approximated by a fixed set; at the tiny shape with small windows that set is a
  large share (measured: peak -0.3 % to +3.8 %, dynamic part -4 % to +20 %, the +20 % at k=2;
  bf16 with the distributed optimizer +28 % at k=2 since the output gate keeps no fp32 sigmoid,
  model/gate.py: the activations shrank, the approximated buffers did not),
  at the Mimir shape a small one (docs/planning.md: the fake-tensor run of the full shape
  agrees within 4 %).

Run time: three processes (one rank, two ranks), each building a model per case and measuring
its three windows: ~40 s on two idle cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import TINY
from distributed import WORKERS, free_port, run_ranks
from polling import hang_limit

from mimir_megatron.config import load_config
from mimir_megatron.model.window import plan_window
from mimir_megatron.train.plan.memory import StepShape, plan_memory

MICRO, SEQ = 2, 64
WINDOWS = (2, 5, 8)
RECOMPUTE = ("none", "full")


def cases(tp: int, distributed: bool = False) -> list[str]:
    return [f"{tp}:{r}:{','.join(map(str, WINDOWS))}" + (":dist" if distributed else "") for r in RECOMPUTE]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    """Every case's measured peak: the 1-rank process runs next to the 2-rank launch (TP=2 and
    then DP=2 in the same two processes), to pay process start-up once per launch."""
    out = tmp_path_factory.mktemp("plan_memory")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    single = subprocess.Popen(
        [sys.executable, str(WORKERS / "plan_memory_worker.py"), str(out / "one.json"), "tiny", str(MICRO),
         str(SEQ), *cases(1), *cases(1, distributed=True)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        run_ranks("plan_memory_worker.py", 2, str(out / "two.json"), "tiny", str(MICRO), str(SEQ),
                  *cases(2), *cases(1), *cases(1, distributed=True)[:1])
    finally:
        log, _ = single.communicate(timeout=hang_limit(600))
    assert single.returncode == 0, log[-4000:]
    return json.loads((out / "one.json").read_text()) + json.loads((out / "two.json").read_text())


def test_planned_memory_matches_the_measured_step(measured):
    assert len(measured) == (4 * len(RECOMPUTE) + 1) * len(WINDOWS)
    rows = []
    for case in measured:
        tp, dp, k, recompute, dist = case["tp"], case["dp"], case["k"], case["recompute"], case["distributed"]
        cfg = load_config(TINY, [f"parallel.tensor_parallel_size={tp}"])
        window = plan_window(cfg.h_cycles, cfg.l_cycles, k, cfg.window_policy)
        plan = plan_memory(cfg, StepShape(
            micro_batch=MICRO, seq_len=SEQ, tp=tp, dp=dp, k_L=window.k_L, k_H=window.k_H,
            recompute=recompute, compute_bytes=2 if dist else 4, on_gpu=False, shard_optimizer=True,
            ema=True, loss_chunk_tokens=0, sequence_parallel=True, attention="dense",
            params_bytes=2 if dist else 4, distributed_optimizer=dist))
        static, peak = case["static_bytes"], case["peak_bytes"]
        name = f"TP={tp} DP={dp} k={k} recompute={recompute}" + (" distributed bf16" if dist else "")
        rows.append(f"{name}: plan {plan.peak / 1e6:.2f} MB, measured {peak / 1e6:.2f} MB")
        assert plan.static == pytest.approx(static, abs=512), name
        assert plan.peak == pytest.approx(peak, rel=0.05), name
        if dist and case["by_kind"]["OPT"] > plan.optimizer + 1024:
            # The measured peak is in the update (the tracker files Adam's temporaries under the
            # optimizer's kind): over the row shards they measure above the two fp32 copies of
            # the largest tensor planned (4.2 MB against 3.1 at k=2 with full recompute, 1 % of
            # the peak, which is checked above): not modelled exactly, so not compared.
            continue
        assert plan.peak - plan.static == pytest.approx(peak - static, rel=0.30), name
    print("\n".join(rows))
