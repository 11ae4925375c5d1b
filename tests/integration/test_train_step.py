"""The train step reads the device at most once per step (outside its first, validating step).

Every call that makes the host wait for the device's values (``item``, ``tolist``, ``cpu``,
``numpy``, ``bool``/``float``/``int`` of a tensor) is counted between the starts of consecutive
steps, so the count covers the whole loop body: data, the step, logging, and what follows a step.
Optimizer step counters are exempt: torch's (non-capturable) Adam and our Adam-atan2 keep them
on the host, so reading them waits for nothing.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from conftest import REPO, train_overrides

from mimir_megatron.train import loop
from mimir_megatron.train.config import load_train_config

DEMO = REPO / "configs" / "train" / "demo.yaml"
SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


class SyncCounter:
    def __init__(self) -> None:
        self.sites: list[str] = []

    def wrap(self, name: str):
        real = getattr(torch.Tensor, name)

        def counted(tensor, *args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            if not any(_optimizer_internal(frame) for frame in stack):
                caller = stack[-1]
                self.sites.append(f"{name} at {caller.filename}:{caller.lineno}")
            return real(tensor, *args, **kwargs)

        return counted


def _optimizer_internal(frame: traceback.FrameSummary) -> bool:
    """torch's Adam variants and our Adam-atan2 read their host-side step counters."""
    return "/torch/optim/" in frame.filename or (
        frame.filename.endswith("mimir_megatron/train/optim.py") and frame.name == "step")


@pytest.mark.parametrize("optimizer", ["adamw", "adam_atan2"])
def test_at_most_one_host_sync_per_step(demo_data, tmp_path, monkeypatch, optimizer):
    counter = SyncCounter()
    step_starts: list[int] = []
    real_step = loop.train_step

    def timed_step(*args, **kwargs):
        step_starts.append(len(counter.sites))
        return real_step(*args, **kwargs)

    cfg = load_train_config(DEMO, train_overrides(
        demo_data, tmp_path, f"optim.optimizer={optimizer}", "optim.clip_grad=1e-3",
        "checkpoint.interval=100", "train.log_interval=2"))
    monkeypatch.setattr(loop, "train_step", timed_step)
    for name in SYNCING:
        monkeypatch.setattr(torch.Tensor, name, counter.wrap(name))
    result = loop.train(cfg)
    monkeypatch.undo()

    assert result.final_step == 6 and len(step_starts) == 6
    # From the start of step 2 to the start of step 6: four whole steps (logging ones included).
    per_step = [counter.sites[a:b] for a, b in zip(step_starts[1:], step_starts[2:])]
    for n, sites in enumerate(per_step, start=2):
        assert len(sites) <= 1, f"step {n}: {len(sites)} host syncs:\n" + "\n".join(sites)
    assert any(per_step), "the counter saw nothing: it does not count"


# -- the step's levers keep the numbers bit for bit ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_equals_megatrons_rope(dtype):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from mimir_megatron.model.rope import RotaryTable, rotary_angles

    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 500, (3, 17), generator=g)
    angles = rotary_angles(positions, 64, 10000.0)
    t = torch.randn(17, 3, 4, 64, generator=g).to(dtype)
    assert torch.equal(RotaryTable(angles).apply(t), _apply_rotary_pos_emb_bshd(t, angles))


def test_a_stack_with_the_rotary_table_equals_megatrons_rope_path():
    """One L stack, forward and backward: megatron applying RoPE from the angles (the old path)
    and our attention slot applying it from the table give identical outputs and gradients."""
    from conftest import tiny_config
    from models import packed_stack_input, stack_output_and_grads

    from mimir_megatron.model import build_model
    from mimir_megatron.model.attention import RotaryLayout
    from mimir_megatron.model.rope import RotaryTable

    model = build_model(tiny_config())
    x, layout, angles = packed_stack_input(model)

    def run(**stack_args):
        return stack_output_and_grads(model.L, x, **stack_args)

    old_out, old_grads = run(rotary_pos_emb=angles, packed_seq_params=layout)
    new_out, new_grads = run(rotary_pos_emb=None,
                             packed_seq_params=RotaryLayout.of(layout, RotaryTable(angles)))
    assert torch.equal(old_out, new_out)
    assert old_grads.keys() == new_grads.keys()
    for name in old_grads:
        assert torch.equal(old_grads[name], new_grads[name]), name
