"""The model on one rank: truncated-backprop windows, loss, inference schedules, bad input."""

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from mimir_kernels import PrefixLMLayout, prefix_lm_mask

from mimir_megatron.batch import Batch, BatchError, single_sample_batch
from mimir_megatron.model import build_model
from mimir_megatron.model.rope import rotary_angles

# Applications with grad, as indices into L0 L1 L2 H0 L3 L4 L5 H1, written out by hand.
WINDOWS = {
    ("last_k", 1): {7},
    ("last_k", 2): {6, 7},
    ("last_k", 4): {4, 5, 6, 7},
    ("last_k", 5): {3, 4, 5, 6, 7},
    ("last_k", 8): set(range(8)),
    ("h_first", 1): {6},
    ("h_first", 3): {3, 6, 7},
    ("h_first", 4): {3, 5, 6, 7},
}


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config())


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    prefix = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (1, 4, 7)]
    response = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (6, 3, 2)]
    return single_sample_batch(prefix, response, seq_len=10)


def explicit_loss(model, batch: Batch, with_grad: set[int]) -> torch.Tensor:
    """The recurrence written out independently of the model's loop and loss."""
    cfg = model.cfg
    # The dense reference layout, whatever backend the model would pick.
    layout = PrefixLMLayout("dense", dense_mask=prefix_lm_mask(batch.segment_ids, batch.prefix_mask))
    angles = rotary_angles(batch.position_ids, cfg.head_dim, cfg.rope_theta)
    z_H = model.embedding(batch.input_ids).transpose(0, 1) * cfg.hidden_size ** 0.5
    z_L = model.z_L_init.expand_as(z_H)
    for i, module in enumerate("LLLHLLLH"):
        with nullcontext() if i in with_grad else torch.no_grad():
            if module == "L":
                z_L = model.L(z_L + z_H, attention_mask=None, rotary_pos_emb=angles,
                              packed_seq_params=layout)
            else:
                z_H = model.H(z_H + z_L, attention_mask=None, rotary_pos_emb=angles,
                              packed_seq_params=layout)
    logits = model.head(z_H)[0].transpose(0, 1)[..., : cfg.vocab_size]  # drop padded rows
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1),
                           ignore_index=-100)


def grads(model) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy,k", WINDOWS.keys())
def test_window_gradients_equal_explicit_loop(model, batch, policy, k):
    model.cfg.window_policy = policy
    try:
        model.zero_grad(set_to_none=True)
        out = model(batch, window=k, return_logits=False)
        out.loss.backward()
        ours = grads(model)
        model.zero_grad(set_to_none=True)
        explicit_loss(model, batch, WINDOWS[(policy, k)]).backward()
        theirs = grads(model)
    finally:
        model.cfg.window_policy = "last_k"
        model.zero_grad(set_to_none=True)
    plan = out.window
    for name, g in theirs.items():
        if g is None:
            assert ours[name] is None, f"{name} got a gradient outside the window"
        else:
            torch.testing.assert_close(ours[name], g, rtol=1e-5, atol=1e-7, msg=name)
    # A module with no application in the window gets no gradient at all.
    for stack, count in (("L.", plan.k_L), ("H.", plan.k_H)):
        stack_grads = [g for n, g in ours.items() if n.startswith(stack)]
        if count == 0:
            assert all(g is None for g in stack_grads)
    # The last application is H: when it is in the window, H always learns.
    if plan.grad[-1]:
        assert all(g is not None and g.abs().sum() > 0 for n, g in ours.items() if n.startswith("H."))


def test_loss_is_mean_over_response_tokens(model, batch):
    with torch.no_grad():
        out = model(batch)
    logits = out.logits
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1),
                               ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    assert out.num_supervised.item() == (6 + 3 + 2)
    # The caller can pass the global supervised count (e.g. the whole data-parallel batch).
    with torch.no_grad():
        halved = model(batch, num_supervised=torch.tensor(22), return_logits=False).loss
    torch.testing.assert_close(halved, expected / 2)


