"""The FLOP count behind TFLOP/s and MFU: the paper's per-token numbers and the attended keys."""

import pytest
import torch
from conftest import MIMIR

from mimir_megatron.config import load_config
from mimir_megatron.train.flops import attended_keys_per_token, flops_per_token


@pytest.mark.parametrize("k_L,k_H,gflops", [(3, 2, 20.1), (6, 2, 26.0)])
def test_matmul_flops_per_token_are_the_papers(k_L, k_H, gflops):
    """HRM-Text paper: 20.1 GFLOP/token at k=5 (HLLLH) and 26.0 at k=8, matmuls only."""
    cfg = load_config(MIMIR)
    assert flops_per_token(cfg, k_L, k_H, 4096, include_attention=False) / 1e9 == pytest.approx(gflops, abs=0.05)


def test_attention_flops_follow_the_attended_keys():
    cfg = load_config(MIMIR)
    base = flops_per_token(cfg, 3, 2, 4096, include_attention=False)
    # forward: 8 applications x 16 layers; backward (x2): 5 applications x 16 layers
    per_key = 2 * 2 * cfg.hidden_size * 16 * (8 + 2 * 5)
    assert flops_per_token(cfg, 3, 2, 4096, attended_keys=100.0) - base == pytest.approx(100 * per_key)
    assert flops_per_token(cfg, 3, 2, 4096) - base == pytest.approx(2048 * per_key)


def test_attended_keys_by_hand():
    # row 0: sample 1 = prefix 2 + response 2, sample 2 = prefix 1 + response 1, 2 padding
    # row 1: one sample, prefix 3 + response 5
    segments = torch.tensor([[1, 1, 1, 1, 2, 2, 0, 0], [1] * 8])
    prefix = torch.tensor([[1, 1, 0, 0, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    row0 = [2, 2, 3, 4, 1, 2, 1, 1]  # prefix sees its prefix; response i sees i + 1; padding itself
    row1 = [3, 3, 3, 4, 5, 6, 7, 8]
    expected = sum(row0 + row1) / 16
    assert attended_keys_per_token(segments, prefix).item() == pytest.approx(expected)


def test_attended_keys_count_the_mask():
    """Against the PrefixLM mask itself on a random packed batch."""
    from mimir_kernels import prefix_lm_mask

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 9, (40,), generator=g)
    segments = torch.repeat_interleave(torch.arange(1, 41), lengths)[:128]
    segments = torch.cat([segments, torch.zeros(128 - len(segments), dtype=torch.long)])[None]
    prefix = torch.zeros(1, 128, dtype=torch.bool)  # each sample's first half is its prefix
    for s in range(1, 41):
        where = (segments[0] == s).nonzero().flatten()
        prefix[0, where[: max(1, len(where) // 2)]] = True
    allowed = ~prefix_lm_mask(segments, prefix)
    assert attended_keys_per_token(segments, prefix).item() == pytest.approx(allowed.sum().item() / 128)
