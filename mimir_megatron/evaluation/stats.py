"""Paired significance: the exact two-sided McNemar test on per-item right/wrong outcomes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class McNemar:
    n: int
    """Items scored under both conditions."""
    only_a: int
    """Right under A, wrong under B (discordant)."""
    only_b: int
    """Wrong under A, right under B (discordant)."""
    p_value: float


def mcnemar_exact(a: Mapping[str, bool], b: Mapping[str, bool]) -> McNemar:
    """Exact McNemar on the items both ``a`` and ``b`` scored (id -> correct): the discordant
    pairs are Binomial(only_a + only_b, 1/2) under the null of equal accuracy."""
    from scipy.stats import binomtest

    shared = sorted(set(a) & set(b))
    only_a = sum(1 for i in shared if a[i] and not b[i])
    only_b = sum(1 for i in shared if b[i] and not a[i])
    discordant = only_a + only_b
    p = binomtest(only_a, discordant, 0.5, alternative="two-sided").pvalue if discordant else 1.0
    return McNemar(len(shared), only_a, only_b, float(p))
