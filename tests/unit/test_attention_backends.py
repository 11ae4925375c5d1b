"""The flex and varlen attention backends against the dense reference.

CPU: the flex ``mask_mod`` and block mask against the dense mask, flex forward (CPU flex has no
backward), varlen forward and gradients with the reference varlen kernel, which exercises all of
the two-pass index math. CUDA (``gpu`` marker): compiled flex and torch's ``varlen_attn`` in bf16
against the dense reference in fp32, forward and gradients, up to a realistic shape.
"""

from __future__ import annotations

import pytest
import torch
from batches import random_packed, rows_of
from mimir_kernels import (
    ATTENTION_BACKENDS,
    PrefixLMLayout,
    build_layout,
    dense_prefix_lm_attention,
    prefix_lm_attention,
    prefix_lm_mask,
)
from mimir_kernels.flex_prefix_lm import build_block_mask, prefix_lm_mask_mod
from mimir_kernels.varlen_prefix_lm import (
    build_varlen_index,
    reference_varlen_attention,
    varlen_prefix_lm_attention,
)
from torch.nn.attention.flex_attention import create_mask

# --- batches ---------------------------------------------------------------------------------


CASES = {
    "random_a": lambda: random_packed(3, 53, seed=0),
    "random_b": lambda: random_packed(2, 130, seed=1, max_len=12),  # crosses a flex block edge
    "random_c": lambda: random_packed(4, 40, seed=2, max_len=3),
    "one_token_prefix": lambda: rows_of([[(1, 7), (1, 1), (3, 2)]], 20),
    "one_token_response": lambda: rows_of([[(5, 1), (2, 1)], [(1, 1), (6, 1)]], 12),
    "many_tiny_samples": lambda: rows_of([[(1, 1)] * 20 + [(2, 1)] * 12], 80),  # 32 samples
    "row_is_one_sample": lambda: rows_of([[(9, 23)], [(1, 31)]], 32),
    "padding_at_end_only": lambda: rows_of([[(4, 4), (3, 5)], [(16, 0), (2, 2)]], 24),
    "no_response_tokens": lambda: rows_of([[(6, 0), (3, 3), (4, 0)], [(5, 0)]], 16),
    "no_prefix_tokens": lambda: rows_of([[(0, 5), (3, 3), (0, 1)]], 16),
    "padding_in_the_middle": lambda: rows_of([[(3, 2), 3, (2, 4)], [2, (4, 4)]], 18),
    "padding_only_row": lambda: rows_of([[(2, 3)], []], 8),
}


def qkv(segments: torch.Tensor, heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0,
        device: str = "cpu") -> list[torch.Tensor]:
    batch, seq = segments.shape
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(seq, batch, heads, head_dim, generator=g, dtype=dtype).to(device) for _ in range(3)]


def attention_and_grads(fn, q, k, v, grad_out) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


# --- CPU: flex ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_flex_mask_mod_is_the_rule(case):
    segments, prefix = CASES[case]()
    batch, seq = segments.shape
    allowed = create_mask(prefix_lm_mask_mod(segments, prefix), batch, 1, seq, seq, device="cpu")
    assert torch.equal(allowed, ~prefix_lm_mask(segments, prefix))


@pytest.mark.parametrize("case", ["random_a", "random_b", "many_tiny_samples"])
def test_flex_block_mask_covers_every_allowed_pair(case):
    # Blocks the kernel skips must hold no allowed pair; checked at a small block size so that
    # several blocks per row are skipped.
    segments, prefix = CASES[case]()
    seq = segments.shape[1]
    block_mask = build_block_mask(segments, prefix, block_size=16)
    blocks = block_mask.to_dense()[:, 0].bool()  # [b, q_blocks, kv_blocks]
    present = blocks.repeat_interleave(16, 1).repeat_interleave(16, 2)[:, :seq, :seq]
    allowed = ~prefix_lm_mask(segments, prefix)[:, 0]
    assert not (allowed & ~present).any()
    assert not present.all(), "nothing was skipped: the test proves little"


