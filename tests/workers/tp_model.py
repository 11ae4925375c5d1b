"""Worker: build the model at TP=2, run forward/backward, save full weights, grads and logits.

Run by tests/integration/test_tensor_parallel.py as two gloo ranks; rank 0 writes the results.
"""

import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import tiny_config  # noqa: E402
from batches import OVERRIDES, make_batch  # noqa: E402

from mimir_megatron.process import setup_process  # noqa: E402
from mimir_megatron.interop import export_hf  # noqa: E402
from mimir_megatron.model import build_model  # noqa: E402
from mimir_megatron.model.state import gather_full_state  # noqa: E402

setup_process(megatron=True)  # a worker is an entry point


def main(out: Path) -> None:
    batch = make_batch()
    # (name, sequence parallel, tokens per chunk of the fused head + loss; 0 = plain head)
    for name, sp, chunk in (("sp1", True, 0), ("sp0", False, 0), ("chunked", True, 5)):
        cfg = tiny_config(*OVERRIDES, "parallel.tensor_parallel_size=2", f"parallel.sequence_parallel={sp}",
                          f"execution.loss_chunk_tokens={chunk}")
        model = build_model(cfg)
        result = model(batch, window=8, return_logits=not chunk)
        result.loss.backward()
        weights = gather_full_state(model)
        grads = gather_full_state(model, lambda p: p.grad)
        if dist.get_rank() == 0:
            tensors = {f"weight/{k}": v for k, v in weights.items()}
            tensors |= {f"grad/{k}": v for k, v in grads.items()}
            if result.logits is not None:
                tensors["logits"] = result.logits.detach()
            tensors["loss"] = result.loss.detach().reshape(1)
            save_file(tensors, str(out / f"tp2_{name}.safetensors"))
        if name == "sp1":
            export_hf(model, out / "hf_tp2")
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
