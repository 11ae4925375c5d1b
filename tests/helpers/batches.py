"""Packed batches and row layouts shared by the model, kernel and parallel tests."""

from __future__ import annotations

import torch

from mimir_megatron.batch import Batch, single_sample_batch


def rows_of(pieces: list[list[tuple[int, int] | int]], seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows from pieces: ``(prefix_len, response_len)`` is a sample, an int is that much padding.
    Whatever is left of a row is padding."""
    segments = torch.zeros(len(pieces), seq, dtype=torch.long)
    prefix = torch.zeros(len(pieces), seq, dtype=torch.bool)
    for row, row_pieces in enumerate(pieces):
        pos, sample = 0, 1
        for piece in row_pieces:
            if isinstance(piece, int):
                pos += piece
                continue
            p, r = piece
            segments[row, pos:pos + p + r] = sample
            prefix[row, pos:pos + p] = True
            pos, sample = pos + p + r, sample + 1
        assert pos <= seq, "pieces overflow the row"
    return segments, prefix


def random_packed(rows: int, seq: int, seed: int, max_len: int = 6,
                  end_padding: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of packed samples with random prefix and response lengths (each uniform in
    1 .. max_len), the last sample cut at the row's end; with probability ``end_padding`` a row
    stops early and ends with padding."""
    g = torch.Generator().manual_seed(seed)

    def draw(high: int) -> int:
        return int(torch.randint(1, high + 1, (), generator=g))

    pieces = []
    for _ in range(rows):
        row, pos = [], 0
        stop = seq - draw(seq // 4) if torch.rand((), generator=g) < end_padding else seq
        while pos < stop:
            p = min(draw(max_len), stop - pos)
            r = min(draw(max_len), stop - pos - p)
            row.append((p, r))
            pos += p + r
        pieces.append(row)
    return rows_of(pieces, seq)


def packed_batch(rows: int = 2, seq: int = 24, seed: int = 0) -> Batch:
    """Rows of several packed samples (1-token prefixes and responses included), some padding."""
    g = torch.Generator().manual_seed(seed)
    layouts = [[(1, 5), (4, 1), (3, 4), (2, 2)], [(6, 7), (1, 1), (3, 3)]]
    ids = torch.randint(0, 250, (rows, seq), generator=g)
    labels = torch.full((rows, seq), -100)
    segment = torch.zeros(rows, seq, dtype=torch.long)
    position = torch.zeros(rows, seq, dtype=torch.long)
    prefix = torch.zeros(rows, seq, dtype=torch.bool)
    for r in range(rows):
        pos = 0
        for n, (p, resp) in enumerate(layouts[r % len(layouts)], start=1):
            length = p + resp
            segment[r, pos:pos + length] = n
            position[r, pos:pos + length] = torch.arange(length)
            prefix[r, pos:pos + p] = True
            labels[r, pos + p - 1:pos + length] = torch.randint(0, 250, (resp + 1,), generator=g)
            pos += length
    return Batch(ids, position, segment, prefix, labels)


# vocab 100 pads to 128 at TP=1 and 256 at TP=2: the padding must not matter.
OVERRIDES = ("vocab_size=100", "seed=5")


def make_batch():
    g = torch.Generator().manual_seed(3)
    prefix = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (2, 6)]
    response = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (8, 3)]
    return single_sample_batch(prefix, response, seq_len=12)