@pytest.mark.parametrize("case", sorted(CASES))
def test_flex_forward_matches_dense(case):
    segments, prefix = CASES[case]()
    q, k, v = qkv(segments, heads=2, head_dim=8, dtype=torch.float32)
    expected = dense_prefix_lm_attention(q, k, v, prefix_lm_mask(segments, prefix))
    got = prefix_lm_attention(q, k, v, build_layout("flex", segments, prefix))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# --- CPU: varlen ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_varlen_forward_and_gradients_match_dense(case):
    segments, prefix = CASES[case]()
    q, k, v = qkv(segments, heads=2, head_dim=8, dtype=torch.float64)
    grad_out = torch.randn(q.shape[0], q.shape[1], 16, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(1))
    masked = prefix_lm_mask(segments, prefix)
    layout = build_layout("varlen", segments, prefix)
    expected = attention_and_grads(lambda *t: dense_prefix_lm_attention(*t, masked), q, k, v, grad_out)
    got = attention_and_grads(lambda *t: prefix_lm_attention(*t, layout), q, k, v, grad_out)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_varlen_fp32_with_a_custom_scale():
    segments, prefix = CASES["random_a"]()
    q, k, v = qkv(segments, heads=3, head_dim=4, dtype=torch.float32)
    expected = dense_prefix_lm_attention(q, k, v, prefix_lm_mask(segments, prefix), softmax_scale=0.3)
    got = prefix_lm_attention(q, k, v, build_layout("varlen", segments, prefix), softmax_scale=0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_varlen_index_by_hand():
    # Row 0: sample (2 prefix, 2 response), 1 padding token; row 1: sample (3 prefix, 0 response),
    # sample (0 prefix, 2 response).
    segments, prefix = rows_of([[(2, 2)], [(3, 0), (0, 2)]], 5)
    index = build_varlen_index(segments, prefix)
    prefix_pass, response_pass = index.passes
    batch = 2

    def flat(row: int, pos: int) -> int:  # seq-major, like megatron's [seq, batch]
        return pos * batch + row

    assert prefix_pass.queries.tolist() == [flat(0, 0), flat(0, 1), flat(0, 4),
                                            flat(1, 0), flat(1, 1), flat(1, 2)]
    assert prefix_pass.cu_seqlens_q.tolist() == [0, 2, 3, 6]  # padding token: its own sequence
    assert not prefix_pass.causal and prefix_pass.max_seqlen_q == 3
    assert response_pass.queries.tolist() == [flat(0, 2), flat(0, 3), flat(1, 3), flat(1, 4)]
    assert response_pass.cu_seqlens_q.tolist() == [0, 2, 4]
    assert response_pass.keys.tolist() == [flat(0, p) for p in range(4)] + [flat(1, 3), flat(1, 4)]
    assert response_pass.cu_seqlens_k.tolist() == [0, 4, 6]  # the prefix-only sample has no keys here
    assert response_pass.causal and (response_pass.max_seqlen_q, response_pass.max_seqlen_k) == (2, 4)
    assert response_pass.cu_seqlens_q.dtype == torch.int32
    order = torch.cat([prefix_pass.queries, response_pass.queries])
    assert torch.equal(order[index.unpermute], torch.arange(10))


def test_reference_varlen_kernel_aligns_causal_bottom_right():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, generator=g)  # 2 queries against 3 keys: see keys <= 1 and <= 2
    k, v = torch.randn(3, 1, 4, generator=g), torch.randn(3, 1, 4, generator=g)
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    got = reference_varlen_attention(q, k, v, cu_q, cu_k, 2, 3, causal=True, softmax_scale=0.5)
    for i, visible in enumerate((2, 3)):
        weights = torch.softmax(0.5 * k[:visible, 0] @ q[i, 0], dim=0)
        torch.testing.assert_close(got[i, 0], weights @ v[:visible, 0])


def new_style_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                          scale=None, window_size=(-1, -1)):
    """Stand-in for torch >= 2.11's varlen_attn (causal = window_size (-1, 0)), on the reference."""
    assert window_size in ((-1, -1), (-1, 0)) and return_aux is None
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return reference_varlen_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                      causal=window_size == (-1, 0), softmax_scale=scale)


def old_style_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                          return_aux=None):
    """Stand-in for a varlen_attn with ``is_causal`` and no ``scale``, on the reference."""
    return reference_varlen_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                      causal=is_causal, softmax_scale=query.shape[-1] ** -0.5)


@pytest.mark.parametrize("fake", [new_style_varlen_attn, old_style_varlen_attn])
def test_torch_varlen_keywords_follow_the_signature(fake, monkeypatch):
    # torch's varlen_attn is CUDA-only; stand-ins with each signature check the translation of
    # causal and softmax_scale into its keywords.
    import torch.nn.attention.varlen
    from mimir_kernels import varlen_prefix_lm as vl

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", fake)
    vl._torch_varlen_parameters.cache_clear()
    try:
        segments, prefix = CASES["random_a"]()
        q, k, v = qkv(segments, heads=2, head_dim=4, dtype=torch.float64)
        expected = dense_prefix_lm_attention(q, k, v, prefix_lm_mask(segments, prefix), softmax_scale=0.3)
        got = varlen_prefix_lm_attention(q, k, v, build_varlen_index(segments, prefix), softmax_scale=0.3,
                                         kernel=vl.torch_varlen_attention)
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    finally:
        vl._torch_varlen_parameters.cache_clear()


