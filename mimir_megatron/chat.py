"""The chat template: the one place that turns conversations into token ids.

Training data (``mimir prepare``), inference (prompts, stop ids) and evaluation all render through
here, so a model is prompted exactly as it was trained. The tokenizer is a Hugging Face fast
tokenizer that has a chat template.

A training sample is (prefix ids, response ids). The prefix is the template rendered for all but
the final assistant turn with the generation prompt appended (the same text a prompt at inference
is); the response is what the full rendering adds after it (the final assistant turn and its
end-of-turn token), cut right after the end-of-turn token: templates that write a newline after it
(Gemma's ``<end_of_turn>\\n``) would otherwise train the model to emit that newline and leave
generation nothing to stop on. Prefix and response are tokenized separately so that no BPE merge
crosses the boundary the loss mask depends on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mimir_megatron.errors import UserError


class ChatTemplateError(ValueError):
    """The template cannot render a conversation, or its renderings do not line up."""


def load_tokenizer(tokenizer_dir: str | Path):
    """A Hugging Face fast tokenizer that has a chat template; UserError otherwise."""
    path = Path(tokenizer_dir)
    if not (path / "tokenizer.json").is_file():
        raise UserError(f"{path}: not a tokenizer directory (tokenizer.json is missing)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError(
            "rendering chat templates needs transformers: pip install 'mimir-megatron[hf]'"
        ) from None
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{path}: the tokenizer has no chat_template")
    return tokenizer


def tokenizer_sha256(tokenizer_dir: str | Path) -> str:
    """sha256 over the names and bytes of every file in the tokenizer directory: what prepared
    manifests, audit indices and denylists record to tell tokenizers apart."""
    from mimir_megatron.integrity import directory_sha256

    if not Path(tokenizer_dir).is_dir():
        raise UserError(f"tokenizer directory not found: {tokenizer_dir}")
    return directory_sha256(tokenizer_dir, recursive=False, end_each_file=True)


_PROBE = "\u2063mimir-end-of-turn-probe\u2063"  # text no template rewrites or contains


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """Token ids that end an assistant turn under the tokenizer's chat template.

    Found by rendering a probe conversation: the special tokens the template writes after the
    assistant's content (Gemma ``<end_of_turn>``, ChatML ``<|im_end|>``, Llama 3 ``<|eot_id|>``).
    Falls back to ``[eos_token_id]`` when the template writes none (or cannot render the probe);
    ``[]`` when there is no eos either. Generation should stop on any of these ids.
    """
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= {i for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items() if t.special}
    found: list[int] = []
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "ping"}, {"role": "assistant", "content": _PROBE}],
            tokenize=False,
        )
    except Exception:  # a template that needs more than user/assistant: fall back to eos
        text = ""
    if _PROBE in text:
        tail = text[text.rindex(_PROBE) + len(_PROBE) :]
        ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
        found = list(dict.fromkeys(i for i in ids if i in special))
    eos = getattr(tokenizer, "eos_token_id", None)
    return found or ([eos] if eos is not None else [])


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with no special tokens added (special tokens come from the text);
    the Rust tokenizer directly, without Hugging Face's per-call overhead."""
    return encoding(tokenizer, text).ids


def encoding(tokenizer: Any, text: str):
    """The ``tokenizers.Encoding`` behind :func:`encode` (ids and each token's character offsets)."""
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)


def prompt_text(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The template rendered for ``messages`` with the generation prompt appended;
    ``template_kwargs`` are further variables the template reads (``enable_thinking``, ...)."""
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                         **(template_kwargs or {}))


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt ids of a conversation: the template up to and including the generation prompt,
    tokenized on its own, as the prefix of a training sample is."""
    return encode(tokenizer, prompt_text(tokenizer, messages, tools, template_kwargs))


class ChatRenderer:
    """Renders and tokenizes training conversations with one tokenizer's chat template."""

    def __init__(self, tokenizer_dir: str | Path) -> None:
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.end_of_turn_ids = end_of_turn_ids(self.tokenizer)
        self._end_tokens = [self.tokenizer.convert_ids_to_tokens(i) for i in self.end_of_turn_ids]

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> tuple[str, str]:
        """(prefix text, response text) of a conversation that ends with the assistant turn
        trained on; ChatTemplateError when the template fails or the two do not line up."""
        try:
            full = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=False
            )
            prefix = prompt_text(self.tokenizer, messages[:-1], tools)
        except Exception as exc:  # jinja raises whatever the template author chose
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None
        if not full.startswith(prefix):
            raise ChatTemplateError(
                "the rendered conversation does not start with the rendered prefix and generation prompt"
            )
        return prefix, self._cut_after_end_of_turn(full[len(prefix) :])

    def _cut_after_end_of_turn(self, response: str) -> str:
        """The response up to and including its last end-of-turn token (unchanged if none)."""
        ends = [response.rfind(t) + len(t) for t in self._end_tokens if t and t in response]
        return response[: max(ends)] if ends else response

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens come from the template text, none are added."""
        return encode(self.tokenizer, text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` of each text, in one call to the Rust tokenizer (the same ids).
        ``encode_batch_fast`` (where the installed tokenizers has it) skips the character
        offsets, which nothing here reads: ~30 % less tokenizer time on `bench_data.py
        --against-tokenizer`."""
        backend = self.tokenizer.backend_tokenizer
        encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def tokenize(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None
    ) -> tuple[list[int], list[int]]:
        """(prefix ids, response ids), each tokenized on its own."""
        prefix, response = self.render(messages, tools)
        return self.encode(prefix), self.encode(response)
