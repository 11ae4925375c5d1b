"""A fixed tiny run's first steps equal recorded losses (one torch thread: a matmul's reduction
order follows its threads). A numerical change anywhere on the training path (data, packing, the
model, the loss, the optimizer and its groups, the window and LR schedules) fails here within
seconds, long before the demo's end-to-end check does. Record new values only for a change meant
to move the numbers, and say why in its commit message.

Bit for bit on the CPU they were recorded on; CPUs whose oneDNN/MKL kernels take another SIMD
path round some reductions differently: on another Xeon (AVX-512) steps 1, 4 and 6 came out one
float32 ulp away, the rest identical. So each loss may be at most ULPS float32 ulps from its
record. A bug moves them by far more: H's learning rate left undivided by its window (planted
once) moved steps 5 and 6 by 127,243 and 201,274 ulps."""

from __future__ import annotations

import torch
from conftest import REPO, train_overrides

from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.loop import train

# float.hex() of the losses of steps 1-6 (the window grows 2 -> 5 over them: window.ramp_fraction).
GOLDEN = ["0x1.cce1760000000p+2", "0x1.cf71000000000p+2", "0x1.aa5e080000000p+2", "0x1.a570100000000p+2",
          "0x1.8b57c80000000p+2", "0x1.9eab140000000p+2"]


ULPS = 2


def float32_ulps_apart(a: float, b: float) -> int:
    """How many float32 values lie between ``a`` and ``b`` (both positive)."""
    as_int = torch.tensor([a, b], dtype=torch.float32).view(torch.int32).tolist()
    return abs(as_int[0] - as_int[1])


def test_the_first_steps_equal_the_recorded_losses(demo_data, tmp_path):
    cfg = load_train_config(REPO / "configs" / "train" / "demo.yaml",
                            train_overrides(demo_data, tmp_path, "tracking.enabled=false"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses = train(cfg).losses
    finally:
        torch.set_num_threads(threads)
    apart = [float32_ulps_apart(loss, float.fromhex(g)) for loss, g in zip(losses, GOLDEN, strict=True)]
    assert max(apart) <= ULPS, f"losses {[loss.hex() for loss in losses]} are {apart} float32 ulps from the record"
