"""Optimizer pieces against hand-computed values: Adam-atan2, frozen groups, EMA, gradient norm."""

import math

import pytest
import torch

from mimir_megatron.train.optim import EMA, AdamAtan2, grad_norm, group_of, init_state, optimizer_step
from mimir_megatron.train.schedules import StepPlan


def test_adam_atan2_two_steps_by_hand():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = AdamAtan2([p], lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, a=1.27, b=1.0)
    g1, g2 = torch.tensor([0.5, 0.25]), torch.tensor([-1.0, 0.5])
    expected = p.detach().clone()
    m = v = torch.zeros(2)
    for t, g in enumerate((g1, g2), start=1):
        p.grad = g
        opt.step()
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
        expected = expected * (1 - 0.1 * 0.1)
        m_hat, v_hat = m / (1 - 0.9**t), v / (1 - 0.95**t)
        expected = expected - 0.1 * 1.27 * torch.atan2(m_hat, v_hat.sqrt())
        torch.testing.assert_close(p.detach(), expected)
    # the first update of Adam-atan2 is a*atan2(g, |g|) = a*pi/4 per coordinate, whatever |g|
    q = torch.nn.Parameter(torch.tensor([0.0]))
    opt = AdamAtan2([q], lr=1.0, weight_decay=0.0)
    q.grad = torch.tensor([1e-12])
    opt.step()
    assert q.item() == pytest.approx(-1.27 * math.pi / 4, rel=1e-6)


def test_frozen_group_gets_no_update_and_no_weight_decay():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    for p in (a, b):
        p.main_grad = torch.full((3,), 0.5)
    opt = torch.optim.AdamW([{"params": [a], "name": "L"}, {"params": [b], "name": "H"}],
                            lr=0.1, weight_decay=0.5)
    for group in opt.param_groups:
        for p in group["params"]:
            init_state(opt, p)
    plan = StepPlan(step=0, window=None, lr=0.1, group_lr={"L": 0.0, "H": 0.1}, frozen=("L",))
    optimizer_step(opt, plan)
    assert torch.equal(a.detach(), torch.ones(3))          # frozen: untouched, no decay
    assert opt.state[a]["step"].item() == 0
    assert (b.detach() < 1).all() and opt.state[b]["step"].item() == 1
    assert a.grad is None and b.grad is None               # DDP buffers released


def test_ema_is_fp32_and_follows_the_weights():
    model = torch.nn.Linear(2, 2, bias=False).to(torch.bfloat16)
    ema = EMA(model, decay=0.5)
    start = ema.shadow["weight"].clone()
    assert start.dtype == torch.float32
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)
    torch.testing.assert_close(ema.shadow["weight"], 0.5 * start + 0.5 * model.weight.float())


def test_ema_keeps_decay_of_the_average_and_takes_one_minus_decay_of_the_weights():
    """At decay 0.9 (not 0.5, where swapping decay and 1 - decay changes nothing): two updates by
    hand, 0.9 * 1 + 0.1 * 3 = 1.2 then 0.9 * 1.2 + 0.1 * 5 = 1.58."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema = EMA(model, decay=0.9)
    for value in (3.0, 5.0):
        with torch.no_grad():
            model.weight.fill_(value)
        ema.update(model)
    torch.testing.assert_close(ema.shadow["weight"], torch.tensor([[1.58]]))
    ema.copy_to(model)
    assert model.weight.item() == pytest.approx(1.58)


def test_groups_by_name():
    assert [group_of(n) for n in ("embedding.weight", "head.weight", "L.layers.0.mlp.linear_fc1.weight",
                                  "H.layers.3.self_attention.linear_qkv.weight")] == ["embedding", "head", "L", "H"]


def test_grad_norm_by_hand_and_bit_for_bit_per_parameter():
    """3-4-12-84 (9 + 16 + 144 = 169 = 13^2; 13^2 + 84^2 = 85^2), then random gradients of
    several sizes: the scratch-buffer norm equals the per-parameter squares summed in order."""
    from mimir_megatron import parallel

    parallel.init_model_parallel(1)  # grad_norm asks the TP size (one process, TP 1)
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1, 2))]
    params[0].main_grad = torch.tensor([3.0, 4.0])
    params[1].main_grad = torch.tensor([[12.0, 84.0]])
    assert grad_norm(params).item() == 85.0
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(7, 5), (300, 40), (3,), (64, 64)]]
    expected = torch.zeros(())
    for p in params:
        p.main_grad = torch.randn(p.shape, generator=g)
        expected += p.main_grad.float().pow(2).sum()
    assert torch.equal(grad_norm(params), expected.sqrt())
