"""Text around the engine: chat prompts, default stop tokens, streaming detokenisation.

Prompts are rendered and tokenized by :mod:`mimir_megatron.chat`, exactly as ``mimir prepare``
renders the prefix of a training sample.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from tokenizers.decoders import DecodeStream

from mimir_megatron.chat import end_of_turn_ids


def default_stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids that end an assistant turn under the tokenizer's chat template (found as
    ``mimir prepare`` finds them: :func:`mimir_megatron.chat.end_of_turn_ids`), and its eos."""
    ids = set(end_of_turn_ids(tokenizer))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _rust_backend(tokenizer):
    """The fast tokenizer's ``tokenizers.Tokenizer`` where transformers' ``decode`` is nothing but
    its ``decode`` (no clean-up of spaces), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(tokenizer, "is_fast", False) and backend is not None
    return backend if fast and not tokenizer.clean_up_tokenization_spaces else None


def ids_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` of a list of ids, as a function. A fast tokenizer that does not clean
    up spaces decodes in its Rust backend directly: that is all transformers' ``decode`` does for
    it, after converting and type-checking the ids one by one in Python (two thirds of a call's
    time)."""
    backend = _rust_backend(tokenizer)
    if backend is not None:
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


class StreamingText:
    """Decoded text of one request's tokens as they arrive, cut at the first stop string.

    Text is released only when it is final: not while the last bytes are an incomplete UTF-8
    character, and not the tail that could still become the start of a stop string.

    A fast tokenizer's text grows token by token (``tokenizers``' ``DecodeStream``, which keeps an
    incomplete character's bytes until they complete): a step costs the same at the 10th token
    and the 2,000th, where decoding the whole text at every step grew with it. The last update
    decodes the whole text once, which is what the result carries (an incomplete character at the
    very end included, as U+FFFD).
    """

    def __init__(self, tokenizer, stop_strings: tuple[str, ...], skip_special_tokens: bool = True) -> None:
        self.stop_strings = stop_strings
        self._decode = ids_decoder(tokenizer, skip_special_tokens)
        self._backend = _rust_backend(tokenizer)
        self._stream = None
        if self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._fed = 0  # ids given to the stream
        self._streamed = ""
        self._search_from = 0
        self._hold = max((len(s) for s in stop_strings), default=1) - 1
        self.released = 0
        self.text = ""
        self.stopped = False

    def update(self, token_ids: list[int], final: bool = False, search: bool = True) -> str:
        """Feed all ids so far; returns the newly released text. Sets ``stopped`` on a stop string
        (looked for only while ``search``, in the text from where searching began)."""
        text = self._text(token_ids, final)
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

    def _text(self, token_ids: list[int], final: bool) -> str:
        """The text of ``token_ids``: the stream's (without the bytes of an incomplete last
        character) while the request runs, one whole decode at its end or without a stream."""
        if self._stream is None or final or len(token_ids) < self._fed:
            return self._decode(token_ids)
        try:
            for token in token_ids[self._fed :]:
                chunk = self._stream.step(self._backend, token)
                if chunk:
                    self._streamed += chunk
        except Exception:  # noqa: BLE001 - tokenizers' own error, e.g. bytes that never form a character
            # The stream gives up where a new token changes text it already gave out (a
            # byte-fallback decoder after invalid bytes); whole decodes take over for this text.
            self._stream = None
            return self._decode(token_ids)
        self._fed = len(token_ids)
        return self._streamed
