"""Licence expressions: validation, combination, and which licences are *open*.

Expressions are SPDX (``CC-BY-4.0``, ``Apache-2.0 AND MIT``) parsed with the SPDX list that the
``license-expression`` package ships, plus two names beside it: ``public-domain`` and
``proprietary-agreement`` (data supplied under an agreement whose terms are no SPDX licence).

Whether a licence is open (free to use, modify and share for any purpose: the Open Definition) is
taken from the licence categories of the ScanCode licence database, which the same package ships
(``license_expression.get_license_index()``), not from a hand-kept list: the categories
Permissive, Copyleft, Copyleft Limited and Public Domain are open; Source-available (where
ScanCode files the CC NC and ND licences), Proprietary Free, Free Restricted, Commercial, CLA,
Patent License and Unstated License are not. ``LicenseRef-*`` ids (ScanCode's own keys, whose
category is ScanCode's reading of a licence nobody standardised) are never open by default:
a data policy lists them explicitly.

A licence with an exception (``GPL-2.0-only WITH Classpath-exception-2.0``) is one term: its id is
the whole ``X WITH Y`` (a policy may list that, or ``X`` alone), and its category is its licence's
(an exception only adds permissions).

Terms combine as a conjunction: data made from other data keeps every one of their terms (AND). An
``OR`` offers a choice; a derived dataset's declared licence may narrow its ancestors' terms but
never reopen one: each of its choices must keep them (:func:`dropped_terms`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Iterable

PUBLIC_DOMAIN = "public-domain"
AGREEMENT = "proprietary-agreement"
EXTRA_LICENCES = (PUBLIC_DOMAIN, AGREEMENT)
"""Licence names beside the SPDX list."""
UNKNOWN = "unknown"
OPEN_CATEGORIES = ("Permissive", "Copyleft", "Copyleft Limited", "Public Domain")
"""ScanCode licence categories that meet the Open Definition."""


@lru_cache(maxsize=1)
def _licensing():
    """The SPDX licence list (the license-expression package ships it) plus EXTRA_LICENCES."""
    from license_expression import LicenseSymbol, Licensing, get_spdx_licensing

    spdx = get_spdx_licensing()
    return Licensing(list(spdx.known_symbols.values()) + [LicenseSymbol(k) for k in EXTRA_LICENCES])


@lru_cache(maxsize=1)
def _categories() -> dict[str, str]:
    """Lower-case SPDX id -> ScanCode category, from the licence database license-expression ships."""
    from license_expression import get_license_index

    categories: dict[str, str] = {}
    for entry in get_license_index():
        for key in [entry.get("spdx_license_key"), *(entry.get("other_spdx_license_keys") or [])]:
            if key and entry.get("category"):
                categories.setdefault(key.lower(), entry["category"])
    return categories


WITH = " WITH "


def base_licence(key: str) -> str:
    """The licence of a term: ``X`` of ``X WITH exception``, the id itself otherwise."""
    return key.split(WITH, 1)[0]


def licence_category(key: str) -> str:
    """The ScanCode category of one term (``Agreement`` for proprietary-agreement, ``Unknown``
    for an id the database does not categorise; a licence with an exception has its licence's)."""
    key = base_licence(key)
    if key == PUBLIC_DOMAIN:
        return "Public Domain"
    if key == AGREEMENT:
        return "Agreement"
    return _categories().get(key.lower(), "Unknown")


def is_open(key: str) -> bool:
    """Whether a term is open (see the module docstring); LicenseRef-* ids never are."""
    return not base_licence(key).startswith("LicenseRef-") and licence_category(key) in OPEN_CATEGORIES


def imposes_no_terms(key: str) -> bool:
    """Public-domain dedications (CC0, PDDL, public-domain...): nothing a derivative must keep."""
    return not base_licence(key).startswith("LicenseRef-") and licence_category(key) == "Public Domain"


def normalise_license(expression: str) -> tuple[str | None, str | None]:
    """(normalised expression, None) for a valid SPDX expression or extra licence name, else
    (None, the reason). Never raises: a malformed expression is a reason like any other."""
    if not isinstance(expression, str) or not expression.strip():
        return None, "empty; an SPDX expression (e.g. CC-BY-4.0), or " + " / ".join(EXTRA_LICENCES)
    if expression.strip().lower() == UNKNOWN:
        return None, "'unknown' is what an undeclared dataset is; declare the licence"
    try:
        info = _licensing().validate(expression)
    except Exception:  # noqa: BLE001 - the parser's own errors are not always printable
        return None, f"{expression!r} is not a licence expression"
    if info.invalid_symbols:
        return None, (f"unknown licence id(s) {', '.join(map(repr, info.invalid_symbols))} (not on the SPDX "
                      f"list; or use {' / '.join(EXTRA_LICENCES)})")
    if info.errors or not info.normalized_expression:
        return None, f"{expression!r} is not a licence expression"
    return str(info.normalized_expression), None


def _term(node) -> str:
    """The id of one term of a parsed expression (``X WITH Y`` kept whole)."""
    from license_expression import LicenseWithExceptionSymbol

    if isinstance(node, LicenseWithExceptionSymbol):
        return f"{node.license_symbol.key}{WITH}{node.exception_symbol.key}"
    return node.key


def _walk(expression: str, leaf: Callable, both: Callable, either: Callable):
    """Fold a parsed expression: ``leaf(term)`` at each term, ``both`` over an AND's operands,
    ``either`` over an OR's."""
    from license_expression import AND, OR

    def walk(node):
        if isinstance(node, AND):
            return both([walk(arg) for arg in node.args])
        if isinstance(node, OR):
            return either([walk(arg) for arg in node.args])
        return leaf(_term(node))

    return walk(_licensing().parse(expression))


_MAX_CHOICES = 4096


def choices(expression: str) -> list[tuple[str, ...]]:
    """The ways to comply with an expression, each the terms that are then all kept (its
    disjunctive normal form: ``MIT AND (GPL-2.0-only OR CC-BY-4.0)`` gives ``(MIT, GPL-2.0-only)``
    and ``(MIT, CC-BY-4.0)``)."""
    if expression == UNKNOWN:
        return [(UNKNOWN,)]

    def both(parts: list[list[tuple[str, ...]]]) -> list[tuple[str, ...]]:
        combined: list[tuple[str, ...]] = [()]
        for part in parts:
            combined = list(dict.fromkeys(tuple(dict.fromkeys(a + b)) for a in combined for b in part))
            combined = combined[:_MAX_CHOICES]  # a bound on pathological expressions
        return combined

    def either(parts: list[list[tuple[str, ...]]]) -> list[tuple[str, ...]]:
        return list(dict.fromkeys(c for part in parts for c in part))

    return _walk(expression, lambda term: [(term,)], both, either)


def license_keys(expression: str) -> list[str]:
    """The terms an expression names, in order (``unknown`` for an unknown one; a licence with an
    exception is one term, ``X WITH Y``)."""
    if expression == UNKNOWN:
        return [UNKNOWN]
    return list(dict.fromkeys(_walk(expression, lambda term: [term], _flat, _flat)))


def _flat(parts: list[list[str]]) -> list[str]:
    return [term for part in parts for term in part]


def satisfiable(expression: str, ok: Callable[[str], bool]) -> bool:
    """Whether the expression can be complied with using terms ``ok`` accepts: every operand of
    an AND must be, one operand of an OR suffices."""
    if expression == UNKNOWN:
        return False
    return _walk(expression, ok, all, any)


def license_allowed(expression: str, allowed: set[str] | None, denied: set[str]) -> bool:
    """Whether the expression can be complied with using allowed, not denied licences.
    ``allowed`` None allows any."""
    return satisfiable(expression, lambda key: key not in denied and (allowed is None or key in allowed))


def combine_licenses(expressions: Iterable[str]) -> str:
    """The licence of data made from several inputs: all their terms apply (AND), deduplicated;
    ``unknown`` when any input's is."""
    expressions = list(dict.fromkeys(expressions))
    if not expressions:
        return UNKNOWN
    if UNKNOWN in expressions:
        return UNKNOWN
    if len(expressions) == 1:
        return expressions[0]
    licensing = _licensing()
    joined = " AND ".join(f"({e})" for e in expressions)
    return str(licensing.dedup(licensing.parse(joined).flatten()))  # nested ANDs as one


def dropped_terms(declared: str, inherited: str) -> list[str]:
    """The terms of ``inherited`` (an ancestor's) that ``declared`` lets a user drop: declaring
    ``declared`` for data derived under ``inherited`` relaxes those terms. Every way to comply
    with ``declared`` (each branch of an OR) must keep ``inherited``: an OR may narrow an
    ancestor's terms, never reopen them (``CC-BY-4.0 OR CC-BY-NC-4.0`` under a CC-BY-NC-4.0 parent
    offers a way out of NC, so it drops NC). Public-domain dedications impose nothing and are
    never reported."""
    if inherited == UNKNOWN or declared == UNKNOWN:
        return []
    dropped: dict[str, None] = {}
    for branch in choices(declared):
        kept = {k.lower() for k in branch}
        if satisfiable(inherited, lambda key: key.lower() in kept or imposes_no_terms(key)):
            continue  # this choice keeps every AND operand of the ancestor's terms, or one OR branch
        dropped.update(dict.fromkeys(k for k in license_keys(inherited)
                                     if k.lower() not in kept and not imposes_no_terms(k)))
    return list(dropped)
