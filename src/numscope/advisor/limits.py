"""The advisor's limits and what each candidate format scores on one operand against them: the criteria
(:class:`Limits`, their meaningful ranges), each limit checked on the worst sampled step (:class:`Check`),
the backward-error ratio to the reference format, per-operand overrides and the candidates allowed."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from numscope.analysis import Analysis, OperandKey, Sensitivity, operand_name
from numscope.errors import NumscopeError
from numscope.formats.spec import get_format
from numscope.plan import HIGH
from numscope.vocab import OPERANDS, Metric

SQNR, UNDERFLOW, OVERFLOW = Metric.SQNR.value, Metric.UNDERFLOW.value, Metric.OVERFLOW.value


HIGH_BITS = 32.0


class AdvisorError(NumscopeError, ValueError):
    """Criteria the advisor cannot use, or limits no assignment can meet."""


@dataclass(frozen=True)
class Limits:
    """Per-operand limits (``None`` switches one off); see the module docstring for their meaning."""

    max_be_ratio: float | None = 140.0
    max_underflow_pct: float | None = 54.0
    max_overflow_pct: float | None = 0.0
    min_sqnr_db: float | None = 24.0
    max_loss_increase_pct: float | None = None
    min_grad_cosine: float | None = None

    def replace(self, changes: Mapping[str, Any], where: str) -> Limits:
        unknown = sorted(set(changes) - set(CRITERIA))
        if unknown:
            raise AdvisorError(f"unknown criterion {unknown[0]!r}{where}; allowed: {', '.join(CRITERIA)}")
        values = {name: getattr(self, name) for name in CRITERIA}
        for name, value in changes.items():
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value)
            ):
                raise AdvisorError(f"criterion {name}{where} must be a number or None, got {value!r}")
            values[name] = None if value is None else float(value)
            if value is not None and not _RANGES[name][0](float(value)):
                raise AdvisorError(f"criterion {name}{where} is {value!r}; allowed: {_RANGES[name][1]}")
        return Limits(**values)


CRITERIA: tuple[str, ...] = (
    "max_be_ratio",
    "max_underflow_pct",
    "max_overflow_pct",
    "min_sqnr_db",
    "max_loss_increase_pct",
    "min_grad_cosine",
)


SENSITIVITY_CRITERIA = {"max_loss_increase_pct": "loss_change%", "min_grad_cosine": "grad_cosine_min"}


#: each criterion's meaningful values: a share is 0-100%; an SQNR above 200 dB no format reaches (fp32's own
#: rounding is about 150 dB), so such a limit can only mean a typo
_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "max_be_ratio": (lambda v: v > 0, "a ratio > 0 (the reference format's backward error is 1)"),
    "max_underflow_pct": (lambda v: 0 <= v <= 100, "a share from 0 to 100 (%)"),
    "max_overflow_pct": (lambda v: 0 <= v <= 100, "a share from 0 to 100 (%)"),
    "min_sqnr_db": (lambda v: -200 <= v <= 200, "dB from -200 to 200 (fp32 itself reaches about 150)"),
    "max_loss_increase_pct": (lambda v: math.isfinite(v), "a finite percentage"),
    "min_grad_cosine": (lambda v: -1 <= v <= 1, "a cosine from -1 to 1"),
}


OVERRIDE_KEYS: tuple[str, ...] = (*CRITERIA, "candidates")


@dataclass(frozen=True)
class Check:
    """One limit checked for one candidate on its worst step."""

    metric: str
    value: float
    limit: float
    passed: bool

    def describe(self) -> str:
        if math.isnan(self.value):
            return f"{_METRIC_LABEL[self.metric]} not measured"
        if self.metric.startswith("min_"):
            sign = ">=" if self.passed else "<"
        else:
            sign = "<=" if self.passed else ">"
        unit = "× reference" if self.metric == "max_be_ratio" else ""
        return f"{_METRIC_LABEL[self.metric]} {_number(self.value)} {sign} {_number(self.limit)}{unit}"


_METRIC_LABEL = {
    "max_be_ratio": "be_ratio",
    "max_underflow_pct": UNDERFLOW,
    "max_overflow_pct": OVERFLOW,
    "min_sqnr_db": SQNR,
    **SENSITIVITY_CRITERIA,
}


@dataclass
class _Option:
    label: str
    bits: float
    noise: float
    mean_sqnr: float
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)


def _number(value: float) -> str:
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return f"{value:.3g}"


def _bits(label: str) -> float:
    if label == HIGH:
        return HIGH_BITS
    return float(get_format(label).bits_per_element)


def _is_left(gemm: str, operand: str) -> bool:
    return OPERANDS[gemm][0] == operand


def be_ratio(analysis: Analysis, key: OperandKey, label: str, reference: str = "bf16") -> float | None:
    """The worst-step ratio of the GEMM's mean backward error with ``label`` on this operand (the other
    operand left high) to the same with ``reference``: what the ``max_be_ratio`` limit checks. None when
    the analysis holds no backward error of both for that GEMM.

    A step whose product had no entry with a nonzero denominator (mean NaN: the product is exactly 0 in
    every format) counts as ratio 0.
    """
    site, gemm, operand = key
    pairs = analysis.backward_errors.get((site, gemm))
    if not pairs:
        return None
    left = _is_left(gemm, operand)
    own = (label, "fp32") if left else ("fp32", label)
    ref = (reference, "fp32") if left else ("fp32", reference)
    if own not in pairs or ref not in pairs:
        return None
    worst = 0.0
    for step, stats in pairs[own].items():
        base = pairs[ref].get(step)
        if base is None:
            continue
        worst = max(worst, _ratio(stats["mean"], base["mean"]))
    return worst


def _ratio(value: float, base: float) -> float:
    """value / base, with 0/0 = 0 (both exact), x/0 = inf, and 0 where neither was measured (NaN)."""
    if math.isnan(value) and math.isnan(base):
        return 0.0
    if base > 0:
        return value / base
    return 0.0 if value == 0 else math.inf


def _option(
    analysis: Analysis,
    key: OperandKey,
    label: str,
    limits: Limits,
    reference: str,
    sensitivity: Sensitivity | None = None,
) -> _Option:
    checks: list[Check] = []
    sqnr = analysis.metric_values(key, label, SQNR)
    if limits.min_sqnr_db is not None:
        checks.append(Check("min_sqnr_db", min(sqnr), limits.min_sqnr_db, min(sqnr) >= limits.min_sqnr_db))
    if limits.max_underflow_pct is not None:
        worst, limit = max(analysis.metric_values(key, label, UNDERFLOW)), limits.max_underflow_pct
        checks.append(Check("max_underflow_pct", worst, limit, worst <= limit))
    if limits.max_overflow_pct is not None:
        worst, limit = max(analysis.metric_values(key, label, OVERFLOW)), limits.max_overflow_pct
        checks.append(Check("max_overflow_pct", worst, limit, worst <= limit))
    if limits.max_be_ratio is not None:
        ratio = be_ratio(analysis, key, label, reference)
        # a GEMM without any backward error (a convolution's is not measured) is decided by the other limits
        unmeasured = (key[0], key[1]) not in analysis.backward_errors and reference in analysis.candidates
        if ratio is not None:
            checks.append(Check("max_be_ratio", ratio, limits.max_be_ratio, ratio <= limits.max_be_ratio))
        elif not unmeasured:
            raise AdvisorError(
                f"no backward error of {label!r} and of the reference {reference!r} for {'/'.join(key[:2])}; "
                f"observe with {reference!r} among the candidates, or pass max_be_ratio=None"
            )
    for criterion, metric in SENSITIVITY_CRITERIA.items():
        limit = getattr(limits, criterion)
        if limit is None:
            continue
        measured = sensitivity.lookup(key, label) if sensitivity is not None else None
        value = measured.get(metric, math.nan) if measured is not None else math.nan
        passed = value >= limit if criterion.startswith("min_") else value <= limit
        checks.append(Check(criterion, value, limit, passed))
    mean_sqnr = _mean_sqnr(sqnr)
    return _Option(label, _bits(label), 10.0 ** (-mean_sqnr / 10.0), mean_sqnr, checks)


def _mean_sqnr(values: Sequence[float]) -> float:
    """The mean SQNR (dB) over the sampled steps with a finite one (all of them when none is: +inf at every
    step is an exact format). A block format's sample is whole rows, and on a sparse gradient (a masked
    LM's, 88% zeros) a step's rows can all be zero: its +inf would make the operand look free."""
    finite = [value for value in values if math.isfinite(value)]
    chosen = finite or list(values)
    return sum(chosen) / len(chosen)


def _slack(check: Check) -> float:
    """How far a passing check is from its limit, relative (0 = at the limit)."""
    if check.metric == "min_sqnr_db":
        return check.value - check.limit
    if check.metric == "min_grad_cosine":
        return math.log((1.0 - check.limit + 1e-30) / (1.0 - check.value + 1e-30))
    if check.metric == "max_loss_increase_pct":
        return (check.limit - check.value) / (abs(check.limit) + 1e-30)
    if check.limit == 0:
        return 0.0 if check.value == 0 else -math.inf
    return math.log((check.limit + 1e-30) / (check.value + 1e-30))


def _limits_for(
    analysis: Analysis,
    key: OperandKey,
    base: Limits,
    per_operand: Mapping[str, Mapping[str, Any]] | None,
    candidates: tuple[str, ...],
) -> tuple[Limits, tuple[str, ...]]:
    limits, allowed = base, candidates
    name = operand_name(key)
    for pattern, changes in (per_operand or {}).items():
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        changes = dict(changes)
        if "candidates" in changes:
            allowed = _candidates(analysis, changes.pop("candidates"), f"per_operand {pattern!r} candidates")
        limits = limits.replace(changes, f" (per_operand {pattern!r})")
    return limits, allowed


def _check_overrides(per_operand: Mapping[str, Mapping[str, Any]] | None, names: Iterable[str]) -> None:
    if per_operand is None:
        return
    if not isinstance(per_operand, Mapping):
        raise AdvisorError(f"per_operand must map glob patterns to criteria, got {per_operand!r}")
    names = list(names)
    for pattern, changes in per_operand.items():
        if not isinstance(changes, Mapping):
            raise AdvisorError(f"per_operand[{pattern!r}] must map criteria to values, got {changes!r}")
        unknown = sorted(set(changes) - set(OVERRIDE_KEYS))
        if unknown:
            raise AdvisorError(
                f"unknown criterion {unknown[0]!r} (per_operand {pattern!r}); "
                f"allowed: {', '.join(OVERRIDE_KEYS)}"
            )
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise AdvisorError(
                f"per_operand pattern {pattern!r} matches no operand; operands look like "
                f"{names[0] if names else '(none)'!r} (site/gemm/operand)"
            )


def _format_name(name: Any, what: str) -> str:
    """The canonical name of the format ``name`` (``high`` as is); AdvisorError naming ``what`` if unknown."""
    if name == HIGH:
        return HIGH
    if not isinstance(name, str):
        raise AdvisorError(f"{what}: a format name is a string, got {name!r}")
    try:
        return get_format(name).name
    except ValueError as error:
        raise AdvisorError(f"{what}: {error}") from None


def _candidates(
    analysis: Analysis, candidates: Sequence[str] | None, what: str = "candidates"
) -> tuple[str, ...]:
    measured = tuple(c for c in analysis.candidates if c != "plan")
    if candidates is None:
        return measured
    if isinstance(candidates, str) or not isinstance(candidates, Iterable):
        raise AdvisorError(f"{what} must be a list of format names, got {candidates!r}")
    chosen = []
    for name in candidates:
        label = _format_name(name, what)
        if label not in measured:
            raise AdvisorError(
                f"candidate {name!r} was not measured by the observer; measured: "
                f"{', '.join(measured) or '(none)'}"
            )
        chosen.append(label)
    return tuple(dict.fromkeys(chosen))


def _check_sensitivity(sensitivity: Sensitivity | None, limits: Limits, candidates: Sequence[str]) -> None:
    wanted = [name for name in SENSITIVITY_CRITERIA if getattr(limits, name) is not None]
    if not wanted:
        return
    if sensitivity is None:
        raise AdvisorError(
            f"criterion {wanted[0]} needs a sensitivity measurement, which this analysis lacks: analyze "
            "again with it (numscope analyze `SensitivitySettings.batches` N, `SensitivitySettings.formats` "
            "all; it is on by default "
            "except under torchrun), or in Python run numscope.sensitivity(model, batches, candidates=[...]) "
            "and pass sensitivity=..."
        )
    missing = [c for c in candidates if c not in sensitivity.candidates]
    if missing:
        raise AdvisorError(
            f"criterion {wanted[0]}: the sensitivity did not measure {', '.join(map(repr, missing))}; "
            f"measured: {', '.join(sensitivity.candidates) or '(none)'}; measure them (numscope analyze "
            "`SensitivitySettings.formats` all) or restrict the candidates to those measured"
        )
