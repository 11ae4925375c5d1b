"""The recurrence-aware KV cache: one slot per (module application, layer).

The same L layer applied at two points of the schedule sees different inputs, so it has different
keys and values: for Mimir (16 + 16 layers, ``LLLHLLLH``) a cache holds 6 x 16 L-slots and
2 x 16 H-slots, 128 in all, each ``2 x heads x head_dim`` values per token (bf16: 2 x 128 slots x
1536 x 2 bytes = 768 KiB per token).

Layout: each slot keeps keys and values as ``[batch, heads_local, capacity, head_dim]`` (SDPA's
layout) and all rows share one write position. A row's cached tokens are marked valid in
``valid [batch, capacity]``; slots of left padding, and the gap left when a row joins a running
batch, are invalid and masked out of attention. RoPE positions are per row and independent of the
slot a token is stored in, so rows of different lengths decode together.

PrefixLM makes the cache exact: the prompt (prefix) is processed in one pass with bidirectional
attention inside it; every later token attends to all cached tokens of its row, which are the
prompt and the tokens generated before it, exactly the training mask.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class _ApplicationCache:
    """The slots of one module application, as the core-attention slot sees them."""

    def __init__(self, cache: "KVCache", application: int) -> None:
        self._cache = cache
        self._application = application

    def append(self, layer_number: int, key: torch.Tensor, value: torch.Tensor):
        """Store ``[new, batch, heads, head_dim]`` keys/values; return the cached keys and values
        ``[batch, heads, cached, head_dim]`` (new included) if earlier tokens are cached, else None."""
        return self._cache._append((self._application, layer_number), key, value)


class KVCache:
    """Keys and values of every (module application, layer) for a batch of decoding rows.

    A forward pass over ``new`` tokens per row appends at the shared write position; call
    :meth:`advance` after it (the engine does). Rows leave with :meth:`select_rows` and join with
    :meth:`merge`.
    """

    def __init__(self, batch: int, device: torch.device | str, capacity: int = 0) -> None:
        self.batch = batch
        self.device = torch.device(device)
        self.length = 0
        self.capacity = capacity
        """Positions allocated up front (the requests' prompts + new tokens): no regrowth below it."""
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=self.device)
        self._slots: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._write_at: torch.Tensor | None = None  # set during a static-shape decoding step

    # -- what the model sees ----------------------------------------------------------------------

    def application(self, index: int) -> _ApplicationCache:
        return _ApplicationCache(self, index)

    def _append(self, slot: tuple[int, int], key: torch.Tensor, value: torch.Tensor):
        new = key.shape[0]
        key = key.permute(1, 2, 0, 3)  # [b, h, new, d]
        value = value.permute(1, 2, 0, 3)
        if self._write_at is not None:  # static shapes (see static_step): whole buffers, tensor index
            keys, values = self._slots[slot]
            keys.index_copy_(2, self._write_at, key)
            values.index_copy_(2, self._write_at, value)
            return keys, values
        stored = self._slots.get(slot)
        end = self.length + new
        if stored is None or stored[0].shape[2] < end:
            stored = self._grow(stored, key, end)
            self._slots[slot] = stored
        keys, values = stored
        keys[:, :, self.length : end] = key
        values[:, :, self.length : end] = value
        if self.length == 0:
            return None  # prefill: the layout's own kernel attends within the new tokens
        return keys[:, :, :end], values[:, :, :end]

    def _grow(self, stored, like: torch.Tensor, needed: int):
        """A larger buffer (capacity doubles) holding what was stored so far."""
        old = 0 if stored is None else stored[0].shape[2]
        capacity = max(needed, 2 * old, 16, self.capacity)
        shape = (like.shape[0], like.shape[1], capacity, like.shape[3])
        grown = tuple(torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(2))
        if stored is not None:
            for dst, src in zip(grown, stored):
                dst[:, :, : self.length] = src[:, :, : self.length]
        return grown

    # -- bookkeeping by the engine ---------------------------------------------------------------

    def attention_mask(self, new_valid: torch.Tensor) -> torch.Tensor:
        """Dense ``[batch, 1, new, cached + new]`` mask (True = masked out) for ``new`` tokens that
        attend to every valid cached token and causally among themselves; ``new_valid [b, new]``."""
        new = new_valid.shape[1]
        causal = torch.ones(new, new, dtype=torch.bool, device=self.device).tril()
        allowed = torch.cat(
            [self.valid[:, None, :].expand(-1, new, -1), causal[None] & new_valid[:, None, :]], dim=2
        )
        # A padding query still needs one key (itself), or its softmax row would be NaN.
        allowed[:, :, self.length :] |= torch.eye(new, dtype=torch.bool, device=self.device)[None]
        return ~allowed[:, None]

    def can_step_static(self) -> bool:
        """Whether every slot has room for one more token (a static-shape step needs no growth)."""
        return bool(self._slots) and all(k.shape[2] > self.length for k, _ in self._slots.values())

    @contextmanager
    def static_step(self):
        """One decoding step of one token per row with shapes that do not change from step to step
        (for ``torch.compile``): every slot writes at a tensor index and hands attention its whole
        buffer, ``[batch, heads, allocated, head_dim]``; :meth:`static_attention_mask` masks what is
        not written. Needs :meth:`can_step_static`."""
        self._write_at = torch.tensor([self.length], device=self.device)
        try:
            yield
        finally:
            self._write_at = None

    def static_attention_mask(self) -> torch.Tensor:
        """``[batch, 1, 1, allocated]`` (True = masked out) for one new token per row in a
        :meth:`static_step`: the valid cached tokens and the new one itself."""
        allocated = next(iter(self._slots.values()))[0].shape[2]
        allowed = torch.zeros(self.batch, allocated, dtype=torch.bool, device=self.device)
        allowed[:, : self.length] = self.valid
        allowed[:, self.length] = True
        return ~allowed[:, None, None, :]

    def advance(self, new_valid: torch.Tensor) -> None:
        """Commit the ``new_valid [batch, new]`` tokens of the forward pass that just ran."""
        self.valid = torch.cat([self.valid, new_valid.to(self.device)], dim=1)
        self.length += new_valid.shape[1]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices, in this order)."""
        rows = rows.to(self.device)
        self._slots = {
            slot: (k.index_select(0, rows), v.index_select(0, rows)) for slot, (k, v) in self._slots.items()
        }
        self.valid = self.valid.index_select(0, rows)
        self.batch = len(rows)
        self._compact()

    def merge(self, other: "KVCache") -> None:
        """Append ``other``'s rows (a prefill of joining requests) to this batch.

        The shorter cache is left-padded with invalid slots so that both end at one write
        position; the slots of both must be the same (same schedule and model).
        """
        if self.batch == 0:
            self.__dict__.update(other.__dict__)
            return
        if set(self._slots) != set(other._slots):
            raise ValueError("cannot merge KV caches of different schedules")
        length = max(self.length, other.length)
        mine, theirs = self._left_padded(length), other._left_padded(length)
        self._slots = {
            slot: tuple(torch.cat([a, b], dim=0) for a, b in zip(mine[slot], theirs[slot]))
            for slot in self._slots
        }
        self.valid = torch.cat([self._valid_padded(length), other._valid_padded(length)], dim=0)
        self.batch += other.batch
        self.length = length
        self.capacity = max(self.capacity, other.capacity)

    def _left_padded(self, length: int) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        pad = length - self.length
        out = {}
        for slot, stored in self._slots.items():
            kept = [t[:, :, : self.length] for t in stored]
            if pad:
                kept = [torch.nn.functional.pad(t, (0, 0, pad, 0)) for t in kept]
            out[slot] = tuple(kept)
        return out

    def _valid_padded(self, length: int) -> torch.Tensor:
        return torch.nn.functional.pad(self.valid, (length - self.length, 0), value=False)

    def _compact(self) -> None:
        """Drop leading positions that no remaining row uses (after rows have left)."""
        if self.batch == 0:
            self._slots, self.length = {}, 0
            self.valid = self.valid[:, :0]
            return
        used = self.valid.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.length
        if start == 0:
            return
        self._slots = {
            slot: tuple(t[:, :, start : self.length].contiguous() for t in stored)
            for slot, stored in self._slots.items()
        }
        self.valid = self.valid[:, start:]
        self.length -= start

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def nbytes(self) -> int:
        """Bytes held by the cache buffers (capacity, not only the filled part)."""
        return sum(t.numel() * t.element_size() for stored in self._slots.values() for t in stored)
