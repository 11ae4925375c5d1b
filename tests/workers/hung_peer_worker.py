"""Worker: two gloo ranks with train.collective_timeout_s=TIMEOUT; rank 1 hangs (never joins
the all-reduce), rank 0 must fail with an error instead of waiting for ever.

Usage (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): hung_peer_worker.py CONFIG TIMEOUT
Rank 0 prints "collective failed after N s: ..." and exits 3 when the all-reduce raises.
"""

import sys
import time

import torch
import torch.distributed as dist

from mimir_megatron import parallel
from mimir_megatron.train.config import load_train_config

if __name__ == "__main__":
    config, timeout = sys.argv[1:]
    cfg = load_train_config(config, [f"train.collective_timeout_s={timeout}"])
    env = parallel.init_distributed(timeout_s=cfg.train.collective_timeout_s)
    dist.barrier()  # both ranks are up
    if env.rank == 1:
        time.sleep(600)  # alive, connected, never answering: a hung peer
        sys.exit(0)
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError (a DistBackendError)
        print(f"collective failed after {time.monotonic() - started:.0f} s: {exc}", flush=True)
        sys.exit(3)
    sys.exit(0)
