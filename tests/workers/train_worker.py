"""Worker: one rank of a short `mimir train` run; rank 0 writes the losses as JSON.

Usage: train_worker.py DEMO_DATA RUN_DIR STOP_AT_STEP|none [overrides...]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import REPO, train_overrides  # noqa: E402

from mimir_megatron.process import setup_process  # noqa: E402
from mimir_megatron.train.config import load_train_config  # noqa: E402
from mimir_megatron.train.loop import train  # noqa: E402

setup_process(megatron=True)  # a worker is an entry point


def main() -> None:
    demo, run_dir, stop, *extra = sys.argv[1:]
    cfg = load_train_config(REPO / "configs/train/demo.yaml", train_overrides(Path(demo), Path(run_dir), *extra))
    result = train(cfg, stop_at_step=None if stop == "none" else int(stop))
    import torch.distributed as dist

    if dist.get_rank() == 0:
        (Path(run_dir) / f"losses_{result.final_step}.json").write_text(json.dumps(result.losses))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
