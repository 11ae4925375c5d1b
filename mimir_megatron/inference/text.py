"""Text around the engine: chat prompts, default stop tokens, streaming detokenisation.

Prompts are rendered and tokenized by :mod:`mimir_megatron.chat`, exactly as ``mimir prepare``
renders the prefix of a training sample.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from mimir_megatron.chat import end_of_turn_ids


def default_stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids that end an assistant turn under the tokenizer's chat template (found as
    ``mimir prepare`` finds them: :func:`mimir_megatron.chat.end_of_turn_ids`), and its eos."""
    ids = set(end_of_turn_ids(tokenizer))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def ids_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` of a list of ids, as a function. A fast tokenizer that does not clean
    up spaces decodes in its Rust backend directly: that is all transformers' ``decode`` does for
    it, after converting and type-checking the ids one by one in Python (two thirds of a call's
    time, and the engine decodes every row's text at every step)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(tokenizer, "is_fast", False) and backend is not None
    if fast and not tokenizer.clean_up_tokenization_spaces:
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


class StreamingText:
    """Decoded text of one request's tokens as they arrive, cut at the first stop string.

    Text is released only when it is final: not while the last bytes are an incomplete UTF-8
    character, and not the tail that could still become the start of a stop string.
    """

    def __init__(self, tokenizer, stop_strings: tuple[str, ...], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.skip_special_tokens = skip_special_tokens
        self._decode = ids_decoder(tokenizer, skip_special_tokens)
        self._search_from = 0
        self._hold = max((len(s) for s in stop_strings), default=1) - 1
        self.released = 0
        self.text = ""
        self.stopped = False

    def update(self, token_ids: list[int], final: bool = False, search: bool = True) -> str:
        """Feed all ids so far; returns the newly released text. Sets ``stopped`` on a stop string
        (looked for only while ``search``, in the text from where searching began)."""
        text = self._decode(token_ids)
        if not search:
            self._search_from = max(0, len(text) - self._hold)
        start = self._search_from
        found = (text.find(s, start) for s in self.stop_strings) if search else ()
        cut = min((i for i in found if i >= 0), default=-1)
        if cut >= 0:
            text, final, self.stopped = text[:cut], True, True
        self.text = text
        end = len(text)
        if not final:
            while end and text[end - 1] == "\ufffd":  # an incomplete multi-byte character
                end -= 1
            end = max(self.released, end - self._hold)
        delta = text[self.released : end]
        self.released = end
        return delta
