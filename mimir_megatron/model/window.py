"""Which module applications of the recurrence build an autograd graph (the bp window).

The schedule of one forward pass is ``H_cycles x (L_cycles L-applications, then one H)``;
Mimir's (2, 3) is ``LLLHLLLH``. A window of k applications gets gradients, the rest run under
``torch.no_grad()``. This pure function is the single source of truth for the model (which
applications run with grad) and for the learning-rate scheduler (k_L and k_H divide the L and
H learning rates).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

POLICIES = ("last_k", "h_first")


@dataclass(frozen=True)
class WindowPlan:
    schedule: tuple[str, ...]
    """Module of each application in order, 'L' or 'H'."""
    grad: tuple[bool, ...]
    """Whether each application runs with grad."""

    @property
    def k(self) -> int:
        return sum(self.grad)

    @property
    def k_L(self) -> int:
        return sum(g for m, g in zip(self.schedule, self.grad) if m == "L")

    @property
    def k_H(self) -> int:
        return sum(g for m, g in zip(self.schedule, self.grad) if m == "H")

    @property
    def reaches_embedding(self) -> bool:
        """Whether the embedding gets a gradient: z_H is the embedding only until the first
        H-application, so some application of the first H-cycle must be in the window."""
        first_cycle = self.schedule.index("H") + 1
        return any(self.grad[:first_cycle])

    def describe(self) -> str:
        """Schedule with grad applications upper case: k=5 of LLLHLLLH -> 'lllHLLLH'."""
        return "".join(m if g else m.lower() for m, g in zip(self.schedule, self.grad))


def schedule(h_cycles: int, l_cycles: int) -> tuple[str, ...]:
    return tuple(("L",) * l_cycles + ("H",)) * h_cycles


@lru_cache(maxsize=256)
def plan_window(h_cycles: int, l_cycles: int, k: int, policy: str = "last_k") -> WindowPlan:
    """Applications that get gradients for a window of k.

    - ``last_k`` (Mimir paper): the last k applications in schedule order.
    - ``h_first`` (reference code): ``H_bp = min(H_cycles, k - 1)``, ``L_bp = k - H_bp``; the last
      H_bp H-applications and the last L_bp L-applications.
    """
    if h_cycles < 1 or l_cycles < 1:
        raise ValueError(f"h_cycles and l_cycles must be >= 1, got {h_cycles}, {l_cycles}")
    order = schedule(h_cycles, l_cycles)
    depth = len(order)
    if not 1 <= k <= depth:
        raise ValueError(f"window k={k} outside 1..{depth} for schedule {''.join(order)}")
    if policy == "last_k":
        grad = tuple(i >= depth - k for i in range(depth))
    elif policy == "h_first":
        h_bp = min(h_cycles, k - 1)
        l_bp = k - h_bp
        if l_bp > h_cycles * l_cycles:
            raise ValueError(f"window k={k} needs {l_bp} L-applications, schedule has fewer")
        want = {"H": h_bp, "L": l_bp}
        grad_rev = []
        for module in reversed(order):
            grad_rev.append(want[module] > 0)
            want[module] -= 1
        grad = tuple(reversed(grad_rev))
    else:
        raise ValueError(f"unknown window policy {policy!r}; expected one of {POLICIES}")
    return WindowPlan(schedule=order, grad=grad)
