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

``None`` switches a limit off. **Why these defaults**: they are derived from training outcomes (the
loosest limits that accept, on every operand and sampled step of the FP32 run, the formats that trained at
parity with FP32 in ``numscope study plans``), not from synthetic tensors; docs/results/plan-study.md ("Limits
derived from outcomes") has the measurements. On another model, calibrate: ``numscope study plans`` prints
the limits its outcomes imply, and ``numscope calibrate`` fits the loss-impact weights of the bit budget.

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

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any

from numscope.advisor.budget import DP_CELLS, _apply_budget
from numscope.advisor.choice import Choice, Recommendation, _decide, _plan
from numscope.advisor.limits import (
    CRITERIA,
    HIGH_BITS,
    OVERRIDE_KEYS,
    SENSITIVITY_CRITERIA,
    AdvisorError,
    Check,
    Limits,
    _candidates,
    _check_overrides,
    _check_sensitivity,
    _format_name,
    _limits_for,
    _Option,
    _option,
    be_ratio,
)
from numscope.advisor.objectives import (
    _noise_weights,
    _weight_for,
    objective_covers,
    operand_impact,
    operand_noise,
    sensitivity_objective,
)
from numscope.analysis import Analysis, AnalysisError, OperandKey, Sensitivity, operand_name
from numscope.plan import DEFAULT_PATTERN, HIGH, OperandSpec, Plan

__all__ = [
    "CRITERIA",
    "DP_CELLS",
    "HIGH_BITS",
    "OVERRIDE_KEYS",
    "SENSITIVITY_CRITERIA",
    "AdvisorError",
    "Check",
    "Choice",
    "Limits",
    "Recommendation",
    "advise",
    "advise_within_gap",
    "be_ratio",
    "operand_impact",
    "operand_noise",
    "recommend",
    "recommend_table",
    "sensitivity_objective",
]


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
    high_bits: float = HIGH_BITS,
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
    high_bits: what an operand left high costs against the budget with a stack ``target``: 32 (FP32), or
        16 where the stack runs what it does not quantize in BF16 (its autocast dtype).
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
    if high_bits != HIGH_BITS and (stack is None or stack.is_emulation):
        raise AdvisorError(
            f"high_bits {high_bits!r}: only with a stack target (te, torchao, megatron), which runs what it "
            "does not quantize in its autocast dtype; emulation plans keep high operands in FP32"
        )
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
                high_bits=high_bits,
            )
        except AnalysisError as error:
            raise AdvisorError(str(error)) from error
    choices: list[Choice] = []
    passing_per_key: list[list[_Option]] = []
    for key in keys:
        if not objective_covers(objective, key):  # nothing measured to weigh it by: it stays high
            site, gemm, operand = key
            reason = "kept high: the sensitivity the objective weighs by did not measure this operand"
            elements = analysis.elements.get(key, 0)
            choices.append(Choice(site, gemm, operand, HIGH, HIGH_BITS, elements, "none", math.nan, reason))
            passing_per_key.append([])
            continue
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
    high_bits: float = HIGH_BITS,
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
        high_bits=high_bits,
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
