"""Worker: one rank of a short training run that records what the optimizer holds on this rank.

Usage: numerics_worker.py DEMO_DATA RUN_DIR [overrides...]. Each rank writes
``shard_rank<r>.json``: every parameter (``group/index`` -> elements), the ones whose Adam state
this rank owns, and the elements of that state (the distributed optimizer: the rows of each
parameter this rank keeps, and the dtypes, and the collectives of the first step's gradient
reduction: the elements of each reduce-scatter's input and the largest all-reduce); rank 0 also
writes ``losses.json``. Gradient norms are in the run's MLflow store.
"""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import REPO, train_overrides  # noqa: E402

from mimir_megatron.process import setup_process  # noqa: E402
from mimir_megatron.train import loop  # noqa: E402
from mimir_megatron.train import step as train_step  # noqa: E402
from mimir_megatron.train.config import load_train_config  # noqa: E402
from mimir_megatron.train.optim import local_optimizer, owned_parameters  # noqa: E402

setup_process(megatron=True)  # a worker is an entry point


def describe(optimizer) -> dict:
    if hasattr(optimizer, "all_shards"):  # the distributed optimizer, FSDP2: this rank's rows of each weight
        shards = optimizer.all_shards()
        return {"rows": {s.name: [s.rows.start, s.rows.stop, s.param.shape[0], math.prod(s.param.shape[1:])]
                         for s in shards},
                "main_dtype": sorted({str(s.main.dtype) for s in shards}),
                "param_dtype": sorted({str(s.param.dtype) for s in shards}),
                "local_elements": sum(s.main.numel() for s in shards),
                "grad_elements": sum(s.param.main_grad.numel() for s in shards),
                "state_elements": sum(s["exp_avg"].numel() for s in optimizer.state.values())}
    keys = {id(p): f"{g['name']}/{i}" for g in optimizer.param_groups for i, p in enumerate(g["params"])}
    local = local_optimizer(optimizer)
    return {
        "all": {keys[id(p)]: p.numel() for g in optimizer.param_groups for p in g["params"]},
        "owned": sorted(keys[id(p)] for p in owned_parameters(optimizer)),
        "state_elements": sum(s["exp_avg"].numel() for s in local.state.values()),
    }


def main() -> None:
    import torch.distributed as dist

    demo, run_dir, *extra = sys.argv[1:]
    run_dir = Path(run_dir)
    real_step, seen = train_step.optimizer_step, {}
    comm = {"reduce_scatter": [], "all_reduce_max": 0}
    collectives = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_tensor",
                                                          "reduce_scatter")}

    def count(name):
        def collective(*args, **kwargs):
            if "shard" not in seen:  # until the first update: step 1's reduction
                if name == "all_reduce":
                    comm["all_reduce_max"] = max(comm["all_reduce_max"], args[0].numel())
                else:  # the input: one tensor, or a list of chunks
                    inputs = args[1] if name == "reduce_scatter" else [args[1]]
                    comm["reduce_scatter"].append(sum(t.numel() for t in inputs))
            return collectives[name](*args, **kwargs)
        return collective

    for name in collectives:
        setattr(dist, name, count(name))

    def spy(optimizer, plan):
        seen.setdefault("shard", describe(optimizer) | {"comm": comm})
        real_step(optimizer, plan)

    train_step.optimizer_step = spy
    cfg = load_train_config(REPO / "configs/train/demo.yaml", train_overrides(Path(demo), run_dir, *extra))
    result = loop.train(cfg)
    rank = dist.get_rank()
    (run_dir / f"shard_rank{rank}.json").write_text(json.dumps(seen["shard"]))
    if rank == 0:
        (run_dir / "losses.json").write_text(json.dumps(result.losses))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
