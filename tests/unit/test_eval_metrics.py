"""Evaluation metrics, answer extraction, McNemar, IFEval checks and HumanEval's runner against
hand-computed values (no server, no InspectAI run)."""

from __future__ import annotations

import math

import pytest

from mimir_megatron.evaluation import metrics as m
from mimir_megatron.evaluation.ifeval import follows, unsupported
from mimir_megatron.evaluation.metrics import ItemOutcome
from mimir_megatron.evaluation.stats import mcnemar_exact


def outcome(pred: str, ref: str, value: float = 0.0) -> ItemOutcome:
    return ItemOutcome("0", pred, (ref,), value)


@pytest.mark.parametrize("text,answer", [
    ("She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7", "7"),
    ("so the total is $1,234.00.", "1234"),
    ("first 12, then 15, finally -3.5", "-3.5"),
    ("#### 1,000\nmore text 5", "1000"),
    ("no number here", ""),
])
def test_gsm8k_extraction(text, answer):
    assert m.extract_gsm8k(text) == answer


@pytest.mark.parametrize("text,answer", [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{\\dfrac{3}{4}} and then \\boxed{ 5 }", "5"),
    ("\\boxed{x = 10^\\circ}", "10"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{\\left( 1,2 \\right)}", "(1,2)"),
    ("\\boxed{\\frac12}", "\\frac{1}{2}"),
])
def test_math_extraction_normalises(text, answer):
    assert m.extract_boxed(text) == answer


@pytest.mark.parametrize("reply,letter", [
    ("B", "B"), (" C.", "C"), ("(A) because", "A"), ("The answer is D", "D"), ("Banana", ""), ("E", ""),
])
def test_letter_extraction(reply, letter):
    assert m.extract_letter(reply, 4) == letter


def test_exact_match_is_exact_after_stripping():
    assert m.exact_match(" Jeg så en sten. ", ["Jeg så en sten."]) == 1.0
    assert m.exact_match("jeg så en sten.", ["Jeg så en sten."]) == 0.0
    assert m.exact_match("b", ["a", "b"]) == 1.0


def test_token_f1_by_hand():
    # normalised: [cat, sat] vs [cat, sat, down]: P = 1, R = 2/3, F1 = 0.8
    assert m.token_f1("The cat sat!", ["cat sat down"]) == pytest.approx(0.8)
    assert m.token_f1("13", ["twelve", "13"]) == 1.0
    assert m.token_f1("dog", ["cat"]) == 0.0


def test_rouge1_by_hand():
    # unigrams: 2 shared of 4 predicted, 3 reference: P = 1/2, R = 2/3, F = 4/7
    assert m.rouge1("cat dog fish bird", ["cat dog cow"]) == pytest.approx(4 / 7)


def test_chrf_by_hand():
    # hypothesis abcdef, reference abcdefg: every order n = 1..6 has precision 1 and recall
    # (7 - n) / (8 - n); chrF = (1 + b^2) P R / (b^2 P + R) with b = 2 over the averages.
    recall = sum((7 - n) / (8 - n) for n in range(1, 7)) / 6
    expected = 5 * recall / (4 + recall)
    assert m.sentence_chrf("abcdef", ["abcdefg"]) == pytest.approx(expected)
    assert m.corpus_chrf([outcome("abcdef", "abcdefg")]) == pytest.approx(expected)
    assert m.corpus_chrf([outcome("xyz", "abc")]) == 0.0


def test_macro_f1_by_hand():
    # A: P 1, R 1/2, F 2/3; B: P 2/3, R 1, F 4/5; macro = (2/3 + 4/5) / 2
    outs = [outcome(p, r) for p, r in zip("ABBB", "AABB")]
    assert m.macro_f1(outs) == pytest.approx((2 / 3 + 4 / 5) / 2)
    assert m.aggregate("macro_f1", outs) == pytest.approx(11 / 15)


def test_aggregate_mean_and_empty():
    assert m.aggregate("exact_match", [outcome("a", "a", 1.0), outcome("b", "a", 0.0)]) == 0.5
    assert math.isnan(m.aggregate("accuracy", []))


def test_score_item_binary_and_graded():
    assert m.score_item("accuracy", "7", ["7"]) == (1.0, True)
    assert m.score_item("exact_match", "x", ["y"]) == (0.0, False)
    value, correct = m.score_item("f1", "cat sat", ["cat sat down"])
    assert correct is None and value == pytest.approx(0.8)


def test_mcnemar_by_hand():
    # 5 items right only under A, 1 only under B, 4 agree: p = 2 P(X <= 1 | n=6, 1/2) = 2 * 7/64
    a = {str(i): v for i, v in enumerate([1, 1, 1, 1, 1, 0, 1, 0, 1, 1])}
    b = {str(i): v for i, v in enumerate([0, 0, 0, 0, 0, 1, 1, 0, 1, 1])}
    test = mcnemar_exact({k: bool(v) for k, v in a.items()}, {k: bool(v) for k, v in b.items()})
    assert (test.n, test.only_a, test.only_b) == (10, 5, 1)
    assert test.p_value == pytest.approx(2 * 7 / 64)
    # 3 vs 0: p = 2 / 2^3; only paired ids count
    test = mcnemar_exact({"1": True, "2": True, "3": True, "x": True}, {"1": False, "2": False, "3": False})
    assert (test.n, test.only_a, test.only_b, test.p_value) == (3, 3, 0, pytest.approx(0.25))
    assert mcnemar_exact({"1": True}, {"1": True}).p_value == 1.0


def test_ifeval_checks():
    assert follows("hej med dig", ["punctuation:no_comma", "change_case:english_lowercase"], [{}, None]) \
        == [True, True]
    assert follows("Hej, dig", ["punctuation:no_comma"], [{}]) == [False]
    assert follows("one two three", ["length_constraints:number_words"],
                   [{"num_words": 5, "relation": "less than", "keywords": None}]) == [True]
    assert follows("a b c d e f", ["length_constraints:number_words"],
                   [{"num_words": 5, "relation": "less than"}]) == [False]
    assert follows("jeg elsker vinter. tak.", ["startend:end_checker"], [{"end_phrase": "Tak."}]) == [True]
    assert follows("x\n* a\n* b", ["detectable_format:number_bullet_lists"], [{"num_bullets": 2}]) == [True]
    assert unsupported(["punctuation:no_comma", "language:response_language"]) == ["language:response_language"]
