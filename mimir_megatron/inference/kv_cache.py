"""The recurrence-aware KV cache: one slot per (module application, layer), one row per request.

The same L layer applied at two points of the schedule sees different inputs, so it has different
keys and values: for Mimir (16 + 16 layers, ``LLLHLLLH``) a cache holds 6 x 16 L-slots and
2 x 16 H-slots, 128 in all, each ``2 x heads x head_dim`` values per token (bf16: 2 x 128 slots x
1536 x 2 bytes = 768 KiB per token).

Layout: each slot keeps keys and values as ``[rows, heads, positions, head_dim]`` (SDPA's layout),
allocated with room to spare (both dimensions double when full, so a growth copy is rare). Row
``r`` holds its own tokens at positions ``0 .. lengths[r] - 1``: a request that joins the batch
writes its prompt into a free row, a finished one leaves by having the last row copied into its
place (:meth:`KVCache.remove`), so the rows in use are always ``0 .. rows - 1`` and nothing is
copied per decoding step but the new keys and values. Attention over a row reads
``[:lengths[r] + new]``; rows of different lengths decode together under a mask built once per
step and shared by every layer (:class:`DecodeRows`).

PrefixLM makes the cache exact: the prompt (prefix) is processed in one pass with bidirectional
attention inside it; every later token attends to all cached tokens of its row, which are the
prompt and the tokens generated before it, exactly the training mask.

Two writers use it: the engine's flat step (:mod:`mimir_megatron.inference.step`) through
:meth:`KVCache.buffers` and :class:`DecodeRows`, and the model's own attention slot (megatron's
layers, the reference path) through :meth:`KVCache.application`, inside :meth:`KVCache.pass_over`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

Slot = tuple[int, int]  # (module application, layer number)


@dataclass
class DecodeRows:
    """Where one new token per row ``0 .. count - 1`` is written and what it attends to; built once
    per step (:meth:`KVCache.decode_rows`), shared by every layer of every application."""

    count: int
    key_length: int
    """Positions attended: the longest row's cached tokens plus its new one."""
    write_at: int | None
    """The position every row writes at, when all rows have the same length (no mask needed)."""
    positions: torch.Tensor
    """``[count]`` long: each row's write position (its cached length), also its token's RoPE position."""
    mask: torch.Tensor | None
    """``[count, 1, 1, key_length]`` additive (0 or -inf) when the rows' lengths differ; else None."""
    row_index: torch.Tensor | None = None
    """``[count]`` long ``0 .. count - 1`` (with ``positions`` the index of a write), when lengths differ."""


class _ApplicationCache:
    """The slots of one module application, as the core-attention slot sees them."""

    def __init__(self, cache: "KVCache", application: int) -> None:
        self._cache = cache
        self._application = application

    def append(self, layer_number: int, key: torch.Tensor, value: torch.Tensor):
        """Store ``[new, rows, heads, head_dim]`` keys/values of the pass's rows; return the
        cached keys and values ``[rows, heads, cached + new, head_dim]`` if those rows hold
        earlier tokens, else None (a fresh row: the layout's own kernel attends within the pass)."""
        return self._cache._append((self._application, layer_number), key, value)