# --- CPU: entry point ---------------------------------------------------------------------------


def test_backends_agree_through_the_entry_point():
    segments, prefix = CASES["random_b"]()
    q, k, v = qkv(segments, heads=2, head_dim=8, dtype=torch.float32)
    outputs = {}
    for backend in ATTENTION_BACKENDS:
        layout = build_layout(backend, segments, prefix)
        assert isinstance(layout, PrefixLMLayout) and layout.backend == backend
        assert layout.qkv_format == "sbhd"
        outputs[backend] = prefix_lm_attention(q, k, v, layout)
        assert outputs[backend].shape == (130, 2, 16)
    for backend in ("flex", "varlen"):
        torch.testing.assert_close(outputs[backend], outputs["dense"], atol=1e-5, rtol=1e-5)


def test_unknown_backend_is_refused():
    segments, prefix = CASES["random_a"]()
    with pytest.raises(ValueError, match="unknown attention backend 'sdpa'.*dense, flex, varlen"):
        build_layout("sdpa", segments, prefix)
    q, k, v = qkv(segments, heads=1, head_dim=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="available"):
        prefix_lm_attention(q, k, v, PrefixLMLayout("sdpa"))


# --- CUDA ----------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Samples average about max_len + 1 tokens: ~7 per row for "small"; "realistic" is b=2, s=4096,
# h=12, d=128 with ~10 samples per row.
GPU_SHAPES = {
    "small": {"rows": 2, "seq": 300, "heads": 4, "head_dim": 64, "max_len": 40},
    "realistic": {"rows": 2, "seq": 4096, "heads": 12, "head_dim": 128, "max_len": 400},
}


def has_torch_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def assert_bf16_close(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """bf16 kernels against the fp32 reference: max abs error under 2% of the tensor's scale."""
    scale = expected.abs().max().item()
    error = (got.float() - expected).abs().max().item()
    assert error <= 2e-2 * scale, f"{name}: max abs error {error:.3g} vs scale {scale:.3g}"


def check_against_dense_on_cuda(shape: str, attention) -> None:
    cfg = GPU_SHAPES[shape]
    segments, prefix = random_packed(cfg["rows"], cfg["seq"], seed=3, max_len=cfg["max_len"])
    segments, prefix = segments.cuda(), prefix.cuda()
    q, k, v = qkv(segments, cfg["heads"], cfg["head_dim"], torch.bfloat16, device="cuda")
    grad_out = torch.randn(q.shape[0], q.shape[1], q.shape[2] * q.shape[3], device="cuda",
                           dtype=torch.bfloat16)
    masked = prefix_lm_mask(segments, prefix)
    # Reference: fp32 dense attention on the same bf16 inputs and output gradient.
    expected = attention_and_grads(lambda *t: dense_prefix_lm_attention(*t, masked),
                                   *(t.float() for t in (q, k, v)), grad_out.float())
    got = attention_and_grads(lambda *t: attention(segments, prefix, *t), q, k, v, grad_out)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        assert g.dtype == torch.bfloat16
        assert_bf16_close(g, e, name)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_cuda_backend_matches_dense(backend, shape):
    if backend == "varlen" and not (has_torch_varlen() or has_flash_attn()):
        pytest.skip("no torch.nn.attention.varlen in this torch (needs >= 2.10) and no flash_attn")

    def attention(segments, prefix, q, k, v):
        return prefix_lm_attention(q, k, v, build_layout(backend, segments, prefix))

    check_against_dense_on_cuda(shape, attention)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel_name", ["torch", "flash_attn"])
def test_cuda_varlen_kernels_match_dense(kernel_name):
    from mimir_kernels import varlen_prefix_lm as vl

    if kernel_name == "torch" and not has_torch_varlen():
        pytest.skip("no torch.nn.attention.varlen in this torch (needs >= 2.10)")
    if kernel_name == "flash_attn" and not has_flash_attn():
        pytest.skip("flash_attn is not installed")
    kernel = {"torch": vl.torch_varlen_attention, "flash_attn": vl.flash_attn_varlen_attention}[kernel_name]

    def attention(segments, prefix, q, k, v):
        return varlen_prefix_lm_attention(q, k, v, build_varlen_index(segments, prefix), kernel=kernel)

    check_against_dense_on_cuda("small", attention)
