"""Streaming detokenisation (inference/text.py): the decoder every row's text goes through at every
step is the tokenizer's own ``decode``, character for character, and what the stream releases adds
up to the whole decoded text."""

from __future__ import annotations

import random

import pytest
from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR

from mimir_megatron.inference.text import StreamingText, ids_decoder


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
