"""Personal data in training documents: found with maintained validators, then rejected, redacted
or reported (`mimir prepare --personal-data`).

The paper excludes data containing personal information (§7). Each string of a conversation
(message contents, tool calls, tools) is scanned for:

- ``email``: an address (local part, ``@``, a domain with a dot and a letter TLD; Unicode
  letters allowed; not an SSH remote ``git@host:path``);
- ``phone``: a number that libphonenumber (``phonenumbers``) finds and validates for one of
  :data:`PHONE_REGIONS`, written with ``+`` or with separators between digit groups, or as a bare
  run of digits after a phone label ("tlf.", "ring på", "call me on"); not a date, a set score
  (``28-26 28-24``), a year or hour range, a decimal number (a coordinate), an ISBN, an operand,
  nor a number labelled as another kind (CVR, invoice, order, ISBN...);
- ``iban``: an IBAN, upper or lower case, whose country format and check digits ``schwifty``
  validates;
- ``payment_card``: 13-19 digits (spaces or dashes allowed) with a card prefix and a valid Luhn
  check digit (``stdnum.luhn``);
- ``national_id``: Danish CPR (``stdnum.dk.cpr``: a valid birth date; after a label such as
  "CPR", "cpr-nr." or "personnummer" that is enough, since numbers issued since 2007 need not
  satisfy modulus 11; otherwise DDMMYY-XXXX, or DDMMYYXXXX / DDMMYY XXXX when the modulus-11
  check holds), Swedish personnummer, Norwegian fødselsnummer and US SSN (their ``stdnum``
  validators); not an operand (``160973-8097 = 152876``) nor a number labelled as another kind;
- ``ip_address``: an IPv4 or IPv6 address (``ipaddress``), an indirect identifier; not a
  four-part version or section number, a network, a netmask.

A number's *label* is the nearest of a few words before it (:data:`_LABEL_WORDS`, English and
Danish) with no digit between them; labels decide only where the digits alone cannot.

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

_EMAIL = re.compile(r"(?<![\w.+-])[\w.%+-]+@[\w-]+(?:\.[\w-]+)*\.[^\W\d_]{2,}\b(?!:\S)")
_IBAN = re.compile(r"\b[A-Za-z]{2}\d{2}(?: ?[A-Za-z0-9]{4}){2,7}(?: ?[A-Za-z0-9]{1,3})?\b")
_CARD = re.compile(r"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d-])")
_NATIONAL = re.compile(r"(?<![\d-])(?:\d{6}[-+]?\d{4}|\d{8}[-+]?\d{4}|\d{11}|\d{3}-\d{2}-\d{4})(?![\d-])"
                       r"|(?<![\d-])(?<!\d )\d{6} \d{4,5}(?![\d-])(?! \d)")
_IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?!\.?\d)")
_PHONE_CANDIDATE = re.compile(r"\+?\(?\d[\d\s().-]{5,}\d")
_PHONE_LIKE = re.compile(r"\+.*|.*\d[\s().-]+\d.*", re.S)
_BARE_RUN = re.compile(r"(?<![\d-])(?<![\d][.,])\d{8,12}(?![\d-])(?![.,]\d)")
_DIGIT = re.compile(r"\d")  # what IBANs, cards, national ids, IPv4 addresses and phone numbers need
_IPV6 = re.compile(r"(?<![\w:])[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}(?![\w:])")

# Words that say what the number after them is (English and Danish, the sample's languages, and
# the Nordic ids' own names). The nearest one before a number, with no digit between them, is
# its label: a phone number written as a bare digit run is taken only after a phone label, a
# date-like ten-digit number without the CPR check digit only after a national-id label, and
# a number labelled as another kind of number (CVR, ISBN, invoice, version, section...) or
# standing in arithmetic is no identifier.
_LABEL_WORDS = {
    "phone": r"tlf|telefon\w*|mobil\w*|mobile|phone|tel|telephone|cell|ring\w*|call|sms|text|whatsapp|"
             r"fax|pårørende",
    "national": r"cpr\w*|cpr[-.]?(?:nr|nummer|number|no)|personnummer|personnr|person-nr|"
                r"personal (?:id(?:entity)? )?(?:number|no|id)|fødselsnummer|fødselsnr|ssn|"
                r"social security(?: number| no)?|national id(?: number)?|sygesikring\w*",
    "other": r"cvr\w*|se-nr|moms\w*|vat|isbn\w*|issn|ean|gtin|faktura\w*|invoice|ordre\w*|order|ticket|"
             r"booking\w*|vare\w*|kunde\w*|customer|sag|sagsnr|sagsnummer|case|j\.nr|journalnr|bilag|pakke\w*|"
             r"tracking|serial|policy|reference|ref|part|model|reservedel|batch|lot|konto\w*|account|"
             r"reg\.?(?:nr)?|lotto\w*|score|resultat|result",
    "version": r"v|version|ver|build|release|firmware|driver|framework|android|ios|windows|python|"
               r"afsnit|section|punkt|rule|regel|table|tabel|kapitel|chapter|§",
    "arithmetic": r"udregn\w*|regn\w*|facit|træk\w*|subtract|difference|minus|plus|sum|compute|"
                  r"calculate|læg",
}
_LABEL = re.compile("|".join(f"(?P<{kind}>(?<![^\\W\\d_])(?:{words})(?![^\\W\\d_]))"
                             for kind, words in _LABEL_WORDS.items()), re.IGNORECASE)
_LABEL_REACH = 40  # characters before a number searched for its label
_OPERATOR = "=+*×÷<>"


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
                  if _valid_national_id(m.group(), text, m.start(), m.end())]
        found += [("ip_address", m.start(), m.end()) for m in _IPV4.finditer(text)
                  if _valid_ip(m.group()) and _ipv4_in_context(m.group(), text, m.start())]
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


def _label(text: str, start: int) -> str | None:
    """The kind of the nearest label word before ``start`` (:data:`_LABEL_WORDS`), when no digit
    stands between them; else None."""
    window = text[max(0, start - _LABEL_REACH):start]
    last = None
    for last in _LABEL.finditer(window):  # noqa: B007 - the last one is the nearest
        pass
    if last is None or _has_digit(window[last.end():]):
        return None
    return last.lastgroup


def _in_arithmetic(text: str, start: int, end: int) -> bool:
    """Whether the number at ``text[start:end]`` is an operand: an operator right before or after
    it (``160973-8097 = 152876``), or an arithmetic word as its label."""
    before, after = text[max(0, start - 3):start].rstrip(), text[end:end + 3].lstrip()
    return (bool(before) and before[-1] in _OPERATOR) or (bool(after) and after[0] in _OPERATOR) \
        or _label(text, start) == "arithmetic"


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


# Digit groups libphonenumber validates as a number of some region that are other things:
_SCORES = re.compile(r"\d{1,3}-\d{1,3}(?:,? +\d{1,3}-\d{1,3})+")  # set scores 28-26 28-24
_RANGE = re.compile(r"(?:19|20)\d\d-(?:19|20)\d\d|\d{1,2}[.:]\d\d-\d{1,2}[.:]\d\d")  # years, hours
_DECIMAL = re.compile(r"-?\d+\.\d+")  # a coordinate, a measurement
_ISBN_SHAPE = re.compile(r"(?:97[89]-)?\d{1,5}-\d{1,7}-\d{1,7}-[\dXx]")
_ISBN_CHARS = frozenset("0123456789Xx-")


def _phones(text: str) -> Iterator[tuple[str, int, int]]:
    import phonenumbers

    written = any(_PHONE_LIKE.fullmatch(m.group()) and len(re.sub(r"\D", "", m.group())) >= 7
                  for m in _PHONE_CANDIDATE.finditer(text))
    bare = not written and any(_label(text, m.start()) == "phone" for m in _BARE_RUN.finditer(text))
    if not (written or bare):
        return  # nothing libphonenumber could take for a written phone number (the common case)
    seen: set[tuple[int, int]] = set()
    for region in PHONE_REGIONS:
        for match in phonenumbers.PhoneNumberMatcher(text, region, leniency=phonenumbers.Leniency.VALID):
            if (match.start, match.end) in seen or not _phone_in_context(match.raw_string, text, match.start,
                                                                         match.end):
                continue
            seen.add((match.start, match.end))
            yield "phone", match.start, match.end


def _phone_in_context(raw: str, text: str, start: int, end: int) -> bool:
    """Whether a number libphonenumber validated is written and placed as a phone number."""
    label = _label(text, start)
    if label in ("other", "national", "version") or _in_arithmetic(text, start, end):
        return False  # CVR-nr. 2531 3763; a CPR number; an operand
    if not (raw.lstrip().startswith("+") or re.search(r"\d[\s().-]+\d", raw)):
        return label == "phone"  # a bare run of digits, as arithmetic writes numbers
    stripped = raw.strip()
    if _is_date(stripped) or _SCORES.fullmatch(stripped) or _RANGE.fullmatch(stripped) \
            or _DECIMAL.fullmatch(stripped):
        return False  # 24.11.2015 (eight digits in pairs, as Danish numbers are written)
    return not _inside_isbn(text, start + _DIGIT.search(raw).start())


def _inside_isbn(text: str, at: int) -> bool:
    """Whether the digit at ``text[at]`` belongs to an ISBN written in its hyphenated form
    (87-7245-123-4, 978-87-02-12345-2) with a valid check digit (``stdnum.isbn``)."""
    from stdnum import isbn

    lo, hi = at, at
    while lo > 0 and text[lo - 1] in _ISBN_CHARS:
        lo -= 1
    while hi < len(text) and text[hi] in _ISBN_CHARS:
        hi += 1
    run = text[lo:hi].strip("-")
    return _ISBN_SHAPE.fullmatch(run) is not None and isbn.is_valid(run)


def _is_date(text: str) -> bool:
    import datetime

    m = re.fullmatch(r"(\d{1,2})[./-](\d{1,2})[./-](\d{2}|\d{4})|(\d{4})([./-])(\d{2})\5(\d{2})",
                     text.strip())
    if not m:
        return False
    day, month, year = (m.group(1), m.group(2), m.group(3)) if m.group(1) else \
        (m.group(7), m.group(6), m.group(4))
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
        IBAN(candidate)  # upper or lower case (schwifty upper-cases it)
    except ValueError:
        return False
    return True


def _valid_card(candidate: str) -> bool:
    from stdnum import luhn

    digits = re.sub(r"\D", "", candidate)
    # card networks' prefixes: Visa 4, Mastercard 2/5, Amex 34/37, Discover/UnionPay 6, JCB 35
    return 13 <= len(digits) <= 19 and digits[0] in "23456" and luhn.is_valid(digits)


def _valid_national_id(candidate: str, text: str, start: int, end: int) -> bool:
    from stdnum.dk import cpr
    from stdnum.no import fodselsnummer
    from stdnum.se import personnummer
    from stdnum.us import ssn

    label = _label(text, start)
    if label in ("other", "version") or _in_arithmetic(text, start, end):
        return False  # Sagsnummer 0101901235; 160973-8097 = 152876
    digits = re.sub(r"\D", "", candidate)
    if re.fullmatch(r"\d{3}-\d{2}-\d{4}", candidate):
        return ssn.is_valid(candidate)
    if len(digits) == 10 and cpr.is_valid(digits):
        # CPR numbers issued since 2007 need not satisfy modulus 11: after a label (CPR,
        # personnummer) a valid birth date is enough, and so is the dash (DDMMYY-XXXX, the written
        # form); a run of ten digits, or two groups, must satisfy it (else any date-like number
        # would do).
        return label == "national" or "-" in candidate or cpr.checksum(digits) == 0
    if len(digits) in (10, 12) and " " not in candidate and personnummer.is_valid(candidate):
        return True
    return len(digits) == 11 and fodselsnummer.is_valid(digits)


def _ipv4_in_context(candidate: str, text: str, start: int) -> bool:
    """Whether a valid IPv4 address is written where an address is: not a four-part version or
    section number (v1.2.3.4, version 2.4.1.0, section 3.2.1.1, all parts one digit), a network
    (192.168.0.0/16) or a netmask, nor a phone number written with dots after a phone label
    (Tlf. 51.17.83.26)."""
    if all(len(part) == 1 for part in candidate.split(".")) or text.startswith("/", start + len(candidate)):
        return False  # 1.2.3.4; 192.168.0.0/16 (a network)
    host = ~int(ipaddress.IPv4Address(candidate)) & 0xFFFFFFFF
    if host < 0x01000000 and not host & (host + 1):
        return False  # a netmask, 255.255.255.0 (ones, then zeros)
    return _label(text, start) not in ("version", "phone") and not text.endswith("==", 0, start)


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