class KVCache:
    """Keys and values of every (module application, layer) for the rows of a batch.

    ``rows`` requests are cached, in rows ``0 .. rows - 1``, row ``r`` holding ``lengths[r]``
    tokens. The engine grows it (:meth:`reserve`), writes into it (a step's new tokens), commits
    what it wrote (:meth:`commit`, :meth:`add_rows`) and drops finished rows (:meth:`remove`).
    """

    def __init__(self, device: torch.device | str = "cpu", capacity: int = 0, static: bool = False) -> None:
        self.device = torch.device(device)
        self.static = static
        """Buffers marked as static addresses for ``torch.compile`` (a CUDA graph may write into them)."""
        self.lengths: list[int] = []
        """Tokens cached per row."""
        self.capacity = capacity
        """Positions allocated up front per row (the requests' prompts + new tokens): no growth below it."""
        self._row_room = 0
        self._position_room = 0
        self._written = (0, 0)  # the rows and positions reserved since the last clear: all ever written
        self._slots: dict[Slot, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pass: tuple[int, int, int] | None = None  # (first row, rows, new): see pass_over

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def nbytes(self) -> int:
        """Bytes held by the cache buffers (allocated room, not only the filled part)."""
        return sum(t.numel() * t.element_size() for stored in self._slots.values() for t in stored)

    # -- room ---------------------------------------------------------------------------------------

    def reserve(self, rows: int, positions: int) -> None:
        """Room for ``rows`` rows of ``positions`` tokens each (buffers double when they grow).
        Every writer reserves what it writes first."""
        self._written = (max(self._written[0], rows), max(self._written[1], positions))
        grow_rows = rows > self._row_room
        grow_positions = positions > self._position_room
        if not (grow_rows or grow_positions):
            return
        old_rows, old_positions = self._row_room, self._position_room
        if grow_rows:
            self._row_room = max(rows, 2 * old_rows)
        if grow_positions:
            self._position_room = max(positions, 2 * old_positions, 16, self.capacity)
        used_rows, used = self.rows, max(self.lengths, default=0)
        for slot, stored in self._slots.items():
            grown = tuple(self._empty(t.shape[1], t.shape[3], t) for t in stored)
            for dst, src in zip(grown, stored):
                dst[:used_rows, :, :used] = src[:used_rows, :, :used]
            self._slots[slot] = grown

    def clear(self) -> None:
        """Drop every row and keep the buffers, with their room: what the rows wrote is zeroed, so
        the cache is as a new one that allocates nothing (``InferenceEngine.release_cache``)."""
        rows, positions = self._written
        for stored in self._slots.values():
            for t in stored:
                t[:rows, :, :positions].zero_()
        self.lengths = []
        self._written = (0, 0)

    @property
    def position_room(self) -> int:
        """Positions allocated per row."""
        return self._position_room

    def _empty(self, heads: int, head_dim: int, like: torch.Tensor) -> torch.Tensor:
        buffer = torch.zeros((self._row_room, heads, self._position_room, head_dim),
                             dtype=like.dtype, device=like.device)
        if self.static:
            torch._dynamo.mark_static_address(buffer)
        return buffer

    def buffers(self, slot: Slot, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[room rows, heads, room positions, head_dim]`` key and value buffers of ``slot``,
        allocated at first use like ``like`` (``[..., heads, head_dim]``)."""
        stored = self._slots.get(slot)
        if stored is None:
            heads, head_dim = like.shape[-2:]
            stored = self._slots[slot] = tuple(self._empty(heads, head_dim, like) for _ in range(2))
        return stored

    def all_buffers(self) -> dict[Slot, tuple[torch.Tensor, torch.Tensor]]:
        """Every slot's key and value buffers (a static decoding step's input)."""
        return dict(self._slots)

    # -- bookkeeping by the engine ---------------------------------------------------------------

    def decode_rows(self, count: int) -> DecodeRows:
        """The write positions and attention mask of one new token for each of rows ``0 .. count - 1``."""
        lengths = self.lengths[:count]
        key_length = max(lengths) + 1
        positions = torch.tensor(lengths, dtype=torch.long, device=self.device)
        if min(lengths) == key_length - 1:
            return DecodeRows(count, key_length, key_length - 1, positions, None)
        keys = torch.arange(key_length, device=self.device)
        mask = torch.zeros(count, 1, 1, key_length, device=self.device)
        mask.masked_fill_((keys[None, :] > positions[:, None])[:, None, None, :], float("-inf"))
        return DecodeRows(count, key_length, None, positions, mask,
                          torch.arange(count, device=self.device))

    def commit(self, counts: list[int]) -> None:
        """Rows ``0 .. len(counts) - 1`` now hold ``counts[r]`` more tokens."""
        for r, n in enumerate(counts):
            self.lengths[r] += n

    def add_rows(self, lengths: list[int]) -> None:
        """Rows appended after the last one, holding ``lengths`` tokens (written by the step that
        prefilled them)."""
        self.lengths.extend(lengths)

    def remove(self, rows: list[int]) -> list[int]:
        """Drop ``rows``; the last rows move into their places (one copy per moved row, no other).
        Returns the new row order as old row indices (``order[i]`` is now row ``i``)."""
        gone = set(rows)
        order = list(range(self.rows))
        holes = sorted(r for r in gone if r < self.rows)
        tail = [r for r in range(self.rows - 1, -1, -1) if r not in gone]
        moves = []
        for hole in holes:
            if not tail or tail[0] < hole:
                break
            src = tail.pop(0)
            moves.append((hole, src))
            order[hole] = src
        keep = self.rows - len(holes)
        if moves:
            dst = torch.tensor([d for d, _ in moves], device=self.device)
            src = torch.tensor([s for _, s in moves], device=self.device)
            used = max(self.lengths[s] for _, s in moves)
            for stored in self._slots.values():
                for t in stored:
                    t[dst, :, :used] = t[src, :, :used]
        lengths = list(self.lengths)
        self.lengths = [lengths[order[i]] for i in range(keep)]
        return order[:keep]

    # -- the model's attention slot (megatron's layers) ------------------------------------------

    def application(self, index: int) -> _ApplicationCache:
        return _ApplicationCache(self, index)

    @contextmanager
    def pass_over(self, first: int, rows: int, new: int):
        """A forward pass of the model (``model.recurrence(kv_cache=...)``) that writes ``new``
        tokens for rows ``first .. first + rows - 1``, each at its own length."""
        self._pass = (first, rows, new)
        try:
            yield
        finally:
            self._pass = None

    def _append(self, slot: Slot, key: torch.Tensor, value: torch.Tensor):
        if self._pass is None:
            raise RuntimeError("KV cache appends happen inside KVCache.pass_over")
        first, rows, new = self._pass
        lengths = self.lengths[first : first + rows] if first < self.rows else [0] * rows
        keys, values = self.buffers(slot, key)
        key, value = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)  # [rows, heads, new, d]
        if min(lengths) == max(lengths):
            at = lengths[0]
            keys[first : first + rows, :, at : at + new] = key
            values[first : first + rows, :, at : at + new] = value
        else:
            row = torch.arange(first, first + rows, device=self.device)[:, None]
            pos = torch.tensor(lengths, device=self.device)[:, None] + torch.arange(new, device=self.device)
            keys[row, :, pos] = key.transpose(1, 2)  # advanced indices first: [rows, new, heads, d]
            values[row, :, pos] = value.transpose(1, 2)
        if max(lengths) == 0:
            return None
        end = max(lengths) + new
        return keys[first : first + rows, :, :end], values[first : first + rows, :, :end]

    def pass_mask(self, first: int, rows: int, new: int) -> torch.Tensor:
        """Dense ``[rows, 1, new, cached + new]`` mask (True = masked out) for a pass of ``new``
        tokens per row (the first real, the rest padding) over rows that hold earlier tokens:
        a real token attends to its row's cached tokens and itself, a padding token to itself."""
        lengths = torch.tensor(self.lengths[first : first + rows], device=self.device)
        end = int(lengths.max()) + new
        keys = torch.arange(end, device=self.device)
        at = lengths[:, None] + torch.arange(new, device=self.device)  # [rows, new] write positions
        allowed = keys[None, None, :] == at[:, :, None]
        allowed[:, 0] |= keys[None, :] < lengths[:, None]
        return ~allowed[:, None]
