"""Usage: python bench/bench_step_alternating.py SHAPE SEQ_LEN MICRO_BATCH ROUNDS [WINDOWS [KEY=VALUE ...]]

e.g. `tiny 256 4 4 5,8` (WINDOWS defaults to 5,8); model overrides follow the windows, e.g. the
demo's model: `tiny 256 8 5 2,5 num_layers_L=1 num_layers_H=1`.

Ours (the trainer's train_step) and the transformers peer, steps alternating, in one process:
on a shared machine the load changes between two sequential runs, alternation exposes both to it.

Each step is timed twice: wall clock, and the process's CPU time (user + system, all threads).
On an oversubscribed machine the wall clock mostly measures the other jobs; the CPU time measures
the work each implementation does. Run with ``OMP_NUM_THREADS=1`` for CPU times free of the
thread pool's spin-waiting (with several threads, idle threads spinning at a barrier count too).
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from mimir_megatron.bench.measure import SharedWeights, bench_batch
from mimir_megatron.bench.peer import peer_l_bp_cycles
from mimir_megatron.bench.shapes import model_config
from mimir_megatron.interop import export_hf
from mimir_megatron.train.config import OptimSection, TrainConfig, WindowSection
from mimir_megatron.train.schedules import plan_step
from mimir_megatron.train.step import build_trainer, train_step

shape, seq, mb, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
windows = [int(k) for k in sys.argv[5].split(",")] if len(sys.argv) > 5 else [5, 8]
cfg = model_config(shape, None, sys.argv[6:])
dev = torch.device("cpu")
optim = OptimSection(lr=1e-4, warmup_steps=0, clip_grad=1.0, ema_decay=0.9999, shard_state=False)
weights = SharedWeights()
trainer = build_trainer(weights.model(cfg, dev), optim, device=dev)
with tempfile.TemporaryDirectory() as tmp:
    export_hf(weights.model(cfg, dev), Path(tmp) / "hf")
    peer = AutoModelForCausalLM.from_pretrained(
        Path(tmp) / "hf", dtype=torch.float32, attn_implementation="sdpa"
    ).train()
params = [p for p in peer.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
shadow = [p.detach().clone() for p in params]
batch = bench_batch(cfg.vocab_size, mb, seq)
valid = batch.segment_ids > 0
print(f"torch threads {torch.get_num_threads()}", flush=True)
for k in windows:
    plan = plan_step(0, TrainConfig(model=cfg, window=WindowSection(k=k), optim=optim))
    peer.model.L_bp_cycles_padded = peer_l_bp_cycles(cfg.h_cycles, cfg.l_cycles, k)

    def ours():
        train_step(trainer, [batch], plan, step=0)

    def theirs():
        out = peer(
            input_ids=batch.input_ids,
            attention_mask=valid.long(),
            token_type_ids=batch.prefix_mask.long(),
            labels=batch.labels,
            use_cache=False,
        )
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_lerp_(shadow, [p.detach() for p in params], 1e-4)

    wall = {"ours": [], "peer": []}
    cpu = {"ours": [], "peer": []}
    for i in range(rounds + 1):
        for name, f in (
            (("ours", ours), ("peer", theirs)) if i % 2 == 0 else (("peer", theirs), ("ours", ours))
        ):
            s, c = time.perf_counter(), time.process_time()
            f()
            if i:  # the first round is untimed (warm-up)
                wall[name].append(time.perf_counter() - s)
                cpu[name].append(time.process_time() - c)
    tok = mb * seq
    for clock, t in (("wall", wall), ("cpu", cpu)):
        mo, mp = statistics.median(t["ours"]), statistics.median(t["peer"])
        print(
            f"{shape} k={k} {mb}x{seq} {clock}: ours {tok / mo:,.0f} tok/s (median {mo:.3f} s, "
            f"{min(t['ours']):.3f}-{max(t['ours']):.3f}); peer {tok / mp:,.0f} tok/s (median {mp:.3f} s, "
            f"{min(t['peer']):.3f}-{max(t['peer']):.3f}); ratio {mp / mo:.2f}; "
            f"ratio of fastest steps {min(t['peer']) / min(t['ours']):.2f}",
            flush=True,
        )
