"""The inference stacks (inference/fast_stack.py) against megatron's blocks, the training forward."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from mimir_kernels import build_layout

from mimir_megatron.batch import single_sample_batch
from mimir_megatron.inference.fast_stack import FastStack, fast_stacks
from mimir_megatron.model import build_model
from mimir_megatron.model.attention import RotaryLayout
from mimir_megatron.model.rope import RotaryTable, rotary_angles


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config("seed=11")).eval()


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(2)
    prefix = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (1, 5, 9)]
    response = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (8, 4, 2)]
    return single_sample_batch(prefix, response, seq_len=12)


def _layout(model, batch):
    rotary = RotaryTable(rotary_angles(batch.position_ids, model.cfg.head_dim, model.cfg.rope_theta))
    return RotaryLayout.of(build_layout(model.attention_backend, batch.segment_ids, batch.prefix_mask), rotary)


@torch.no_grad()
@pytest.mark.parametrize("stack", ["L", "H"])
def test_fast_stack_equals_the_megatron_block(model, batch, stack):
    block = getattr(model, stack)
    layout = _layout(model, batch)
    hidden = torch.randn(batch.shape[1], batch.shape[0], model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    expected = block(hidden, attention_mask=None, rotary_pos_emb=None, packed_seq_params=layout)
    got = FastStack(block)(hidden, attention_mask=None, rotary_pos_emb=None, packed_seq_params=layout)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-5


@torch.no_grad()
@pytest.mark.parametrize("h,low", [(2, 3), (1, 1)])
def test_recurrence_with_fast_stacks_equals_the_training_forward(model, batch, h, low):
    """The whole recurrence (the function the training forward runs) with the fast stacks."""
    plan = model.window_plan(1, h, low)
    layout = build_layout(model.attention_backend, batch.segment_ids, batch.prefix_mask)
    expected = model.recurrence(batch.input_ids, batch.position_ids, layout, plan)
    got = model.recurrence(batch.input_ids, batch.position_ids, layout, plan, stacks=fast_stacks(model))
    assert (got - expected).abs().max().item() < 1e-5
    # and the logits of the model's own forward (megatron's head and gather)
    logits = model(batch, h_cycles=h, l_cycles=low).logits
    assert (model.head_logits(got) - logits).abs().max().item() < 1e-5


def test_fast_stacks_are_refused_where_they_do_not_apply(model):
    model.train()
    try:
        assert fast_stacks(model) is None  # training: megatron's modules (autograd, dropout)
    finally:
        model.eval()
    assert fast_stacks(model) is not None


@torch.no_grad()
def test_megatrons_layers_raise_no_tp_group_warning(model, batch):
    """megatron-core 0.19's RowParallelLinear passes ``tp_group=None`` to its matmul, which warns
    on every call; the spec's GroupedRowParallelLinear and the logits gather pass the group."""
    import warnings

    assert torch.distributed.is_initialized()  # the warning is raised only then
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(batch)
    assert not [w for w in caught if "tp_group" in str(w.message)]
