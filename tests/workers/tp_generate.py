"""Worker: the inference engine at TP=2 (with and without sequence parallelism) runs the test's
workload; rank 0 writes the tokens and log-probs. Run by tests/integration/test_inference.py as two gloo ranks."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import tiny_config  # noqa: E402
from inference_workloads import tp_workload  # noqa: E402

from mimir_megatron.process import setup_process  # noqa: E402
from mimir_megatron.inference import InferenceEngine  # noqa: E402
from mimir_megatron.model import build_model  # noqa: E402

setup_process(megatron=True)  # a worker is an entry point


def main(out: Path) -> None:
    for name, sp in (("sp1", True), ("sp0", False)):
        model = build_model(tiny_config("seed=5", "parallel.tensor_parallel_size=2", f"parallel.sequence_parallel={sp}"))
        result = tp_workload(InferenceEngine(model.eval(), None))
        if dist.get_rank() == 0:
            (out / f"tp_generate_{name}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
