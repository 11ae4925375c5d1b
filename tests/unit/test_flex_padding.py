"""FlexAttention's look-up tables cover the whole last block, checked on CPU.

The compiled GPU kernel evaluates ``mask_mod`` on every position of a block, including the
positions past ``seq`` of the last one; an unpadded table is read out of range there, which
only a GPU run would show. Here ``mask_mod`` is evaluated on the grid rounded up to whole blocks.
"""

import pytest
import torch
from mimir_kernels import prefix_lm_mask
from mimir_kernels.flex_prefix_lm import BLOCK_SIZE, prefix_lm_mask_mod
from batches import random_packed
from torch.nn.attention.flex_attention import create_mask


@pytest.mark.parametrize("seq,block", [(53, 16), (130, BLOCK_SIZE), (200, BLOCK_SIZE), (64, 16)])
def test_mask_mod_is_defined_on_whole_blocks(seq, block):
    segments, prefix = random_packed(2, seq, seed=seq)
    padded = -(-seq // block) * block
    allowed = create_mask(prefix_lm_mask_mod(segments, prefix, block), 2, 1, padded, padded, device="cpu")
    assert allowed.shape == (2, 1, padded, padded)
    allowed = allowed[:, 0]
    torch.testing.assert_close(allowed[:, :seq, :seq], ~prefix_lm_mask(segments, prefix)[:, 0])
    assert not allowed[:, :seq, seq:].any()  # no real query sees a position past the row
    tail = allowed[:, seq:, :]
    eye = torch.eye(padded, dtype=torch.bool)[seq:].expand_as(tail)
    assert torch.equal(tail, eye)  # a position past the row sees only itself (no empty softmax)
