"""The PrefixLM mask against the rule written out as a loop, and the dense kernel against a loop."""

import torch
from mimir_kernels import dense_prefix_lm_attention, prefix_lm_mask


def random_packed(rows: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of packed samples (random prefix/response lengths) followed by padding."""
    g = torch.Generator().manual_seed(seed)
    segments = torch.zeros(rows, seq, dtype=torch.long)
    prefix = torch.zeros(rows, seq, dtype=torch.bool)
    for r in range(rows):
        pos, sample = 0, 1
        while pos < seq - 2:
            p = int(torch.randint(1, 5, (), generator=g))
            n = min(p + int(torch.randint(1, 5, (), generator=g)), seq - pos)
            segments[r, pos:pos + n] = sample
            prefix[r, pos:pos + min(p, n)] = True
            pos, sample = pos + n, sample + 1
            if torch.rand((), generator=g) < 0.2:
                break  # leave padding at the end
    return segments, prefix


def rule(segments, prefix, r, q, k) -> bool:
    same = segments[r, q] == segments[r, k] != 0
    return bool(same and (k <= q or (prefix[r, q] and prefix[r, k])))


def test_mask_follows_the_rule():
    for seed in range(5):
        segments, prefix = random_packed(3, 17, seed)
        masked = prefix_lm_mask(segments, prefix)
        assert masked.shape == (3, 1, 17, 17) and masked.dtype == torch.bool
        for r in range(3):
            for q in range(17):
                for k in range(17):
                    allowed = rule(segments, prefix, r, q, k)
                    if segments[r, q] == 0:  # padding attends to itself only
                        allowed = q == k
                    assert masked[r, 0, q, k] == (not allowed), (seed, r, q, k)


def test_hand_example():
    # one sample: prefix of 2, response of 2, then one padding token
    segments = torch.tensor([[1, 1, 1, 1, 0]])
    prefix = torch.tensor([[True, True, False, False, False]])
    allowed = ~prefix_lm_mask(segments, prefix)[0, 0]
    expected = torch.tensor([
        [1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def test_dense_attention_matches_a_loop():
    torch.manual_seed(0)
    segments, prefix = random_packed(2, 12, 3)
    q, k, v = (torch.randn(12, 2, 3, 8, dtype=torch.float64) for _ in range(3))
    out = dense_prefix_lm_attention(q, k, v, prefix_lm_mask(segments, prefix))
    assert out.shape == (12, 2, 24)
    for r in range(2):
        for i in range(12):
            keys = [j for j in range(12) if rule(segments, prefix, r, i, j)] or [i]
            scores = torch.einsum("hd,jhd->hj", q[i, r], k[keys, r]) / 8 ** 0.5
            expected = torch.einsum("hj,jhd->hd", scores.softmax(-1), v[keys, r]).reshape(-1)
            torch.testing.assert_close(out[i, r], expected, rtol=1e-10, atol=1e-10)
