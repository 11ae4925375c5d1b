"""Worker: one rank of the distributed optimizer's gradient reduction (train/dist_optim.py),
checked against sums written out here.

Usage (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): reduce_scatter_worker.py
Rank r sets every gradient to (r + 1) x a known tensor, one weight with rows DP divides (one
reduce-scatter into the buffer's own slice), one with rows it does not (chunks of
``row_range``). Afterwards each rank's rows must hold the sum over the ranks, the other rows its
own gradient untouched (a reduce-scatter, not an all-reduce), the gradient norm must be that of
the summed gradient, and clipping must scale the rows. Exits non-zero with the mismatch.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from mimir_megatron.process import setup_process  # noqa: E402

setup_process(megatron=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mimir_megatron import parallel  # noqa: E402
from mimir_megatron.train.dist_optim import DistributedOptimizer, row_range  # noqa: E402
from mimir_megatron.train.optim import clip_, grad_norm  # noqa: E402

SHAPES = {"L.even": (6, 3), "H.odd": (5, 4)}  # over 2 ranks: 3 + 3 rows; 2 + 3 rows


def main() -> None:
    parallel.init_distributed()
    parallel.init_model_parallel(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    base = {n: torch.arange(r * c, dtype=torch.float32).view(r, c) + 0.5 for n, (r, c) in SHAPES.items()}
    params = {n: torch.nn.Parameter(torch.zeros(shape)) for n, shape in SHAPES.items()}
    for name, p in params.items():
        p.main_grad = base[name] * (rank + 1)
    groups = {name.split(".")[0]: [(name, p)] for name, p in params.items()}
    opt = DistributedOptimizer(groups, torch.optim.AdamW, {}, 1e-3)
    opt.reduce_scatter_gradients(SimpleNamespace(buffers=[]))
    total = sum(range(1, size + 1))
    for name, p in params.items():
        mine = row_range(p.shape[0], rank, size)
        want = base[name] * (rank + 1)
        want[mine] = base[name][mine] * total
        assert torch.equal(p.main_grad, want), f"rank {rank} {name}: {p.main_grad} != {want}"
    full = torch.cat([(b * total).flatten() for b in base.values()])
    norm = grad_norm(list(params.values()), opt)
    assert torch.allclose(norm, full.norm(), rtol=1e-6), f"norm {norm} != {full.norm()}"
    clip_(list(params.values()), norm.item(), 1.0, opt)
    for name, p in params.items():
        mine = row_range(p.shape[0], rank, size)
        assert torch.allclose(p.main_grad[mine], base[name][mine] * total / (norm + 1e-6)), name
    print(f"rank {rank}: reduce-scatter, norm and clipping as summed by hand", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
