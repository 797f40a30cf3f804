"""Advisor limits derived from training outcomes: the loosest that accept every uniform format that
trained at FP32 parity."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from numscope.analysis import Analysis, OperandKey
from numscope.plan import HIGH
from numscope.study.operands import Operands

LIMIT_METRICS: dict[str, tuple[str, str]] = {
    # advisor criterion: (metric, the direction a worse value goes)
    "min_sqnr_db": ("sqnr_db", "down"),
    "max_underflow_pct": ("underflow%", "up"),
    "max_overflow_pct": ("overflow%", "up"),
    "max_be_ratio": ("be_ratio", "up"),
}


def worst_metrics(
    analysis: Analysis, operands: Operands, formats: Mapping[OperandKey, str]
) -> dict[str, float]:
    """The worst value, over the quantized operands of a plan and the sampled steps, of each metric an
    advisor limit checks (the criterion's name → value)."""
    from numscope.advisor import be_ratio

    worst = {"min_sqnr_db": math.inf, "max_underflow_pct": 0.0, "max_overflow_pct": 0.0, "max_be_ratio": 0.0}
    for key in operands.keys:
        label = formats[key]
        if label == HIGH:
            continue
        worst["min_sqnr_db"] = min(worst["min_sqnr_db"], *analysis.metric_values(key, label, "sqnr_db"))
        worst["max_underflow_pct"] = max(
            worst["max_underflow_pct"], *analysis.metric_values(key, label, "underflow%")
        )
        worst["max_overflow_pct"] = max(
            worst["max_overflow_pct"], *analysis.metric_values(key, label, "overflow%")
        )
        ratio = be_ratio(analysis, key, label)
        if ratio is not None:
            worst["max_be_ratio"] = max(worst["max_be_ratio"], ratio)
    return worst


def derive_limits(outcomes: Sequence[tuple[str, bool, Mapping[str, float]]]) -> dict[str, Any]:
    """The loosest advisor limits that accept every format that trained at FP32 parity.

    outcomes: (plan name, at parity?, :func:`worst_metrics` of the plan). Each limit is set at the worst
    value any parity plan reached (rounded outwards: SQNR down to 0.5 dB, the others up to 2 significant
    digits), so that no format shown to train at parity is rejected; returned with the plans that fell
    behind and which derived limit (if any) still rejects each of them.
    """
    parity = [m for _, ok, m in outcomes if ok]
    if not parity:
        return {"limits": {}, "parity": [], "behind": [], "note": "no uniform format trained at FP32 parity"}
    limits: dict[str, float] = {}
    for criterion, (_, direction) in LIMIT_METRICS.items():
        values = [m[criterion] for m in parity if math.isfinite(m[criterion])]
        if not values:
            continue
        if direction == "down":
            limits[criterion] = math.floor(min(values) * 2) / 2
        else:
            top = max(values)
            limits[criterion] = _round_up(top) if top > 0 else 0.0
    behind = []
    for name, ok, metrics in outcomes:
        if ok:
            continue
        failed = [
            criterion
            for criterion, limit in limits.items()
            if (
                metrics[criterion] < limit
                if LIMIT_METRICS[criterion][1] == "down"
                else metrics[criterion] > limit
            )
        ]
        behind.append({"plan": name, "rejected_by": failed})
    return {"limits": limits, "parity": [n for n, ok, _ in outcomes if ok], "behind": behind}


def _round_up(value: float) -> float:
    digits = 1 - math.floor(math.log10(value))
    factor = 10.0**digits
    return math.ceil(value * factor) / factor


def limits_text(derived: Mapping[str, Any]) -> str:
    if not derived.get("limits"):
        return f"\nAdvisor limits from these outcomes: none ({derived.get('note', 'no data')})."
    limits = ", ".join(f"{k} {v:g}" for k, v in derived["limits"].items())
    behind = "; ".join(
        f"{b['plan']} (rejected by {', '.join(b['rejected_by']) or 'none of them'})"
        for b in derived["behind"]
    )
    return (
        f"\nAdvisor limits from these outcomes (the loosest that accept every uniform format at FP32 parity: "
        f"{', '.join(derived['parity'])}): {limits}. Behind FP32 beyond the noise: {behind or 'none'}."
    )
