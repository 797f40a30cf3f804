"""The advisor: turn an :class:`~numscope.analysis.Analysis` into a :class:`~numscope.plan.Plan`.

For each operand key ``(site, gemm, operand)`` the advisor looks at every candidate format the observer
measured and keeps those that meet every **limit** on every sampled step (the worst step decides):

==================  ===========  ==========================================================================
criterion           default      the candidate passes when, on every sampled step, …
==================  ===========  ==========================================================================
max_be_ratio        140          mean backward error of the GEMM with this operand quantized (the other
                                 one left high) ≤ this many times the same with the reference format
max_underflow_pct   54           ``underflow%`` (nonzeros that become 0) ≤ this
max_overflow_pct    0            ``overflow%`` (elements that saturate or become inf) ≤ this
min_sqnr_db         24           ``sqnr_db`` ≥ this
max_loss_increase_  None (off)   sensitivity (see below): ``loss_change%`` ≤ this, the mean loss with the
pct                              operand's site (or the operand alone) quantized in the candidate, in
                                 percent above the FP32 loss over the measured batches
min_grad_cosine     None (off)   sensitivity: ``grad_cosine_min`` ≥ this, the smallest cosine similarity of
                                 the full parameter gradient to the FP32 one over the measured batches
==================  ===========  ==========================================================================

``None`` switches a limit off. **Why these defaults**: they are derived from training outcomes, not
from synthetic tensors. ``numscope study plans`` (:mod:`numscope.plan_study`, docs/plan-study.md) trained
the demo's BERT (2 layers, hidden 128, 1,000-token vocabulary, 300 steps) under every uniform format on
three seeds, paired with FP32: bf16 and the fp8 hybrid (E4M3 forward, E5M2 gradients, per-tensor scaling)
tied with FP32 (paired gaps within 2 sd), while mxfp8 (+0.0043 nats), mxfp6, nvfp4 and mxfp4 (+0.035) fell
behind beyond the noise. The defaults are the loosest limits that accept both formats at parity on every
operand and sampled step of that model's FP32 run — their worst values were SQNR 24.25 dB (E5M2
gradients), underflow 53.7% (E4M3 on the attention probabilities), overflow 0% and a backward-error ratio
138× bf16's — rounded outwards (SQNR down to 0.5 dB, the others up to two significant digits). They still
reject every format that fell behind (each by SQNR, and the MX/NVFP4 ones also by the clamping of the OCP
scale rule, counted as overflow). The earlier defaults, set between groups of formats on Gaussian and
Student-t tensors (BE ratio 40, underflow 2%, overflow 0.1%, SQNR 22 dB), rejected E4M3 where it flushes
attention values and trains at parity. On another model, calibrate: ``numscope study plans`` prints the
limits its outcomes imply, and ``numscope calibrate`` fits the loss-impact weights of the bit budget.

**Sensitivity criteria** judge a candidate by what quantizing it does to training, measured by
:func:`numscope.sensitivity` (one site or one operand quantized at a time, the loss and gradient compared
with FP32). They need that measurement: ``sensitivity=`` or ``analysis.sensitivity``; every candidate
judged must have been measured (an error names the missing ones), and an operand whose site (and operand)
was not measured fails the criterion ("not measured"). A site-level measurement quantizes all six operands
of the site at once, a conservative stand-in for each of them; an operand-level one is used where present.

**Backward error per operand.** BE is a GEMM-level metric of a pair of operand formats; the observer
records each candidate on one operand with the other operand left high, ``(fmt, fp32)`` and ``(fp32,
fmt)``. An operand's ratio is that BE over the reference format's in the same position. To first order
Q(L)Q(R) − LR ≈ δL·R + L·δR, so the BE of a pair is about the sum of its two one-sided BEs: limiting each
operand's ratio to r keeps the GEMM's ratio within about r as well, and lets operands be chosen
independently.

**Choice.** Without a budget each operand gets the cheapest passing candidate (fewest
``bits_per_element``, block scales included; ties go to the higher SQNR). When no candidate passes, the
operand stays ``high`` (unquantized), and the reason says which limit failed for the best candidate.

**Bit budget.** ``bit_budget`` is a cap on the average bits per operand element, weighted by each
operand's element count (as :meth:`numscope.Plan.average_bits`, high = 32 bits). Among the passing
candidates the advisor then minimises the total relative noise power Σ 10^(−SQNR/10) over operands (each
operand's mean SQNR over steps; every operand counts alike, because each enters its GEMM's relative error
alike) subject to the cap. It is solved as a multiple-choice knapsack by dynamic programming over integer
bit costs: exact (optimal) when the costs, reduced by their greatest common divisor, fit
:data:`DP_CELLS` cells; otherwise costs are rounded *up* to a coarser unit, which keeps the result within
budget but may miss the optimum (``Recommendation.optimal`` is then False). A budget below the cheapest
passing assignment is an error.

Each choice carries its reason (the deciding metric and value) into the plan rule's ``reasons``;
:func:`recommend_table` lists them for printing.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from typing import Any

import numpy as np

from numscope.analysis import Analysis, AnalysisError, OperandKey, Sensitivity, operand_name
from numscope.errors import NumscopeError
from numscope.formats.spec import get_format
from numscope.plan import DEFAULT_PATTERN, HIGH, OperandSpec, Plan
from numscope.vocab import OPERANDS, Metric

SQNR, UNDERFLOW, OVERFLOW = Metric.SQNR.value, Metric.UNDERFLOW.value, Metric.OVERFLOW.value
HIGH_BITS = 32.0
DP_CELLS = 1 << 18
"""The largest knapsack table (cells per operand) the bit-budget solver uses before coarsening costs."""


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


def _check_sensitivity(sensitivity: Sensitivity | None, limits: Limits, candidates: Sequence[str]) -> None:
    wanted = [name for name in SENSITIVITY_CRITERIA if getattr(limits, name) is not None]
    if not wanted:
        return
    if sensitivity is None:
        raise AdvisorError(
            f"criterion {wanted[0]} needs a sensitivity measurement, which this analysis lacks: analyze "
            "again with it (numscope analyze --sensitivity N --sensitivity-formats all; it is on by default "
            "except under torchrun), or in Python run numscope.sensitivity(model, batches, candidates=[...]) "
            "and pass sensitivity=..."
        )
    missing = [c for c in candidates if c not in sensitivity.candidates]
    if missing:
        raise AdvisorError(
            f"criterion {wanted[0]}: the sensitivity did not measure {', '.join(map(repr, missing))}; "
            f"measured: {', '.join(sensitivity.candidates) or '(none)'}; measure them (numscope analyze "
            "--sensitivity-formats all) or restrict the candidates to those measured"
        )


def advise(
    analysis: Analysis,
    *,
    candidates: Sequence[str] | None = None,
    reference: str = "bf16",
    bit_budget: float | None = None,
    per_operand: Mapping[str, Mapping[str, Any]] | None = None,
    sensitivity: Sensitivity | None = None,
    noise_weights: Mapping[str, float] | None = None,
    objective: Callable[[OperandKey, str], float] | None = None,
    target: str | None = None,
    objective_name: str | None = None,
    **criteria: float | None,
) -> Recommendation:
    """Choose a format for every operand the analysis holds; see the module docstring for the rules.

    candidates: restrict to these measured formats (default: every candidate the observer measured).
    reference: the format backward errors are compared against (must have been measured).
    bit_budget: cap on average bits per operand element (weighted by element counts), solved for the
        least total noise; ``None`` picks the cheapest passing format per operand.
    per_operand: glob over ``site/gemm/operand`` → overrides of the criteria (and ``candidates``), e.g.
        ``{"*/wgrad/grad_output": {"max_underflow_pct": 5}}``; later patterns override earlier ones.
    sensitivity: what quantizing one site at a time did to the loss and gradient
        (:func:`numscope.sensitivity`), for the sensitivity criteria (default: ``analysis.sensitivity``).
    criteria: ``max_be_ratio``, ``max_underflow_pct``, ``max_overflow_pct``, ``min_sqnr_db``,
        ``max_loss_increase_pct``, ``min_grad_cosine`` (number or ``None`` to switch off).
    noise_weights: glob over ``site/gemm/operand`` → a factor on that operand's noise in the bit-budget
        objective (later patterns override earlier ones; default 1): what a loss-impact calibration
        (:mod:`numscope.study`) fits, e.g. ``{"*/wgrad/*": 0.2}`` when wgrad noise costs less loss.
    objective: ``objective(key, format) -> float``, the quantity the bit budget minimises the sum of,
        instead of the (weighted) noise power: e.g. a fitted loss impact from measured sensitivities
        (:class:`numscope.study.SensitivityModel`). ``high`` costs 0.
    target: a training stack (:mod:`numscope.plan.targets`: ``te``, ``torchao``, ``megatron``,
        ``emulation``): choose only among the recipes it runs, at its granularity
        (:mod:`numscope.advisor.target`), so that the plan exports to it whole. ``None`` or
        ``emulation``: every measured candidate, per operand.
    objective_name: what a target plan's reasons call ``objective`` (default ``sensitivity``; ``noise``
        without an objective).
    """
    if not isinstance(analysis, Analysis):
        raise TypeError(f"advise expects a numscope.Analysis, got {type(analysis).__name__}")
    if sensitivity is not None and not isinstance(sensitivity, Sensitivity):
        raise TypeError(f"sensitivity must be a numscope.Sensitivity, got {type(sensitivity).__name__}")
    sensitivity = sensitivity if sensitivity is not None else analysis.sensitivity
    limits = Limits().replace(criteria, "")
    labels = _candidates(analysis, candidates)
    reference = _format_name(reference, "reference")
    keys = analysis.keys()
    if not keys:
        raise AdvisorError("the analysis holds no operands; observe at least one sampled step first")
    _check_overrides(per_operand, (operand_name(k) for k in keys))
    weights = _noise_weights(noise_weights)
    if bit_budget is not None and (
        isinstance(bit_budget, bool) or not isinstance(bit_budget, int | float) or not bit_budget > 0
    ):
        raise AdvisorError(f"bit_budget must be a positive number of bits per element, got {bit_budget!r}")
    stack = _target(target)
    if stack is not None and not stack.is_emulation:
        if per_operand:
            raise AdvisorError(
                f"per_operand overrides choose formats per operand; target {stack.name!r} decides per "
                f"{stack.granularity}: drop one of them"
            )
        from numscope.advisor.target import advise_for_target

        def scored(key: OperandKey, label: str) -> float:
            if objective is not None:
                return float(objective(key, label))
            return operand_noise(analysis, key, label) * _weight_for(operand_name(key), weights)

        _check_sensitivity(sensitivity, limits, labels)
        try:
            return advise_for_target(  # type: ignore[return-value]
                analysis,
                stack,
                candidates=labels,
                limits=limits,
                reference=reference,
                bit_budget=None if bit_budget is None else float(bit_budget),
                sensitivity=sensitivity,
                objective=scored,
                objective_name=objective_name or ("sensitivity" if objective is not None else "noise"),
            )
        except AnalysisError as error:
            raise AdvisorError(str(error)) from error
    choices: list[Choice] = []
    passing_per_key: list[list[_Option]] = []
    for key in keys:
        key_limits, allowed = _limits_for(analysis, key, limits, per_operand, labels)
        _check_sensitivity(sensitivity, key_limits, allowed)
        try:
            options = [_option(analysis, key, label, key_limits, reference, sensitivity) for label in allowed]
        except AnalysisError as error:
            raise AdvisorError(f"{operand_name(key)}: {error}") from error
        factor = _weight_for(operand_name(key), weights)
        for option in options:
            option.noise = (
                float(objective(key, option.label)) if objective is not None else option.noise * factor
            )
        choice, passing = _decide(key, options, analysis.elements.get(key, 0))
        choices.append(choice)
        passing_per_key.append(passing)
    optimal = True
    if bit_budget is not None:
        name = objective_name or ("sensitivity" if objective is not None else "noise")
        limited = bool(per_operand) or any(getattr(limits, f.name) is not None for f in fields(limits))
        choices, optimal = _apply_budget(
            choices, passing_per_key, float(bit_budget), name, "all limits met" if limited else "limits off"
        )
    total = sum(c.elements for c in choices)
    average = sum(c.bits * c.elements for c in choices) / total if total else math.nan
    return Recommendation(_plan(choices), tuple(choices), average, bit_budget, optimal, limits, reference)


def advise_within_gap(
    analysis: Analysis,
    *,
    predict: Callable[[Plan], float],
    max_gap: float,
    resolution: float = 1 / 64,
    **options: Any,
) -> tuple[Recommendation, float]:
    """The cheapest plan whose predicted gap to FP32 is at most ``max_gap``, and that gap.

    predict: a plan's predicted gap (nats), e.g. a calibrated gap model's
    (:meth:`numscope.study.GapModel.predict_plan`); the objective :func:`advise` minimises (``objective``,
    ``noise_weights``) must be the sum that ``predict`` computes, so that the least objective within a
    budget falls as the budget grows. Bisection on the bit budget, to ``resolution`` bits per element: each
    step solves the budget exactly as :func:`advise` does and keeps the smaller budget whose plan is
    predicted within ``max_gap``. options: as :func:`advise` takes them (not ``bit_budget``).
    """
    if "bit_budget" in options:
        raise AdvisorError("a gap target chooses the bit budget itself: give max_gap or bit_budget, not both")
    if isinstance(max_gap, bool) or not isinstance(max_gap, int | float) or not math.isfinite(max_gap):
        raise AdvisorError(f"max_gap must be a finite number of nats, got {max_gap!r}")
    top = advise(analysis, bit_budget=HIGH_BITS, **options)
    top_gap = float(predict(top.plan))
    if top_gap > max_gap:
        raise AdvisorError(
            f"no plan is predicted within a gap of {max_gap:g} nats: the least predicted gap among these "
            f"candidates is {top_gap:.4g} nats; raise the gap"
        )
    low, high, best = 0.0, HIGH_BITS, (top, top_gap)
    while high - low > resolution:
        middle = (low + high) / 2
        try:
            found = advise(analysis, bit_budget=middle, **options)
        except AdvisorError:  # below the cheapest plan the candidates allow
            low = middle
            continue
        gap = float(predict(found.plan))
        if gap <= max_gap:
            high, best = middle, (found, gap)
        else:
            low = middle
    return best


def _target(name: str | None) -> Any:
    if name is None:
        return None
    from numscope.plan.spec import PlanError
    from numscope.plan.targets import get_target

    try:
        return get_target(name)
    except PlanError as error:
        raise AdvisorError(str(error)) from None


def _noise_weights(weights: Mapping[str, float] | None) -> list[tuple[str, float]]:
    if weights is None:
        return []
    if not isinstance(weights, Mapping):
        raise AdvisorError(f"noise_weights must map 'site/gemm/operand' globs to numbers, got {weights!r}")
    out = []
    for pattern, value in weights.items():
        if (
            not isinstance(pattern, str)
            or isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise AdvisorError(
                f"noise_weights: {pattern!r}: {value!r} must be a finite number >= 0 keyed by a glob string"
            )
        out.append((pattern, float(value)))
    return out


def _weight_for(name: str, weights: list[tuple[str, float]]) -> float:
    factor = 1.0
    for pattern, value in weights:
        if fnmatch.fnmatchcase(name, pattern):
            factor = value
    return factor


def operand_noise(analysis: Analysis, key: OperandKey, label: str) -> float:
    """The relative noise power the bit-budget objective counts for ``label`` on one operand:
    10^(−SQNR/10) of its mean SQNR (dB, :func:`_mean_sqnr`); 0 for ``high``."""
    if label == HIGH:
        return 0.0
    return 10.0 ** (-_mean_sqnr(analysis.metric_values(key, label, SQNR)) / 10.0)


def operand_impact(
    sensitivity: Sensitivity, key: OperandKey, label: str, analysis: Analysis | None = None
) -> float:
    """An operand's measured loss impact in ``label``: the squared relative error that quantizing it alone
    adds to the parameter gradient of the trained model (``grad_rel_error`` of an operand-granularity
    :class:`~numscope.analysis.Sensitivity`), the noise power it adds to the update; 0 for ``high``.

    Where ``label`` was not measured for the operand but another format was, and ``analysis`` is given, the
    impact is **estimated**: the measured one of the noisiest format measured, times the ratio of the two
    formats' relative noise power on that operand in the analysis (:func:`operand_noise`). The gradient
    error an operand's noise causes is close to proportional to that noise's power: on two models (the
    demo's BERT, 107 operands, and a GQA Llama, 114) the estimate from MXFP4 ranks the measured impacts of
    the other 9 formats with Spearman 0.86–0.98 and lies within a factor 2 for 53–96% of the operands, on
    the high side on average (docs/plan-study.md), so that one measured format per operand serves them all.
    """
    if label == HIGH:
        return 0.0
    if sensitivity.granularity != "operand":
        raise AdvisorError(
            f"the sensitivity was measured per {sensitivity.granularity}; the sensitivity objective needs "
            "it per operand (numscope.sensitivity(..., granularity='operand'); numscope analyze "
            "--sensitivity N --sensitivity-granularity operand)"
        )
    measured = sensitivity.results.get(key, {})
    metrics = measured.get(label)
    if metrics is not None and "grad_rel_error" in metrics:
        return float(metrics["grad_rel_error"]) ** 2
    reference = _estimate_reference(analysis, key, label, measured) if analysis is not None else None
    if reference is None:
        raise AdvisorError(
            f"{operand_name(key)}: no sensitivity in {label!r} (measured: "
            f"{', '.join(sensitivity.candidates) or 'none'}); measure it among the sensitivity's candidates"
            + ("" if analysis is not None else ", or pass the analysis to estimate it from the measured ones")
        )
    ref_label, ref_noise = reference
    impact = float(measured[ref_label]["grad_rel_error"]) ** 2
    return impact * operand_noise(analysis, key, label) / ref_noise


def _estimate_reference(
    analysis: Analysis, key: OperandKey, label: str, measured: Mapping[str, Mapping[str, float]]
) -> tuple[str, float] | None:
    """The measured format an estimate of ``label`` scales from (the noisiest, for the measurement's own
    signal-to-noise) and its noise power; None where nothing usable was measured or observed."""
    if label not in analysis.candidates:
        return None
    options = []
    for other, metrics in measured.items():
        if "grad_rel_error" not in metrics or other not in analysis.candidates:
            continue
        noise = operand_noise(analysis, key, other)
        if noise > 0 and math.isfinite(noise):
            options.append((noise, other))
    if not options:
        return None
    noise, other = max(options)
    return other, noise


def sensitivity_objective(
    sensitivity: Sensitivity,
    role_weights: Mapping[str, float] | None = None,
    analysis: Analysis | None = None,
) -> Callable[[OperandKey, str], float]:
    """The bit-budget objective of measured sensitivities: :func:`operand_impact` times its GEMM role's
    weight (``role_weights``: gemm → factor, e.g. a gap model's fitted coefficients; default 1 each). The plan
    study found this objective, with fitted role weights, ranking plans as their trained loss gaps did
    (docs/plan-study.md). ``analysis``: estimate the formats the sensitivity did not measure
    (:func:`operand_impact`)."""
    weights = dict(role_weights or {})

    def impact(key: OperandKey, label: str) -> float:
        return weights.get(key[1], 1.0) * operand_impact(sensitivity, key, label, analysis)

    return impact


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


def _plan(choices: Sequence[Choice]) -> Plan:
    return Plan.per_operand({c.key: c.format for c in choices}, {c.key: c.reason for c in choices})


def recommend(
    analysis: Analysis,
    *,
    candidates: Sequence[str] | None = None,
    reference: str = "bf16",
    bit_budget: float | None = None,
    per_operand: Mapping[str, Mapping[str, Any]] | None = None,
    sensitivity: Sensitivity | None = None,
    noise_weights: Mapping[str, float] | None = None,
    objective: Callable[[OperandKey, str], float] | None = None,
    target: str | None = None,
    **criteria: float | None,
) -> Plan:
    """The plan :func:`advise` recommends (one exact-name rule per site; unobserved sites stay high).

    Criteria and their defaults are in the module docstring; unknown criteria raise :class:`AdvisorError`
    listing the allowed ones.
    """
    return advise(
        analysis,
        candidates=candidates,
        reference=reference,
        bit_budget=bit_budget,
        per_operand=per_operand,
        sensitivity=sensitivity,
        noise_weights=noise_weights,
        objective=objective,
        target=target,
        **criteria,
    ).plan


def recommend_table(result: Plan | Recommendation) -> list[dict[str, str]]:
    """Rows (site, gemm, operand, format, bits, reason) for printing what was chosen and why."""
    if isinstance(result, Recommendation):
        return [
            {
                "site": c.site,
                "gemm": c.gemm,
                "operand": c.operand,
                "format": c.format,
                "bits": f"{c.bits:g}",
                "reason": c.reason,
            }
            for c in result.choices
        ]
    if not isinstance(result, Plan):
        raise TypeError(f"recommend_table expects a Plan or a Recommendation, got {type(result).__name__}")
    rows = []
    for row in result.describe():
        if row.pattern == DEFAULT_PATTERN and row.format == HIGH and not row.reason:
            continue
        spec = OperandSpec(row.format)
        rows.append(
            {
                "site": row.pattern,
                "gemm": row.gemm,
                "operand": row.operand,
                "format": row.format,
                "bits": f"{spec.bits_per_element(HIGH_BITS):g}",
                "reason": row.reason,
            }
        )
    return rows
