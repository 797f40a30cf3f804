"""The bit budget: a cap on the average bits per operand element, met by the least total objective over
the operands (a multiple-choice knapsack solved by dynamic programming over integer bit costs)."""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import numpy as np

from numscope.advisor.choice import Choice
from numscope.advisor.limits import HIGH_BITS, SQNR, AdvisorError, _number, _Option
from numscope.plan import HIGH

DP_CELLS = 1 << 18
"""The largest knapsack table (cells per operand) the bit-budget solver uses before coarsening costs."""


def _solve_budget(options: list[list[_Option]], elements: list[int], budget: float) -> tuple[list[int], bool]:
    """Multiple-choice knapsack: minimise Σ noise subject to Σ elements·bits ≤ budget·Σ elements.

    Returns the index of the chosen option per operand and whether the solution is provably optimal.
    """
    denominators = [Fraction(o.bits).limit_denominator(1 << 12).denominator for opts in options for o in opts]
    scale = math.lcm(*denominators) if denominators else 1
    costs = [
        [int(Fraction(o.bits).limit_denominator(1 << 12) * scale) * n for o in opts]
        for opts, n in zip(options, elements, strict=True)
    ]
    capacity = math.floor(Fraction(budget).limit_denominator(1 << 20) * scale * sum(elements))
    unit = math.gcd(*(c for row in costs for c in row)) or 1
    optimal = True
    cells = capacity // unit
    if cells > DP_CELLS:
        unit = math.ceil(capacity / DP_CELLS)
        optimal = False
    weights = [[-(-c // unit) for c in row] for row in costs]
    cells = capacity // unit
    best = np.zeros(cells + 1)
    picks = []
    for row, opts in zip(weights, options, strict=True):
        new = np.full(cells + 1, np.inf)
        pick = np.full(cells + 1, -1, dtype=np.int8)
        for index, (weight, option) in enumerate(zip(row, opts, strict=True)):
            if weight > cells:
                continue
            candidate = np.full(cells + 1, np.inf)
            candidate[weight:] = best[: cells + 1 - weight] + option.noise
            better = candidate < new
            new[better] = candidate[better]
            pick[better] = index
        best = new
        picks.append(pick)
    if not np.isfinite(best[cells]):
        raise AdvisorError(
            f"bit budget {budget:g} bits/element is infeasible with these candidates (rounded costs); "
            "raise bit_budget or add cheaper candidates"
        )
    chosen = []
    remaining = cells
    for pick, row in zip(reversed(picks), reversed(weights), strict=True):
        index = int(pick[remaining])
        chosen.append(index)
        remaining -= row[index]
    return chosen[::-1], optimal


def _apply_budget(
    choices: list[Choice],
    passing: list[list[_Option]],
    budget: float,
    objective_name: str = "noise",
    limits_text: str = "all limits met",
) -> tuple[list[Choice], bool]:
    options = [
        sorted(opts, key=lambda o: o.bits) if opts else [_Option(HIGH, HIGH_BITS, 0.0, math.inf, [])]
        for opts in passing
    ]
    elements = [c.elements for c in choices]
    total = sum(elements)
    if total == 0:
        raise AdvisorError("a bit budget needs element counts; the analysis records none")
    cheapest = sum(min(o.bits for o in opts) * n for opts, n in zip(options, elements, strict=True)) / total
    if budget < cheapest - 1e-9:
        raise AdvisorError(
            f"bit budget {budget:g} bits/element is impossible: the cheapest assignment within the limits "
            f"needs {cheapest:.4g} bits/element; raise bit_budget to at least {cheapest:.4g} "
            "or relax the limits"
        )
    picked, optimal = _solve_budget(options, elements, budget)
    out = []
    method = "exact DP" if optimal else "DP on rounded-up costs"
    for choice, opts, index in zip(choices, options, picked, strict=True):
        option = opts[index]
        if option.label == choice.format:
            out.append(
                replace(choice, reason=f"{choice.reason}; kept within bit budget {budget:g} ({method})")
            )
            continue
        reason = (
            f"{option.label} ({option.bits:g} bits): least total {objective_name} within bit budget "
            f"{budget:g} ({method}); {objective_name} {_number(option.noise)}; sqnr_db "
            f"{_number(option.mean_sqnr)} mean; {limits_text}"
        )
        out.append(
            replace(
                choice,
                format=option.label,
                bits=option.bits,
                metric=SQNR,
                value=option.mean_sqnr,
                reason=reason,
            )
        )
    return out, optimal
