"""Worker: one rank of a short `mimir train` run that records, per rank, which epochs it packed
(and whether inside the step loop) and the documents of every sample it read.

Usage: data_epochs_worker.py DEMO_DATA RUN_DIR OUT_DIR [overrides...]; writes OUT_DIR/rank<r>.json.
"""

import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import REPO, train_overrides  # noqa: E402

from mimir_megatron.process import setup_process  # noqa: E402

setup_process(megatron=True)  # a worker is an entry point

import mimir_megatron.data.loader as loader  # noqa: E402
import mimir_megatron.train.loop as loop  # noqa: E402
from mimir_megatron.train.config import load_train_config  # noqa: E402

in_loop = threading.Event()
builds: list[dict] = []
samples: dict[int, list[int]] = {}


def record_builds(build):
    def wrapped(*args, **kwargs):
        builds.append({"epoch": kwargs["epoch"], "in_step_loop": in_loop.is_set(),
                       "thread": threading.current_thread().name})
        return build(*args, **kwargs)
    return wrapped


def record_loop(real_loop):
    def wrapped(*args, **kwargs):
        in_loop.set()
        return real_loop(*args, **kwargs)
    return wrapped


def record_samples(context_documents):
    def wrapped(self, sample):
        docs = context_documents(self, sample)
        samples[int(sample)] = [int(d) for d in docs]
        return docs
    return wrapped


def main() -> None:
    demo, run_dir, out, *extra = sys.argv[1:]
    loader.build_epoch_index = record_builds(loader.build_epoch_index)
    loop._loop = record_loop(loop._loop)
    loader.PackedMixture.context_documents = record_samples(loader.PackedMixture.context_documents)
    cfg = load_train_config(REPO / "configs/train/demo.yaml", train_overrides(Path(demo), Path(run_dir), *extra))
    result = loop.train(cfg)
    import torch.distributed as dist

    rank = dist.get_rank()
    record = {"builds": builds, "samples": samples, "losses": result.losses}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
