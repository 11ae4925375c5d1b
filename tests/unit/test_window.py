"""The bp-window allocation against the hand-written examples of the paper and reference code."""

import pytest

from mimir_megatron.model.window import plan_window

# Upper case = application with grad, in schedule order L0 L1 L2 H0 L3 L4 L5 H1.
PAPER_LAST_K = {1: "lllhlllH", 2: "lllhllLH", 3: "lllhlLLH", 4: "lllhLLLH", 5: "lllHLLLH",
                6: "llLHLLLH", 7: "lLLHLLLH", 8: "LLLHLLLH"}
REFERENCE_H_FIRST = {1: "lllhllLh", 2: "lllhllLH", 3: "lllHllLH", 4: "lllHlLLH", 5: "lllHLLLH",
                     6: "llLHLLLH", 7: "lLLHLLLH", 8: "LLLHLLLH"}


@pytest.mark.parametrize("k,expected", PAPER_LAST_K.items())
def test_last_k_matches_paper(k, expected):
    assert plan_window(2, 3, k, "last_k").describe() == expected


@pytest.mark.parametrize("k,expected", REFERENCE_H_FIRST.items())
def test_h_first_matches_reference(k, expected):
    assert plan_window(2, 3, k, "h_first").describe() == expected


@pytest.mark.parametrize("k", [2, 5, 8])
def test_policies_agree_where_the_paper_says(k):
    assert plan_window(2, 3, k, "last_k") == plan_window(2, 3, k, "h_first")


@pytest.mark.parametrize(
    "k,k_L,k_H",
    # Paper: k=2 (LH) eta_L = eta_H = eta; k=4 (LLLH) eta_L = eta/3; k=5 (HLLLH) eta_H = eta/2,
    # eta_L = eta/3; k=8 eta_H = eta/2, eta_L = eta/6.
    [(2, 1, 1), (4, 3, 1), (5, 3, 2), (8, 6, 2)],
)
def test_learning_rate_dividers_of_the_paper(k, k_L, k_H):
    plan = plan_window(2, 3, k, "last_k")
    assert (plan.k_L, plan.k_H, plan.k) == (k_L, k_H, k)


def test_other_schedules():
    assert plan_window(3, 1, 3, "last_k").describe() == "lhlHLH"
    assert plan_window(1, 2, 2, "h_first").describe() == "lLH"
    assert plan_window(3, 2, 4, "h_first").describe() == "llHllHlLH"


@pytest.mark.parametrize("k", [0, 9, -1])
def test_window_outside_schedule_is_refused(k):
    with pytest.raises(ValueError, match="outside 1..8"):
        plan_window(2, 3, k, "last_k")


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown window policy"):
        plan_window(2, 3, 2, "first_k")
