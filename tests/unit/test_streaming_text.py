"""Streaming detokenisation (inference/text.py): the decoder is the tokenizer's own ``decode``,
character for character; the text that grows token by token (``DecodeStream``) releases exactly
what decoding the whole text at every step released, stop strings and incomplete characters
included, for a byte-level BPE (the demo tokenizer) and a byte-fallback tokenizer whose decoder
strips the leading space (Llama 2's); and what the stream releases adds up to the whole text."""

from __future__ import annotations

import random

import pytest
from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR

from mimir_megatron.inference.text import StreamingText, ids_decoder


class _WholeDecodes:
    """A tokenizer seen without its Rust backend: StreamingText then decodes the whole text at
    every update (the reference the stream must equal)."""

    is_fast = False

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


def _byte_fallback_tokenizer():
    """Llama 2's kind: SentencePiece-style pieces with byte fallback, a decoder that strips the
    first leading space."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              "\u2581", "\u2581a", "\u2581the", "a", "b", "e", "th", "\u2581hej", "ø", "\u2581stop", "op"]
    backend = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER_DIR)


def _id_lists(tokenizer) -> list[list[int]]:
    """Random ids over the whole vocabulary (bytes that split characters, special tokens) and the
    ids of text with multi-byte characters and the chat template's markers."""
    rng = random.Random(0)
    size = len(tokenizer)
    lists = [[rng.randrange(size) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    lists.append(tokenizer.encode("Æblegrød, 3 × 4 = 12 — ok? 🙂"))
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hej"}], tokenize=False)
    lists.append(tokenizer.encode(chat, add_special_tokens=False))
    return lists


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_decoder_is_the_tokenizers_decode(tokenizer, skip_special_tokens):
    decode = ids_decoder(tokenizer, skip_special_tokens)
    assert decode.func == tokenizer.backend_tokenizer.decode  # the demo tokenizer: fast, no clean-up
    for ids in _id_lists(tokenizer):
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tokenizer):
    class CleansUp:
        is_fast, clean_up_tokenization_spaces = True, True
        backend_tokenizer = tokenizer.backend_tokenizer

        def decode(self, ids, skip_special_tokens=False):
            return f"transformers:{ids}:{skip_special_tokens}"

    assert ids_decoder(CleansUp(), True)([1, 2]) == "transformers:[1, 2]:True"


def test_the_released_text_adds_up_to_the_whole_text(tokenizer):
    ids = tokenizer.encode("Æblegrød og 🙂 tre gange fire er tolv.")
    stream = StreamingText(tokenizer, stop_strings=("tolv",))
    released = "".join(stream.update(ids[: i + 1]) for i in range(len(ids) - 1))
    released += stream.update(ids, final=True)
    assert stream.stopped
    assert released == tokenizer.decode(ids, skip_special_tokens=True).split("tolv")[0]


@pytest.mark.parametrize("kind", ["demo", "byte-fallback"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_stream_releases_what_whole_decodes_released(tokenizer, kind, skip_special_tokens):
    """Random ids (bytes that split characters, special tokens, stop strings made of several
    tokens), fed one token at a time as the engine feeds them; stop searching from the 3rd."""
    tok = tokenizer if kind == "demo" else _byte_fallback_tokenizer()
    stops = ("e a", "stop", "\n\n")
    rng = random.Random(1)
    size = len(tok)
    for _ in range(150):
        ids = [rng.randrange(size) for _ in range(rng.randrange(1, 50))]
        streamed = StreamingText(tok, stops, skip_special_tokens)
        whole = StreamingText(_WholeDecodes(tok), stops, skip_special_tokens)
        assert streamed._stream is not None and whole._stream is None
        for i in range(len(ids)):
            final = i == len(ids) - 1
            search = i >= 2
            got = streamed.update(ids[: i + 1], final=final, search=search)
            assert got == whole.update(ids[: i + 1], final=final, search=search), ids[: i + 1]
            assert streamed.stopped == whole.stopped
            if whole.stopped:
                break
        assert streamed.text == whole.text
