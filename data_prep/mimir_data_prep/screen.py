"""The screen stage of `mimir prepare`: what a document may not hold.

- :func:`screen_text`, before rendering: control characters (``--control-chars``) and personal
  data (``--personal-data``, :mod:`mimir_data_prep.personal_data`);
- :func:`screen_tokens`, after tokenizing: benchmark text of a ``--denylist`` (token sequences,
  and folded words of the document as the tokens decode, so it needs the tokens).

Each raises :class:`~mimir_data_prep.records.RecordError` with the reject reason, or returns the
document to keep (stripped or redacted when the policy says so).
"""

from __future__ import annotations

import re

from mimir_megatron.errors import UserError

from .personal_data import screen_personal_data
from .records import Conversation, RecordError, clean_control_chars, holds_control_bytes
from .settings import PrepareSettings

_denylists: dict[tuple[str, str], object] = {}  # per process: read once, used by every shard


# What a JSON line must hold for a string decoded from it to hold a control character: the
# character itself (C1 ones in UTF-8) or an escape of one (\u00XX, \b, \f; at any depth of JSON
# in JSON strings, as the escape's own backslash is written last). Cheap searches, not one regex
# of three alternatives: that one tried each at every byte (~10 us a line of 1 KiB).
_CONTROL_ESCAPE = re.compile(rb"\\(?:u00|b|f)")


def may_hold_control(raw: bytes) -> bool:
    """Whether a string decoded from the JSON line ``raw`` can hold a control character (False:
    none can, the line need not be searched)."""
    return holds_control_bytes(raw) or _CONTROL_ESCAPE.search(raw) is not None


def screen_text(conv: Conversation, settings: PrepareSettings, found: dict[str, int],
                raw: bytes | None = None) -> tuple[Conversation, bool]:
    """(the conversation to render, whether control characters were stripped from it); the
    personal data found is added to ``found`` (kind -> count). ``raw``: the JSON line the
    conversation was decoded from; one that cannot hold a control character is not searched."""
    if raw is not None and not may_hold_control(raw):
        stripped = 0
    else:
        conv, stripped = clean_control_chars(conv, settings.control_chars)
    conv = screen_personal_data(conv, settings.personal_data, found)
    return conv, stripped > 0


def screen_tokens(ids: list[int], denylist, settings: PrepareSettings, text=None) -> None:
    """Reject (``benchmark_overlap``) a document whose tokens, or the folded words of its text
    (``text()``, asked for only when the denylist has word entries), hold a denylisted sequence."""
    if denylist is not None and (hit := denylist.first_hit(ids, text)) is not None:
        raise RecordError("benchmark_overlap", hit.describe(settings.denylist))


def load_denylist(settings: PrepareSettings):
    """The settings' denylist (read once per process), or None."""
    if not settings.denylist:
        return None
    key = (settings.denylist, settings.denylist_sha256)
    if key not in _denylists:
        from mimir_megatron.audits.denylist import Denylist

        denylist = Denylist(settings.denylist, settings.tokenizer_sha256)
        if denylist.sha256 != settings.denylist_sha256:
            raise UserError(f"{settings.denylist}: changed while `mimir prepare` was running")
        _denylists[key] = denylist
    return _denylists[key]
