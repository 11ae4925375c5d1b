"""Usage: python bench/bench_rope.py SHAPE SEQ_LEN: one L stack forward + backward with megatron's RoPE
(angles) and with the per-forward table (RotaryLayout), alternating."""

import statistics
import sys
import time

import torch
from mimir_kernels import build_layout
from mimir_megatron.bench.shapes import model_config
from mimir_megatron.model import build_model
from mimir_megatron.model.attention import RotaryLayout
from mimir_megatron.model.rope import RotaryTable, rotary_angles


def main() -> None:
    shape = sys.argv[1]
    cfg = model_config(shape, None, sys.argv[3:])
    model = build_model(cfg)
    seq, batch = int(sys.argv[2]), 4
    seg = torch.ones(batch, seq, dtype=torch.long)
    prefix = torch.zeros(batch, seq, dtype=torch.bool)
    prefix[:, : seq // 2] = True
    pos = torch.arange(seq).expand(batch, seq)
    layout = build_layout(model.attention_backend, seg, prefix)
    x = torch.randn(seq, batch, cfg.hidden_size)

    def old():
        angles = rotary_angles(pos, cfg.head_dim, cfg.rope_theta)
        model.L(x, attention_mask=None, rotary_pos_emb=angles, packed_seq_params=layout).sum().backward()

    def new():
        t = RotaryTable(rotary_angles(pos, cfg.head_dim, cfg.rope_theta))
        model.L(
            x, attention_mask=None, rotary_pos_emb=None, packed_seq_params=RotaryLayout.of(layout, t)
        ).sum().backward()

    times = {"megatron rope": [], "table": []}
    for i in range(8):
        for name, f in (("megatron rope", old), ("table", new)):
            s = time.perf_counter()
            f()
            e = time.perf_counter() - s
            if i >= 2:
                times[name].append(e)
    for name, t in times.items():
        print(f"{shape} seq {seq}: {name}: median {statistics.median(t) * 1e3:.1f} ms over {len(t)}")
    print("ratio old/new", statistics.median(times["megatron rope"]) / statistics.median(times["table"]))


if __name__ == "__main__":
    main()
