"""The train step in one process: how the global batch is split into micro-batches does not change
the step. The loss of every micro-batch is divided by the supervised tokens of the whole global
batch, so one micro-batch of 4 rows and two of 2 rows give the same loss and gradients even when
the halves hold very different numbers of supervised tokens. (Across ranks:
tests/integration/test_train_parallel.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from mimir_megatron.batch import Batch, single_sample_batch

# fp32 throughout (no autocast, even on a GPU). Only the summation order differs between the
# two splits (one loss sum and one weight-gradient GEMM over 4 rows, or two over 2 rows added in
# the DDP buffer): measured at most 1.0e-7 relative per parameter tensor (about one fp32 ulp),
# so 1e-6 leaves a 10x margin. A per-micro-batch denominator is off by the halves' share of the
# supervised tokens (14 and 3 of 17): tens of per cent.
RTOL = 1e-6


def halves(batch: Batch) -> list[Batch]:
    fields = ("input_ids", "position_ids", "segment_ids", "prefix_mask", "labels")
    return [Batch(**{f: getattr(batch, f)[rows] for f in fields}) for rows in (slice(0, 2), slice(2, 4))]


@pytest.fixture(scope="module")
def trainer():
    from mimir_megatron import backend
    from mimir_megatron.model import build_model
    from mimir_megatron.train.config import OptimSection
    from mimir_megatron.train.step import build_trainer

    optim = OptimSection(clip_grad=0.0, ema_decay=0.0)  # clipping off: gradients as computed
    model = build_model(tiny_config("num_layers_L=1", "num_layers_H=1", "seed=2"))
    return build_trainer(model, optim, device=backend.device(), precision="fp32")


@pytest.mark.parametrize("loss_chunk_tokens", [0, 16])
def test_one_micro_batch_of_4_equals_two_of_2(trainer, loss_chunk_tokens, monkeypatch):
    from mimir_megatron.train.schedules import StepPlan
    from mimir_megatron.train.step import StepHooks, train_step
    from mimir_megatron.model.window import plan_window

    monkeypatch.setattr(trainer.model.cfg.execution, "loss_chunk_tokens", loss_chunk_tokens)
    g = torch.Generator().manual_seed(4)
    prefix = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (3, 2, 9, 10)]
    response = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (8, 6, 2, 1)]
    batch = single_sample_batch(prefix, response, seq_len=12)
    parts = halves(batch)
    assert [int(b.num_supervised()) for b in parts] == [14, 3]  # uneven halves

    cfg = trainer.model.cfg
    window = plan_window(cfg.h_cycles, cfg.l_cycles, cfg.depth, cfg.window_policy)  # every parameter
    # Learning rate 0: the weights stay as they are, so both splits see the same model.
    groups = [group["name"] for group in trainer.optimizer.param_groups]
    plan = StepPlan(step=0, window=window, lr=0.0, group_lr=dict.fromkeys(groups, 0.0), frozen=())
    before = [p.detach().clone() for p in trainer.params]
    seen = []

    def capture(step, loss_sum, params):
        seen.append((loss_sum.item(), [p.main_grad.detach().clone() for p in params]))

    outcomes = [train_step(trainer, micro_batches, plan, step=0, hooks=StepHooks(after_reduction=capture))
                for micro_batches in ([batch], parts)]
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, trainer.params))
    (whole_loss, whole_grads), (split_loss, split_grads) = seen
    assert outcomes[0].supervised == outcomes[1].supervised == 17
    assert split_loss == pytest.approx(whole_loss, rel=RTOL)
    assert outcomes[1].loss == pytest.approx(outcomes[0].loss, rel=RTOL)
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    for p, whole, split in zip(trainer.params, whole_grads, split_grads):
        assert whole.norm() > 0, names[id(p)]  # the window reaches every parameter
        err = ((split - whole).norm() / whole.norm()).item()
        assert err <= RTOL, f"{names[id(p)]}: gradients differ by {err:.2e} (relative)"
