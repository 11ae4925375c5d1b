"""A fixed tiny run's first steps equal recorded losses bit for bit (one torch thread: a matmul's
reduction order follows its threads). A numerical change anywhere on the training path (data,
packing, the model, the loss, the optimizer and its groups, the window and LR schedules) fails
here within seconds, long before the demo's end-to-end check does. Record new values only for a
change meant to move the numbers, and say why in its commit message."""

from __future__ import annotations

import torch
from conftest import REPO, train_overrides

from mimir_megatron.train.config import load_train_config
from mimir_megatron.train.loop import train

# float.hex() of the losses of steps 1-6 (the window grows 2 -> 5 over them: window.ramp_fraction).
GOLDEN = ["0x1.cce1760000000p+2", "0x1.cf71000000000p+2", "0x1.aa5e080000000p+2", "0x1.a570100000000p+2",
          "0x1.8b57c80000000p+2", "0x1.9eab140000000p+2"]


def test_the_first_steps_equal_the_recorded_losses(demo_data, tmp_path):
    cfg = load_train_config(REPO / "configs" / "train" / "demo.yaml",
                            train_overrides(demo_data, tmp_path, "tracking.enabled=false"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses = train(cfg).losses
    finally:
        torch.set_num_threads(threads)
    assert [loss.hex() for loss in losses] == GOLDEN
