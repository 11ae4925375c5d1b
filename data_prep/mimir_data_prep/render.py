"""The render stage of `mimir prepare`: a screened conversation through the tokenizer's chat
template into (prefix ids, response ids) (:class:`mimir_megatron.chat.ChatRenderer`), checked
against the response minimum and fitted to the context (``--too-long``)."""

from __future__ import annotations

from mimir_megatron.chat import ChatRenderer, ChatTemplateError

from .records import Conversation, RecordError
from .settings import PrepareSettings


def render_texts(conv: Conversation, renderer: ChatRenderer) -> tuple[str, str]:
    """(prefix text, response text); a ``template_error`` RecordError when the template fails."""
    try:
        return renderer.render(conv.messages, conv.tools)
    except ChatTemplateError as exc:
        raise RecordError("template_error", str(exc)) from None


def fit_document(prefix: list[int], response: list[int], settings: PrepareSettings) -> tuple[list[int], bool]:
    """(prefix to keep, truncated?) of a tokenized document; RecordError when its response is
    too short or it does not fit the context under the too-long policy."""
    if len(response) < settings.min_response_tokens:
        raise RecordError(
            "response_too_short",
            f"{len(response)} response tokens, need >= {settings.min_response_tokens}",
        )
    return fit_to_context(prefix, response, settings)


def fit_to_context(
    prefix: list[int], response: list[int], settings: PrepareSettings
) -> tuple[list[int], bool]:
    """Apply the too-long policy. Packed input length is len(prefix) + len(response) - 1."""
    if len(prefix) + len(response) - 1 <= settings.seq_len:
        return prefix, False
    keep = settings.seq_len + 1 - len(response)
    if settings.too_long == "truncate-prefix" and keep >= 1:
        # Keep the end of the prefix: it holds the generation prompt the response follows.
        return prefix[-keep:], True
    raise RecordError(
        "too_long",
        f"{len(prefix)} prefix + {len(response)} response tokens exceed seq_len={settings.seq_len}",
    )