def test_packed_samples_do_not_see_each_other(model):
    """Two samples packed in one row give the logits each gets alone."""
    a = single_sample_batch([[5, 6, 7]], [[8, 9, 10]])
    b = single_sample_batch([[11, 12]], [[13, 14, 15, 16]])
    packed = Batch(
        input_ids=torch.cat([a.input_ids, b.input_ids, torch.zeros(1, 2, dtype=torch.long)], 1),
        position_ids=torch.cat([a.position_ids, b.position_ids, torch.zeros(1, 2, dtype=torch.long)], 1),
        segment_ids=torch.cat([a.segment_ids, 2 * b.segment_ids, torch.zeros(1, 2, dtype=torch.long)], 1),
        prefix_mask=torch.cat([a.prefix_mask, b.prefix_mask, torch.zeros(1, 2, dtype=torch.bool)], 1),
        labels=torch.cat([a.labels, b.labels, torch.full((1, 2), -100)], 1),
    )
    with torch.no_grad():
        together = model(packed).logits[0]
        alone_a, alone_b = model(a).logits[0], model(b).logits[0]
    torch.testing.assert_close(together[:5], alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together[5:10], alone_b, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(together).all()


def test_any_schedule_at_inference(model, batch):
    with torch.no_grad():
        default = model(batch).logits
        longer = model(batch, h_cycles=3, l_cycles=1).logits
    assert longer.shape == default.shape and torch.isfinite(longer).all()
    assert not torch.allclose(longer, default)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("input_ids", torch.zeros(3, 9, dtype=torch.long), "input_ids has shape|shape"),
        ("position_ids", torch.zeros(3, 10, dtype=torch.int32), "position_ids must be int64"),
        ("prefix_mask", torch.zeros(3, 10, dtype=torch.long), "prefix_mask must be bool"),
        ("segment_ids", torch.zeros(3, 11, dtype=torch.long), "segment_ids has shape"),
        ("labels", torch.full((3, 10), 250), "labels holds 250, outside the vocabulary"),
        ("input_ids", torch.full((3, 10), 300), "input_ids holds 300, outside the vocabulary"),
    ],
)
def test_bad_batches_name_the_field(model, batch, field, value, message):
    bad = Batch(**{**batch.__dict__, field: value})
    with pytest.raises(BatchError, match=message):
        model(bad)


def test_one_dimensional_input_is_refused(model, batch):
    bad = Batch(**{**batch.__dict__, "input_ids": batch.input_ids[0]})
    with pytest.raises(BatchError, match="2-D"):
        model(bad)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_vocab_loss_equals_the_plain_path(model, batch, chunk):
    """Same loss and gradients with the head + loss computed chunk by chunk (padded vocab too)."""
    model.zero_grad(set_to_none=True)
    plain = model(batch, window=8, return_logits=False)
    plain.loss.backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    model.cfg.execution.loss_chunk_tokens = chunk
    try:
        chunked = model(batch, window=8, return_logits=False)
        chunked.loss.backward()
    finally:
        model.cfg.execution.loss_chunk_tokens = 0
    got = grads(model)
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(chunked.loss, plain.loss, rtol=1e-6, atol=1e-6)
    assert chunked.num_supervised == plain.num_supervised
    # Only the fp32 summation order differs: relative error per tensor ~5e-7 measured.
    for name, grad in expected.items():
        assert ((got[name] - grad).norm() / grad.norm()).item() <= 1e-5, name


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_recompute_gives_the_same_gradients(batch, mode):
    plain = build_model(tiny_config("seed=9"))
    recomputing = build_model(tiny_config("seed=9", f"execution.recompute={mode}"))
    calls = {}
    for m in (plain, recomputing):
        m.train()
        core = m.L.layers[0].self_attention.core_attention
        calls[m] = 0

        def count(*_, m=m):
            calls[m] += 1

        core.register_forward_hook(count)
        m(batch, window=5, return_logits=False).loss.backward()
    # L runs 6 times, 3 of them in the window: recompute runs those 3 again in backward.
    assert (calls[plain], calls[recomputing]) == (6, 9)
    ours, reference = grads(recomputing), grads(plain)
    for name, grad in reference.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-6, atol=1e-8, msg=name)


@pytest.mark.parametrize("k", [2, 5, 8])
def test_full_recompute_gives_the_same_gradients_for_every_window(batch, k):
    """At k < 5 the window's first application has a no-grad input (the embedding is not in
    the window); megatron's reentrant checkpoint then dropped every weight gradient of that
    stack (model/hrm.py ``_stack_input``)."""
    plain = build_model(tiny_config("seed=9"))
    recomputing = build_model(tiny_config("seed=9", "execution.recompute=full"))
    for m in (plain, recomputing):
        m.train()
        m(batch, window=k, return_logits=False).loss.backward()
    ours, reference = grads(recomputing), grads(plain)
    assert ours.keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-6, atol=1e-8, msg=name)
