"""The GPU fast path against the CPU-path references, on CUDA (``bench/gpu_check.sh`` runs these).

bf16 autocast cannot be checked on CPU instead: megatron's linear layers bind their custom
autograd functions to CUDA autocast (``custom_fwd(device_type="cuda")``), so under CPU autocast
their backward multiplies a bf16 gradient with an fp32 weight and fails.

Every test here needs CUDA and skips cleanly without it; the Transformer Engine tests also skip,
naming the reason, where TE does not import. Tolerances are stated per test: bf16 compute
against an fp32 reference of the same weights and batch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from batches import packed_batch
from models import SHAPE, like

from mimir_megatron import backend
from mimir_megatron.model import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

needs_te = pytest.mark.skipif(
    torch.cuda.is_available() and backend.transformer_engine_missing() is not None,
    reason=f"Transformer Engine unavailable: {backend.transformer_engine_missing()}",
)

# A shape where bf16 kernels take their fast paths (head_dim 64, multiples of 16).
def cuda_batch(seq: int = 256, rows: int = 2):
    """Long rows of many packed samples (the test batch tiled), padding at the end."""
    base = packed_batch(rows=rows, seq=24)
    reps = seq // 24
    fields = {}
    for name in ("input_ids", "position_ids", "segment_ids", "prefix_mask", "labels"):
        t = getattr(base, name)
        tiled = t.repeat(1, reps)
        if name == "segment_ids":  # samples of each tile are new samples
            offsets = torch.arange(reps).repeat_interleave(24) * 10
            tiled = torch.where(tiled > 0, tiled + offsets, 0)
        pad = torch.full((rows, seq - tiled.shape[1]), -100 if name == "labels" else 0, dtype=t.dtype)
        fields[name] = torch.cat([tiled, pad], dim=1)
    fields["input_ids"] = fields["input_ids"] % 1024
    from mimir_megatron.batch import Batch

    return Batch(**fields).to("cuda")


def loss_and_grads(model, batch, bf16: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        out = model(batch, return_logits=False)
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                                       if p.grad is not None}


def assert_grads_close(got, ref, rel: float):
    """Each parameter's gradient within ``rel`` of the reference's norm (bf16 round-off)."""
    assert got.keys() == ref.keys()
    for name, g in ref.items():
        err = (got[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < rel, f"{name}: relative gradient error {err:.3g} >= {rel}"


def assert_matches(got, ref, loss_rtol: float, grad_rel: float) -> None:
    """(loss, grads) within ``loss_rtol`` and norm-relative ``grad_rel`` of the reference's."""
    torch.testing.assert_close(got[0], ref[0], rtol=loss_rtol, atol=0)
    assert_grads_close(got[1], ref[1], rel=grad_rel)


@pytest.fixture(scope="module")
def reference():
    """fp32, dense attention, local layers: the CPU path's semantics, on the GPU."""
    model = build_model(tiny_config(*SHAPE, "execution.attention_backend=dense"))
    batch = cuda_batch()
    return model, batch, loss_and_grads(model, batch, bf16=False)


@pytest.mark.parametrize("attention", ["dense", "flex", "varlen"])
def test_bf16_attention_backends_match_fp32_dense(reference, attention):
    """Loss within 2 % and gradients within 5 % (norm-relative) of fp32 dense."""
    ref_model, batch, ref = reference
    got = loss_and_grads(like(ref_model, f"execution.attention_backend={attention}"), batch, bf16=True)
    assert_matches(got, ref, loss_rtol=2e-2, grad_rel=5e-2)


@pytest.mark.parametrize("attention", ["flex"])  # flash varlen kernels take fp16/bf16 only
def test_fp32_fused_attention_matches_dense_closely(reference, attention):
    """The same kernel in fp32: loss within 1e-4 and gradients within 1e-3 of dense."""
    ref_model, batch, ref = reference
    got = loss_and_grads(like(ref_model, f"execution.attention_backend={attention}"), batch, bf16=False)
    assert_matches(got, ref, loss_rtol=1e-4, grad_rel=1e-3)


def test_compiled_flex_stacks_match_eager(reference):
    """fp32, so that a real error is not lost in bf16 round-off: loss and gradients within 1e-4."""
    ref_model, batch, _ = reference
    eager = loss_and_grads(like(ref_model, "execution.attention_backend=flex"), batch, bf16=False)
    compiled = loss_and_grads(like(ref_model, "execution.attention_backend=flex", "execution.compile=true"), batch, bf16=False)
    assert_matches(compiled, eager, loss_rtol=1e-4, grad_rel=1e-4)


def test_bf16_training_steps_reduce_the_loss(reference):
    """A few AdamW steps on one batch under bf16 autocast: finite, decreasing loss."""
    ref_model, batch, _ = reference
    model = like(ref_model, "execution.attention_backend=dense")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss, _ = loss_and_grads(model, batch, bf16=True)
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0], losses


@needs_te
def test_transformer_engine_layers_keep_the_local_semantics(reference):
    """TE linears with our parameterless norm and megatron's sigmoid gate: same function as the
    local layers for the same weights (fp32: loss within 1e-4, gradients within 1e-3)."""
    ref_model, batch, ref = reference
    model = build_model(tiny_config(*SHAPE, "execution.attention_backend=dense", "execution.layer_backend=te"))
    assert model.layer_backend == "te"
    missing, unexpected = model.load_state_dict(ref_model.state_dict(), strict=False)
    assert all(k.endswith("_extra_state") for k in missing) and not unexpected
    assert not any("layer_norm_weight" in n for n, _ in model.named_parameters())
    assert_matches(loss_and_grads(model, batch, bf16=False), ref, loss_rtol=1e-4, grad_rel=1e-3)


@needs_te
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_recipes_train(reference, recipe):
    """FP8 (Hopper recipes) through TE: loss within 10 % of fp32 and decreasing over steps."""
    ref_model, batch, (ref_loss, _) = reference
    model = like(ref_model, "execution.attention_backend=flex", "execution.layer_backend=te", f"execution.fp8={recipe}", strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss, _ = loss_and_grads(model, batch, bf16=True)
        opt.step()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses[0]), ref_loss.cpu(), rtol=0.1, atol=0)
    assert losses[-1] < losses[0], losses
