"""Personal data in training documents: found with maintained validators, then rejected, redacted
or reported (`mimir prepare --personal-data`).

The paper excludes data containing personal information (§7). Each string of a conversation
(message contents, tool calls, tools) is scanned for:

- ``email``: an address (local part, ``@``, a domain with a dot and a letter TLD);
- ``phone``: a number that libphonenumber (``phonenumbers``) finds and validates for one of
  :data:`PHONE_REGIONS`, written with ``+`` or with separators between digit groups (a bare run of
  digits, as arithmetic writes them, is not taken for a phone number);
- ``iban``: an IBAN whose country format and check digits ``schwifty`` validates;
- ``payment_card``: 13-19 digits (spaces or dashes allowed) with a card prefix and a valid Luhn
  check digit (``stdnum.luhn``);
- ``national_id``: Danish CPR (``stdnum.dk.cpr``: a valid birth date; written DDMMYY-XXXX, or
  without the dash only when the modulus-11 check holds), Swedish personnummer, Norwegian
  fødselsnummer and US SSN (their ``stdnum`` validators);
- ``ip_address``: an IPv4 or IPv6 address (``ipaddress``), an indirect identifier.

Direct identifiers are every kind but ``ip_address``. Policies: ``reject`` (the default) drops a
document holding a direct identifier (reason ``personal_data``; indirect ones are counted);
``redact`` replaces each found span with ``[KIND]``; ``report`` only counts. Names and postal
addresses need an NLP detector and are not looked for. Precision and recall on a labelled sample:
``bench/bench_personal_data.py``; no screen is complete.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import replace
from typing import Any, Iterator

POLICIES = ("reject", "redact", "report")
KINDS = ("email", "phone", "iban", "payment_card", "national_id", "ip_address")
DIRECT = frozenset(KINDS) - {"ip_address"}
PHONE_REGIONS = ("DK", "SE", "NO", "DE", "GB", "US")

_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b")
_CARD = re.compile(r"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d-])")
_NATIONAL = re.compile(r"(?<![\d-])(?:\d{6}[-+]?\d{4}|\d{8}[-+]?\d{4}|\d{11}|\d{3}-\d{2}-\d{4})(?![\d-])")
_IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")
_PHONE_CANDIDATE = re.compile(r"\+?\(?\d[\d\s().-]{5,}\d")
_PHONE_LIKE = re.compile(r"\+.*|.*\d[\s().-]+\d.*", re.S)
_DIGIT = re.compile(r"\d")  # what IBANs, cards, national ids, IPv4 addresses and phone numbers need
_IPV6 = re.compile(r"(?<![\w:])[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}(?![\w:])")


def find(text: str) -> list[tuple[str, int, int]]:
    """The personal data in ``text``: (kind, start, end) spans, earliest first, not overlapping."""
    found: list[tuple[str, int, int]] = []
    # Each pattern needs what these look for: most text skips most patterns (the screen is a
    # large share of `mimir prepare`'s time). The order of the kinds is kept (it breaks ties).
    digits, colons = _has_digit(text), text.count(":") >= 2
    if not (digits or colons or "@" in text):
        return found  # (what _may_hold tests)
    if "@" in text:
        found += [("email", m.start(), m.end()) for m in _EMAIL.finditer(text)]
    if digits:
        found += [("iban", m.start(), m.end()) for m in _IBAN.finditer(text) if _valid_iban(m.group())]
        found += [("payment_card", m.start(), m.end()) for m in _CARD.finditer(text)
                  if _valid_card(m.group())]
        found += [("national_id", m.start(), m.end()) for m in _NATIONAL.finditer(text)
                  if _valid_national_id(m.group())]
        found += [("ip_address", m.start(), m.end()) for m in _IPV4.finditer(text) if _valid_ip(m.group())]
    if colons:
        found += [("ip_address", m.start(), m.end()) for m in _IPV6.finditer(text)
                  if m.group().count(":") >= 2 and _valid_ip(m.group())]
    if digits:
        found += list(_phones(text))
    spans: list[tuple[str, int, int]] = []
    for kind, start, end in sorted(found, key=lambda s: (s[1], -(s[2] - s[1]))):
        if spans and start < spans[-1][2]:
            continue  # inside a longer span found first (an IBAN's digits are no phone number)
        spans.append((kind, start, end))
    return spans


_ASCII_DIGITS = b"0123456789"


def _may_hold(text: str) -> bool:
    """Whether :func:`find` can find anything in ``text`` (False: it finds nothing). Of several
    strings joined, False for each of them."""
    return "@" in text or text.count(":") >= 2 or _has_digit(text)


def _has_digit(text: str) -> bool:
    """Whether ``text`` holds a decimal digit (what ``\\d`` matches): where every character is
    Latin-1, whose only decimal digits are 0-9, a deletion from its bytes (a copy and a table
    lookup per byte, ~4x faster than the regex); the regex for any other text."""
    try:
        raw = text.encode("latin-1")
    except UnicodeEncodeError:
        return _DIGIT.search(text) is not None
    return len(raw.translate(None, _ASCII_DIGITS)) != len(raw)


def _phones(text: str) -> Iterator[tuple[str, int, int]]:
    import phonenumbers

    if not any(_PHONE_LIKE.fullmatch(m.group()) and len(re.sub(r"\D", "", m.group())) >= 7
               for m in _PHONE_CANDIDATE.finditer(text)):
        return  # nothing libphonenumber could take for a written phone number (the common case)
    seen: set[tuple[int, int]] = set()
    for region in PHONE_REGIONS:
        for match in phonenumbers.PhoneNumberMatcher(text, region, leniency=phonenumbers.Leniency.VALID):
            raw = match.raw_string
            if not (raw.lstrip().startswith("+") or re.search(r"\d[\s().-]+\d", raw)):
                continue  # a bare run of digits
            if _is_date(raw):
                continue  # 24.11.2015 is eight digits in pairs, as Danish numbers are written
            if (match.start, match.end) not in seen:
                seen.add((match.start, match.end))
                yield "phone", match.start, match.end


def _is_date(text: str) -> bool:
    import datetime

    m = re.fullmatch(r"(\d{1,2})[./-](\d{1,2})[./-](\d{2}|\d{4})|(\d{4})-(\d{2})-(\d{2})", text.strip())
    if not m:
        return False
    day, month, year = (m.group(1), m.group(2), m.group(3)) if m.group(1) else \
        (m.group(6), m.group(5), m.group(4))
    for d, mo in ((day, month), (month, day)):  # European or US order
        try:
            datetime.date(2000 + int(year) % 100 if len(year) == 2 else int(year), int(mo), int(d))
            return True
        except ValueError:
            continue
    return False


def _valid_iban(candidate: str) -> bool:
    from schwifty import IBAN

    try:
        IBAN(candidate)
    except ValueError:
        return False
    return True


def _valid_card(candidate: str) -> bool:
    from stdnum import luhn

    digits = re.sub(r"\D", "", candidate)
    # card networks' prefixes: Visa 4, Mastercard 2/5, Amex 34/37, Discover/UnionPay 6, JCB 35
    return 13 <= len(digits) <= 19 and digits[0] in "23456" and luhn.is_valid(digits)


def _valid_national_id(candidate: str) -> bool:
    from stdnum.dk import cpr
    from stdnum.no import fodselsnummer
    from stdnum.se import personnummer
    from stdnum.us import ssn

    digits = re.sub(r"\D", "", candidate)
    if re.fullmatch(r"\d{3}-\d{2}-\d{4}", candidate):
        return ssn.is_valid(candidate)
    if len(digits) == 10 and cpr.is_valid(digits):
        # CPR numbers issued since 2007 need not satisfy modulus 11: the dash form is enough;
        # an unseparated run of ten digits must satisfy it (else any date-like number would do).
        return "-" in candidate or cpr.checksum(digits) == 0
    if len(digits) in (10, 12) and personnummer.is_valid(candidate):
        return True
    return len(digits) == 11 and fodselsnummer.is_valid(digits)


def _valid_ip(candidate: str) -> bool:
    try:
        address = ipaddress.ip_address(candidate)
    except ValueError:
        return False
    return not address.is_unspecified


class Screen:
    """The screen of one preparation: its policy and the counts it has seen."""

    def __init__(self, policy: str = "reject") -> None:
        if policy not in POLICIES:
            raise ValueError(policy)
        self.policy = policy

    def screen(self, value: Any) -> tuple[Any, dict[str, int]]:
        """``value`` (a conversation's messages or tools: nested lists, dicts, strings) with its
        personal data redacted under ``redact`` (unchanged otherwise), and the counts per kind."""
        counts: dict[str, int] = {}
        strings = _strings(value)
        if not strings or not _may_hold("\n".join(strings)):
            return value, counts  # one test for the whole conversation: most hold nothing to find
        if self.policy != "redact":  # nothing is rewritten: only the strings are visited
            for text in strings:
                for kind, _, _ in find(text):
                    counts[kind] = counts.get(kind, 0) + 1
            return value, counts

        def walk(node: Any) -> Any:
            if isinstance(node, str):
                spans = find(node)
                for kind, _, _ in spans:
                    counts[kind] = counts.get(kind, 0) + 1
                if not spans:
                    return node
                out, at = [], 0
                for kind, start, end in spans:
                    out += [node[at:start], f"[{kind.upper()}]"]
                    at = end
                return "".join(out) + node[at:]
            if isinstance(node, dict):
                return {k: walk(v) for k, v in node.items()}
            if isinstance(node, list):
                return [walk(v) for v in node]
            return node

        return walk(value), counts

    def rejects(self, counts: dict[str, int]) -> bool:
        return self.policy == "reject" and any(kind in DIRECT for kind in counts)


def _strings(node: Any, out: list[str] | None = None) -> list[str]:
    """The strings in ``node`` (nested lists and dict values), in the order ``Screen.screen``'s
    walk visits them."""
    out = [] if out is None else out
    if isinstance(node, str):
        out.append(node)
    elif isinstance(node, (dict, list)):
        for value in node.values() if isinstance(node, dict) else node:
            if isinstance(value, str):  # the common leaf without a call
                out.append(value)
            else:
                _strings(value, out)
    return out


def screen_conversation(conv, policy: str):
    """(the conversation to keep, counts per kind, rejected?) under ``policy``."""
    screen = Screen(policy)
    messages, counts = screen.screen(conv.messages)
    tools, tool_counts = screen.screen(conv.tools)
    for kind, n in tool_counts.items():
        counts[kind] = counts.get(kind, 0) + n
    kept = replace(conv, messages=messages, tools=tools) if policy == "redact" and counts else conv
    return kept, counts, screen.rejects(counts)


def screen_personal_data(conv, policy: str, found: dict[str, int]):
    """The one call `mimir prepare` makes per document: the conversation to keep (redacted under
    ``redact``), its counts added to ``found``; a ``personal_data`` RecordError under ``reject``
    when it holds a direct identifier (the detail names the kinds, never the data)."""
    from .records import RecordError

    kept, counts, rejected = screen_conversation(conv, policy)
    for kind, n in counts.items():
        found[kind] = found.get(kind, 0) + n
    if rejected:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        raise RecordError("personal_data", f"direct identifiers found: {kinds}")
    return kept
