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


def licence_category(key: str) -> str:
    """The ScanCode category of one licence id (``Agreement`` for proprietary-agreement,
    ``Unknown`` for an id the database does not categorise)."""
    if key == PUBLIC_DOMAIN:
        return "Public Domain"
    if key == AGREEMENT:
        return "Agreement"
    return _categories().get(key.lower(), "Unknown")


def is_open(key: str) -> bool:
    """Whether a licence id is open (see the module docstring); LicenseRef-* ids never are."""
    return not key.startswith("LicenseRef-") and licence_category(key) in OPEN_CATEGORIES


def imposes_no_terms(key: str) -> bool:
    """Public-domain dedications (CC0, PDDL, public-domain...): nothing a derivative must keep."""
    return not key.startswith("LicenseRef-") and licence_category(key) == "Public Domain"


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


def license_keys(expression: str) -> list[str]:
    """The licence ids an expression names (``unknown`` for an unknown one)."""
    if expression == UNKNOWN:
        return [UNKNOWN]
    licensing = _licensing()
    return licensing.license_keys(licensing.parse(expression))


def satisfiable(expression: str, ok: Callable[[str], bool]) -> bool:
    """Whether the expression can be complied with using licences ``ok`` accepts: every operand
    of an AND must be, one operand of an OR suffices."""
    if expression == UNKNOWN:
        return False
    from license_expression import AND, OR

    def walk(node) -> bool:
        if isinstance(node, AND):
            return all(walk(arg) for arg in node.args)
        if isinstance(node, OR):
            return any(walk(arg) for arg in node.args)
        return ok(node.key)

    return walk(_licensing().parse(expression))


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
    return str(licensing.dedup(licensing.parse(joined)))


def dropped_terms(declared: str, inherited: str) -> list[str]:
    """The licence ids of ``inherited`` (an ancestor's terms) that ``declared`` does not carry:
    declaring ``declared`` for data derived under ``inherited`` relaxes those terms. Public-domain
    dedications impose nothing and are never reported."""
    if inherited == UNKNOWN or declared == UNKNOWN:
        return []
    kept = {k.lower() for k in license_keys(declared)}
    if satisfiable(inherited, lambda key: key.lower() in kept or imposes_no_terms(key)):
        return []  # every AND operand kept, or one OR branch
    return [k for k in dict.fromkeys(license_keys(inherited))
            if k.lower() not in kept and not imposes_no_terms(k)]
