"""What the advisor decides for one operand (:class:`Choice`, with the reason it gives) and for a model
(:class:`Recommendation`): without a budget, the cheapest candidate within every limit, else high."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from numscope.advisor.limits import _METRIC_LABEL, HIGH_BITS, SQNR, Check, Limits, _Option, _slack
from numscope.analysis import OperandKey
from numscope.plan import HIGH, Plan


@dataclass(frozen=True)
class Choice:
    """The format chosen for one operand and why.

    metric/value: the deciding metric and its worst-step value (for a budgeted choice, ``sqnr_db``'s mean).
    checks: every candidate judged for this operand → its limits checked on the worst step (a candidate
    is rejected when one of them did not pass).
    """

    site: str
    gemm: str
    operand: str
    format: str
    bits: float
    elements: int
    metric: str
    value: float
    reason: str
    checks: Mapping[str, tuple[Check, ...]] = field(default_factory=dict)

    @property
    def key(self) -> OperandKey:
        return (self.site, self.gemm, self.operand)


@dataclass(frozen=True)
class Recommendation:
    """What :func:`advise` decided: the plan, one :class:`Choice` per operand and the bit accounting.

    average_bits: over all operand elements, weighted by element count (high counts 32).
    optimal: whether the bit-budget allocation is provably optimal (always True without a budget).
    limits: the limits asked for (before per-operand overrides); reference: the backward errors' reference.
    """

    plan: Plan
    choices: tuple[Choice, ...]
    average_bits: float
    bit_budget: float | None
    optimal: bool
    limits: Limits = field(default_factory=Limits)
    reference: str = "bf16"


def _cheapest(options: list[_Option]) -> tuple[_Option | None, list[_Option]]:
    ordered = sorted(options, key=lambda o: (o.bits, -o.mean_sqnr))
    for index, option in enumerate(ordered):
        if option.passed:
            return option, ordered[:index]
    return None, ordered


def _decide(key: OperandKey, options: list[_Option], elements: int) -> tuple[Choice, list[_Option]]:
    """The cheapest passing option (or high) with its reason; also the passing options for a budget."""
    choice, passing = _decide_format(key, options, elements)
    return replace(choice, checks={o.label: tuple(o.checks) for o in options}), passing


def _decide_format(key: OperandKey, options: list[_Option], elements: int) -> tuple[Choice, list[_Option]]:
    site, gemm, operand = key
    chosen, cheaper = _cheapest(options)
    passing = [o for o in options if o.passed]
    if chosen is None:
        best = max(options, key=lambda o: (sum(c.passed for c in o.checks), o.mean_sqnr), default=None)
        if best is None:
            reason = "no candidate measured; kept high"
            return Choice(site, gemm, operand, HIGH, HIGH_BITS, elements, "none", math.nan, reason), []
        failed = next(c for c in best.checks if not c.passed)
        reason = f"no candidate within limits (best {best.label}: {failed.describe()}); kept high"
        return Choice(site, gemm, operand, HIGH, HIGH_BITS, elements, failed.metric, failed.value, reason), []
    if cheaper:
        strictly = [o for o in cheaper if o.bits < chosen.bits]
        nearest = strictly[-1] if strictly else cheaper[-1]
        deciding = next(c for c in nearest.checks if not c.passed)
        rejected = "; ".join(
            f"{o.label} {next(c for c in o.checks if not c.passed).describe()}" for o in reversed(cheaper)
        )
        reason = f"{chosen.label} ({chosen.bits:g} bits): cheapest within limits; rejected: {rejected}"
    elif chosen.checks:
        deciding = min(chosen.checks, key=_slack)
        reason = f"{chosen.label} ({chosen.bits:g} bits): cheapest candidate; tightest: {deciding.describe()}"
    else:
        reason = f"{chosen.label} ({chosen.bits:g} bits): cheapest candidate; no limits set"
        return Choice(
            site, gemm, operand, chosen.label, chosen.bits, elements, SQNR, chosen.mean_sqnr, reason
        ), passing
    choice = Choice(
        site,
        gemm,
        operand,
        chosen.label,
        chosen.bits,
        elements,
        _METRIC_LABEL[deciding.metric],
        deciding.value,
        reason,
    )
    return choice, passing


def _plan(choices: Sequence[Choice]) -> Plan:
    return Plan.per_operand({c.key: c.format for c in choices}, {c.key: c.reason for c in choices})
