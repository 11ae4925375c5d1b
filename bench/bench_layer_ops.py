"""Usage: OMP_NUM_THREADS=1 python bench/bench_layer_ops.py [ROUNDS]

CPU time (process time, best and median of ROUNDS) of one forward + backward of two layer ops in
the train step's hot path, each next to the expression it replaces or was measured against,
alternating, at the tiny and mid shapes:

- SwiGLU: megatron's unfused ``glu`` (chunk, silu, ``x2 + 0.0``, mul; autograd's backward with a
  cat) vs ``mimir_megatron.model.swiglu`` (one node).
- RoPE: the table's plain expression (``RotaryTable.apply``, autograd) vs the same arithmetic as
  one autograd node, as tried for issue 21 (not kept: it was slower).
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from mimir_megatron.model.rope import RotaryTable, rotary_angles
from mimir_megatron.model.swiglu import swiglu


def megatron_glu(x: torch.Tensor) -> torch.Tensor:
    gate, linear = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * (linear + 0.0)


class RopeNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin_signed):
        ctx.save_for_backward(cos, sin_signed)
        t1, t2 = torch.chunk(t, 2, dim=-1)
        return t * cos + torch.cat((t2, t1), dim=-1) * sin_signed

    @staticmethod
    def backward(ctx, g):
        cos, sin_signed = ctx.saved_tensors
        u1, u2 = torch.chunk(g * sin_signed, 2, dim=-1)
        return g * cos + torch.cat((u2, u1), dim=-1), None, None


def timed(fns: dict, make_input, grad, rounds: int) -> None:
    def run(f):
        x = make_input()
        out = f(x)
        out.backward(grad)
        return out

    times = {name: [] for name in fns}
    for i in range(rounds + 1):
        for name, f in (fns.items() if i % 2 == 0 else reversed(fns.items())):
            start = time.process_time()
            run(f)
            if i:
                times[name].append(time.process_time() - start)
    for name, t in times.items():
        print(f"  {name:28s} best {1e3 * min(t):7.3f} ms  median {1e3 * statistics.median(t):7.3f} ms")


def main(rounds: int) -> None:
    # (seq, batch, heads, head_dim, ffn): 4 x 256 tokens of tiny, 2 x 128 of mid (bench_step_alternating)
    for shape, (s, b, h, d, ffn) in {"tiny": (256, 4, 4, 64, 768), "mid": (128, 2, 6, 128, 2048)}.items():
        g = torch.Generator().manual_seed(0)
        fc1 = torch.randn(s, b, 2 * ffn, generator=g)
        print(f"{shape} SwiGLU on [{s}, {b}, {2 * ffn}]")
        timed({"megatron glu (autograd)": megatron_glu, "swiglu node": swiglu},
              lambda: fc1.clone().requires_grad_(True), torch.randn(s, b, ffn, generator=g), rounds)
        table = RotaryTable(rotary_angles(torch.arange(s).expand(b, s), d, 10000.0))
        qkv = torch.randn(s, b, h, 4 * d, generator=g)  # q is a strided view, as megatron's split gives
        print(f"{shape} RoPE on q [{s}, {b}, {h}, {d}] (a view of a fused projection)")
        timed({"table, plain (autograd)": table.apply,
               "one node": lambda t: RopeNode.apply(t, table.cos, table.sin_signed)},
              lambda: qkv.clone().requires_grad_(True)[..., d:2 * d], torch.randn(s, b, h, d, generator=g),
              rounds)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
