"""The advisor for a training stack: choose among what the target runs (:mod:`numscope.plan.targets`).

Where the plain advisor chooses a format per operand, a stack couples operands: Transformer Engine and
torchao quantize both operands of a GEMM or neither, in the recipe's format for each role; Megatron-LM
quantizes whole transformer layers and keeps only leading and trailing ones high. So the decision is made
per **unit** — a GEMM of a Linear site (``gemm`` granularity), or a choice of how many leading and trailing
layers stay high (``layer_ends``) — among the options the target has, each scored by the same per-operand
objective as the plain advisor (the measured sensitivity or the noise power, summed over the unit's
operands) and costed in bits × elements. With a bit budget the multiple-choice knapsack of the plain
advisor picks the least total objective within it; without one, every unit takes its cheapest option
that meets the limits. A target that runs one recipe for the whole model is solved once per recipe and
the best solution is kept. Sites the target does not convert (attention products, convolutions, other
matmuls) stay high and count in the average bits like any operand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from numscope._names import layer_index
from numscope.analysis import Analysis, OperandKey, Sensitivity
from numscope.plan import HIGH
from numscope.plan.targets import LINEAR_KINDS, StackRecipe, Target

Objective = Callable[[OperandKey, str], float]


@dataclass
class _Unit:
    """Operands decided together, and the option each recipe gives them (None: a limit failed)."""

    keys: tuple[OperandKey, ...]
    elements: int


def site_kinds(analysis: Analysis) -> dict[str, str]:
    """Site name → kind (``linear``, ``conv1d``, ``matmul``, ``sdpa``, ``conv``…) in the model's call
    order, as the observer recorded them (``analysis.meta["site_kinds"]``)."""
    recorded = analysis.meta.get("site_kinds")
    if not recorded:
        from numscope.advisor import AdvisorError

        raise AdvisorError(
            "this analysis does not record its sites' kinds (made before numscope 0.1 recorded them, or "
            "by hand): a target needs them to know which sites its stack converts; analyze again"
        )
    return {str(name): str(kind) for name, kind in recorded}


@dataclass
class _Solution:
    recipe: StackRecipe
    quantized: set[OperandKey]
    objective: float
    bits: float
    optimal: bool
    high_reasons: dict[OperandKey, str]


def advise_for_target(
    analysis: Analysis,
    target: Target,
    *,
    candidates: Sequence[str],
    limits: object,
    reference: str,
    bit_budget: float | None,
    sensitivity: Sensitivity | None,
    objective: Objective,
    objective_name: str,
) -> object:
    """A :class:`~numscope.advisor.Recommendation` for ``target`` (see the module docstring)."""
    from numscope.advisor import AdvisorError, Choice, Recommendation, _option, _plan

    kinds = site_kinds(analysis)
    usable = [r for r in target.recipes if all(f in candidates for f in r.measured)]
    if not usable:
        wanted = sorted({f for r in target.recipes for f in r.measured})
        raise AdvisorError(
            f"target {target.name!r}: none of its recipes was measured; observe with "
            f"{', '.join(wanted)} among the candidates (numscope analyze --candidates ...); measured: "
            f"{', '.join(candidates) or '(none)'}"
        )
    keys = analysis.keys()
    elements = {key: int(analysis.elements.get(key, 0)) for key in keys}
    total = sum(elements.values())
    if bit_budget is not None and total == 0:
        raise AdvisorError("a bit budget needs element counts; the analysis records none")
    convertible = [k for k in keys if kinds.get(k[0]) in LINEAR_KINDS]
    fixed_high = [k for k in keys if k not in set(convertible)]
    cache: dict[tuple[OperandKey, str], tuple[bool, str, float]] = {}

    def judged(key: OperandKey, label: str) -> tuple[bool, str, float]:
        """(passes the limits, the failed check's text, the objective) of one operand in one format."""
        if (key, label) not in cache:
            option = _option(analysis, key, label, limits, reference, sensitivity)  # type: ignore[arg-type]
            failed = next((c for c in option.checks if not c.passed), None)
            cache[(key, label)] = (
                failed is None,
                failed.describe() if failed else "",
                float(objective(key, label)),
            )
        return cache[(key, label)]

    solutions = []
    for recipe in usable:
        solve = _solve_layer_ends if target.granularity == "layer_ends" else _solve_gemms
        solution = solve(recipe, convertible, elements, total, bit_budget, judged)
        if solution is not None:
            solutions.append(solution)
    if not solutions:
        cheapest = _cheapest_bits(usable, convertible, elements, total, target, judged)
        raise AdvisorError(
            f"bit budget {bit_budget:g} bits/element is impossible for target {target.name!r}: its cheapest "
            f"plan within the limits needs {cheapest:.4g} bits/element (what it cannot convert stays at 32); "
            "raise --bit-budget, or relax the limits (--min-sqnr-db, --max-underflow-pct, "
            "--max-overflow-pct, --max-be-ratio: 'none' switches one off)"
        )
    if bit_budget is None:
        best = min(solutions, key=lambda s: (s.bits, s.objective))
    else:
        best = min(solutions, key=lambda s: (s.objective, s.bits))
    choices = []
    budget_text = "" if bit_budget is None else f" within bit budget {bit_budget:g}"
    for key in keys:
        site, gemm, operand = key
        n = elements[key]
        if key in best.quantized:
            fmt = best.recipe.format_for(operand)
            _, _, value = judged(key, fmt)
            bits = _bits(fmt)
            reason = (
                f"{fmt} ({bits:g} bits): {target.name} recipe {best.recipe.name}; {objective_name} "
                f"{_number(value)}{budget_text}"
            )
            choices.append(Choice(site, gemm, operand, fmt, bits, n, objective_name, value, reason))
        else:
            if key in fixed_high:
                reason = f"high: {target.name} converts Linear layers only (a {kinds.get(site, '?')} site)"
                value = math.nan
            else:
                reason = best.high_reasons.get(key, "high")
                _, _, value = judged(key, best.recipe.format_for(operand))
            choices.append(Choice(site, gemm, operand, HIGH, 32.0, n, objective_name, value, reason))
    from numscope.advisor import Limits

    assert isinstance(limits, Limits)
    return Recommendation(
        _plan(choices), tuple(choices), best.bits, bit_budget, best.optimal, limits, reference
    )


def _bits(label: str) -> float:
    from numscope.advisor import _bits as bits

    return bits(label)


def _number(value: float) -> str:
    return f"{value:.3g}"


def _gemm_units(keys: Sequence[OperandKey], elements: dict[OperandKey, int]) -> list[_Unit]:
    grouped: dict[tuple[str, str], list[OperandKey]] = {}
    for key in keys:
        grouped.setdefault((key[0], key[1]), []).append(key)
    return [_Unit(tuple(members), sum(elements[k] for k in members)) for members in grouped.values()]


def _solve_gemms(
    recipe: StackRecipe,
    convertible: Sequence[OperandKey],
    elements: dict[OperandKey, int],
    total: int,
    budget: float | None,
    judged: Callable[[OperandKey, str], tuple[bool, str, float]],
) -> _Solution | None:
    """Each GEMM of each Linear site in ``recipe`` or high: the knapsack (or cheapest within limits)."""
    from numscope.advisor import HIGH_BITS, _Option, _solve_budget

    units = _gemm_units(convertible, elements)
    fixed = total - sum(u.elements for u in units)
    options: list[list[_Option]] = []
    high_reasons: dict[OperandKey, str] = {}
    for unit in units:
        high = _Option(HIGH, HIGH_BITS, 0.0, math.inf, [])
        results = [judged(key, recipe.format_for(key[2])) for key in unit.keys]
        failed = next((text for ok, text, _ in results if not ok), None)
        if failed is not None or unit.elements == 0:
            for key in unit.keys:
                high_reasons[key] = f"high: {recipe.name} fails a limit here ({failed})"
            options.append([high])
            continue
        bits = sum(_bits(recipe.format_for(k[2])) * elements[k] for k in unit.keys) / unit.elements
        objective = sum(value for _, _, value in results)
        options.append([_Option(recipe.name, bits, objective, math.inf, []), high])
    if budget is None:
        picked = [0 for _ in options]
        optimal = True
    else:
        sizes = [u.elements for u in units]
        if fixed:
            options.append([_Option(HIGH, HIGH_BITS, 0.0, math.inf, [])])
            sizes.append(fixed)
        cheapest = sum(min(o.bits for o in opts) * n for opts, n in zip(options, sizes, strict=True))
        if cheapest > budget * total + 1e-6 * total:
            return None
        picked, optimal = _solve_budget(options, sizes, budget)
        picked = picked[: len(units)]
    quantized: set[OperandKey] = set()
    objective_total = 0.0
    for unit, opts, index in zip(units, options, picked, strict=False):
        option = opts[index]
        if option.label == HIGH:
            if len(opts) > 1:
                saved = opts[0]
                for key in unit.keys:
                    high_reasons[key] = (
                        f"high: within the bit budget, quantizing other GEMMs costs less; this GEMM in "
                        f"{recipe.name} would add {_number(saved.noise)} to the objective"
                    )
            continue
        quantized.update(unit.keys)
        objective_total += option.noise
    bits = _average_bits(recipe, quantized, elements, total)
    return _Solution(recipe, quantized, objective_total, bits, optimal, high_reasons)


def _average_bits(
    recipe: StackRecipe, quantized: set[OperandKey], elements: dict[OperandKey, int], total: int
) -> float:
    if total == 0:
        return math.nan
    spent = sum(
        (_bits(recipe.format_for(key[2])) if key in quantized else 32.0) * n for key, n in elements.items()
    )
    return spent / total


def _solve_layer_ends(
    recipe: StackRecipe,
    convertible: Sequence[OperandKey],
    elements: dict[OperandKey, int],
    total: int,
    budget: float | None,
    judged: Callable[[OperandKey, str], tuple[bool, str, float]],
) -> _Solution | None:
    """Every (leading k, trailing m) count of transformer layers kept high, the rest in ``recipe``; the
    least objective within the budget (or the fewest bits without one)."""
    by_layer: dict[int, list[OperandKey]] = {}
    for key in convertible:
        layer = layer_index(key[0])
        if layer is not None:
            by_layer.setdefault(layer, []).append(key)
    layers = sorted(by_layer)
    outside = [k for k in convertible if layer_index(k[0]) is None]
    best: tuple[tuple[float, float], int, int, set[OperandKey], float] | None = None
    count = len(layers)
    for first in range(count + 1):
        for last in range(count - first + 1):
            chosen = layers[first : count - last]
            keys = [k for layer in chosen for k in by_layer[layer]]
            results = [judged(k, recipe.format_for(k[2])) for k in keys]
            if not all(ok for ok, _, _ in results):
                continue
            quantized = set(keys)
            bits = _average_bits(recipe, quantized, elements, total)
            if budget is not None and bits > budget + 1e-9:
                continue
            objective = sum(value for _, _, value in results)
            rank = (objective, bits) if budget is not None else (bits, objective)
            if best is None or rank < best[0]:
                best = (rank, first, last, quantized, objective)
    if best is None:
        return None
    _, first, last, quantized, objective = best
    reasons: dict[OperandKey, str] = {}
    for key in outside:
        reasons[key] = "high: outside the transformer layers, which Megatron-LM's fp8/fp4 flags cover"
    for index, layer in enumerate(layers):
        if index < first or index >= count - last:
            where = "first" if index < first else "last"
            amount = first if index < first else last
            for key in by_layer[layer]:
                if key not in quantized:
                    reasons[key] = (
                        f"high: layer {layer} is among the {where} {amount} layer(s) kept in BF16 "
                        "(--first-last-layers-bf16), the least objective the budget allows"
                    )
    bits = _average_bits(recipe, quantized, elements, total)
    return _Solution(recipe, quantized, objective, bits, True, reasons)


def _cheapest_bits(
    recipes: Sequence[StackRecipe],
    convertible: Sequence[OperandKey],
    elements: dict[OperandKey, int],
    total: int,
    target: Target,
    judged: Callable[[OperandKey, str], tuple[bool, str, float]],
) -> float:
    """The fewest average bits any recipe reaches within the limits (for the error message)."""
    best = math.inf
    for recipe in recipes:
        solve = _solve_layer_ends if target.granularity == "layer_ends" else _solve_gemms
        solution = solve(recipe, convertible, elements, total, None, judged)
        if solution is not None:
            best = min(best, solution.bits)
    return best


def recipe_bits(analysis: Analysis, target: Target, candidates: Sequence[str]) -> dict[str, float]:
    """The average bits of each of ``target``'s recipes whose formats are in ``candidates``, applied to
    everything the target converts (the rest high): e.g. TE's uniform FP8 and NVFP4 plans on this model."""
    kinds = site_kinds(analysis)
    keys = analysis.keys()
    elements = {key: int(analysis.elements.get(key, 0)) for key in keys}
    total = sum(elements.values())
    convertible = {k for k in keys if kinds.get(k[0]) in LINEAR_KINDS}
    if target.granularity == "layer_ends":
        convertible = {k for k in convertible if layer_index(k[0]) is not None}
    return {
        recipe.name: _average_bits(recipe, convertible, elements, total)
        for recipe in target.recipes
        if all(f in candidates for f in recipe.measured)
    }
