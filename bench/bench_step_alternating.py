"""Usage: python bench/bench_step_alternating.py SHAPE SEQ_LEN MICRO_BATCH ROUNDS (e.g. tiny 256 4 4).

Ours (the trainer's train_step) and the transformers peer, steps alternating, in one process:
on a shared machine the load changes between two sequential runs, alternation exposes both to it."""

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
cfg = model_config(shape, None)
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
for k in (5, 8):
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

    t = {"ours": [], "peer": []}
    for i in range(rounds + 1):
        for name, f in (
            (("ours", ours), ("peer", theirs)) if i % 2 == 0 else (("peer", theirs), ("ours", ours))
        ):
            s = time.perf_counter()
            f()
            e = time.perf_counter() - s
            if i:
                t[name].append(e)
    mo, mp = statistics.median(t["ours"]), statistics.median(t["peer"])
    tok = mb * seq
    print(
        f"{shape} k={k} {mb}x{seq}: ours {tok / mo:,.0f} tok/s (median {mo:.3f} s, "
        f"{min(t['ours']):.3f}-{max(t['ours']):.3f}); peer {tok / mp:,.0f} tok/s (median {mp:.3f} s, "
        f"{min(t['peer']):.3f}-{max(t['peer']):.3f}); ratio {mp / mo:.2f}; "
        f"ratio of fastest steps {min(t['peer']) / min(t['ours']):.2f}",
        flush=True,
    )
