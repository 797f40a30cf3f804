"""The advisor for a training stack: choose among what the target runs (:mod:`numscope.plan.targets`).

Where the plain advisor chooses a format per operand, a stack couples operands: Transformer Engine and
torchao quantize both operands of a GEMM or neither, in the recipe's format for each role, and TE runs one
recipe per module; Megatron-LM quantizes whole transformer layers and keeps only leading and trailing ones
high. So the decision is made per **unit** — a module with a recipe for any set of its GEMMs (TE), a GEMM
of a Linear site (torchao, one recipe), or a choice of how many leading and trailing layers stay high
(``layer_ends``) — among the options the target has, each scored by the same per-operand objective as the
plain advisor (the measured sensitivity or the noise power, summed over the unit's operands) and costed in
bits × elements. With a bit budget the multiple-choice knapsack of the plain advisor picks the least total
objective within it; without one, every unit takes its cheapest option that meets the limits. A target
that runs one recipe for the whole model is solved once per recipe and the best solution is kept. Sites
the target does not convert (attention products, convolutions, other matmuls) stay high and count in the
average bits like any operand.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from numscope._names import layer_index
from numscope.advisor.budget import _solve_budget
from numscope.advisor.choice import Choice, Recommendation
from numscope.advisor.limits import HIGH_BITS, AdvisorError, Limits, _bits, _Option, _option
from numscope.analysis import Analysis, OperandKey, Sensitivity
from numscope.plan import HIGH, OperandSpec, Plan
from numscope.plan.export import shape_problem
from numscope.plan.targets import LINEAR_KINDS, StackRecipe, Target
from numscope.vocab import GEMMS, OPERANDS

Objective = Callable[[OperandKey, str], float]


def site_kinds(analysis: Analysis) -> dict[str, str]:
    """Site name → kind (``linear``, ``conv1d``, ``matmul``, ``sdpa``, ``conv``…) in the model's call
    order, as the observer recorded them (``analysis.meta["site_kinds"]``)."""
    recorded = analysis.meta.get("site_kinds")
    if not recorded:
        raise AdvisorError(
            "this analysis does not record its sites' kinds (made by an earlier numscope, or by hand): a "
            "target needs them to know which sites its stack converts; analyze again"
        )
    return {str(name): str(kind) for name, kind in recorded}


@dataclass
class _Solution:
    """A plan for the target: the quantized operands' formats, each quantized site's recipe."""

    formats: dict[OperandKey, str]
    recipes: dict[str, StackRecipe]
    objective: float
    bits: float
    optimal: bool
    high_reasons: dict[OperandKey, str]


@dataclass
class _UnitOption:
    """One way to run a unit: its quantized operands' formats (none: all high) and their recipe."""

    formats: dict[OperandKey, str]
    recipe: StackRecipe | None
    objective: float


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
    high_bits: float = HIGH_BITS,
) -> object:
    """A :class:`~numscope.advisor.Recommendation` for ``target`` (see the module docstring); an operand
    left high counts ``high_bits`` (32; 16 where the stack runs it in BF16)."""
    kinds = site_kinds(analysis)
    usable = [r for r in target.recipes if all(f in candidates for f in r.measured)]
    if not usable:
        wanted = sorted({f for r in target.recipes for f in r.measured})
        raise AdvisorError(
            f"target {target.name!r}: none of its recipes was measured; observe with "
            f"{', '.join(wanted)} among the candidates (numscope analyze `candidates` ...); measured: "
            f"{', '.join(candidates) or '(none)'}"
        )
    keys = analysis.keys()
    elements = {key: int(analysis.elements.get(key, 0)) for key in keys}
    total = sum(elements.values())
    if bit_budget is not None and total == 0:
        raise AdvisorError("a bit budget needs element counts; the analysis records none")
    convertible = [k for k in keys if kinds.get(k[0]) in LINEAR_KINDS]
    fixed_high = set(keys) - set(convertible)
    cache: dict[tuple[OperandKey, str], tuple[bool, str, float]] = {}

    shapes = analysis.weight_shapes()

    def judged(key: OperandKey, label: str) -> tuple[bool, str, float]:
        """(passes the limits and the stack's shape rule, the failed check's text, the objective) of one
        operand in one format."""
        if (key, label) not in cache:
            option = _option(analysis, key, label, limits, reference, sensitivity)  # type: ignore[arg-type]
            failed = next((c for c in option.checks if not c.passed), None)
            text = failed.describe() if failed else ""
            shape = shapes.get(key[0])
            if shape is not None and not target.is_emulation and label != HIGH:
                text = shape_problem(shape, [label], target.name) or text
            passes = failed is None and not text
            # the objective of an option that fails is never summed: not asked (an operand no stack's
            # kernels take, as a vocabulary head of 30,527 rows, may have no sensitivity measured)
            cache[(key, label)] = (passes, text, float(objective(key, label)) if passes else math.inf)
        return cache[(key, label)]

    solutions = [
        solution
        for recipes in _recipe_sets(target, usable)
        if (solution := _solve(target, recipes, convertible, elements, total, bit_budget, judged, high_bits))
        is not None
    ]
    if not solutions:
        cheapest = min(
            (
                solution.bits
                for recipes in _recipe_sets(target, usable)
                if (
                    solution := _solve(target, recipes, convertible, elements, total, None, judged, high_bits)
                )
                is not None
            ),
            default=math.inf,
        )
        raise AdvisorError(
            f"bit budget {bit_budget:g} bits/element is impossible for target {target.name!r}: its cheapest "
            f"plan within the limits needs {cheapest:.4g} bits/element (what it cannot convert stays high, "
            f"{high_bits:g} bits); "
            "raise `bit_budget`, or relax the limits (`min_sqnr_db`, `max_underflow_pct`, "
            "`max_overflow_pct`, `max_be_ratio`: 'none' switches one off)"
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
        if key in best.formats:
            fmt = best.formats[key]
            _, _, value = judged(key, fmt)
            bits = _bits(fmt)
            reason = (
                f"{fmt} ({bits:g} bits): {target.name} recipe {best.recipes[site].name}; {objective_name} "
                f"{_number(value)}{budget_text}"
            )
            choices.append(Choice(site, gemm, operand, fmt, bits, n, objective_name, value, reason))
        else:
            if key in fixed_high:
                reason = f"high: {target.name} converts Linear layers only (a {kinds.get(site, '?')} site)"
                value = math.nan
            else:
                reason = best.high_reasons.get(key, "high")
                _, _, value = judged(key, usable[0].format_for(operand))
            choices.append(Choice(site, gemm, operand, HIGH, high_bits, n, objective_name, value, reason))
    assert isinstance(limits, Limits)
    specs: dict[OperandKey, str | OperandSpec] = {
        c.key: OperandSpec(
            best.recipes[c.site].plan_format(best.formats[c.key]), scaling=best.recipes[c.site].scaling
        )
        if c.key in best.formats
        else c.format
        for c in choices
    }
    accumulate: dict[str, dict[str, str]] = {}  # the recipe's accumulation on its quantized GEMMs
    for site, recipe in best.recipes.items():
        for gemm in GEMMS:
            if recipe is not None and any((site, gemm, o) in best.formats for o in OPERANDS[gemm]):
                wanted = recipe.accumulate
                accumulate.setdefault(site, {})[gemm] = wanted if isinstance(wanted, str) else wanted[gemm]
    plan = Plan.per_operand(specs, {c.key: c.reason for c in choices}, accumulate)
    return Recommendation(plan, tuple(choices), best.bits, bit_budget, best.optimal, limits, reference)


def _number(value: float) -> str:
    return f"{value:.3g}"


def _recipe_sets(target: Target, usable: Sequence[StackRecipe]) -> list[tuple[StackRecipe, ...]]:
    """The recipe sets to solve with: each recipe alone where the model runs one, else all together."""
    if target.one_recipe or target.granularity == "layer_ends":
        return [(recipe,) for recipe in usable]
    return [tuple(usable)]


def _solve(
    target: Target,
    recipes: tuple[StackRecipe, ...],
    convertible: Sequence[OperandKey],
    elements: dict[OperandKey, int],
    total: int,
    budget: float | None,
    judged: Callable[[OperandKey, str], tuple[bool, str, float]],
    high_bits: float = HIGH_BITS,
) -> _Solution | None:
    if target.granularity == "layer_ends":
        return _solve_layer_ends(recipes[0], convertible, elements, total, budget, judged, high_bits)
    return _solve_gemms(recipes, target.one_recipe, convertible, elements, total, budget, judged, high_bits)


def _solve_gemms(
    recipes: tuple[StackRecipe, ...],
    one_recipe: bool,
    convertible: Sequence[OperandKey],
    elements: dict[OperandKey, int],
    total: int,
    budget: float | None,
    judged: Callable[[OperandKey, str], tuple[bool, str, float]],
    high_bits: float = HIGH_BITS,
) -> _Solution | None:
    """Each GEMM of each Linear site in a recipe or high: the knapsack (or the cheapest within the limits).

    ``one_recipe``: the units are single GEMMs and ``recipes`` holds the one recipe of the model. Otherwise
    each site takes one of ``recipes`` for its quantized GEMMs (TE's autocast per module): the unit is the
    site, its options every recipe with every non-empty set of its GEMMs that meet the limits."""
    grouped: dict[tuple[str, str], list[OperandKey]] = {}
    for key in convertible:
        grouped.setdefault((key[0], key[1]), []).append(key)
    if one_recipe:
        units = [[gemm_key] for gemm_key in grouped]
    else:
        by_site: dict[str, list[tuple[str, str]]] = {}
        for gemm_key in grouped:
            by_site.setdefault(gemm_key[0], []).append(gemm_key)
        units = list(by_site.values())
    high_reasons: dict[OperandKey, str] = {}
    unit_options: list[list[_UnitOption]] = []
    sizes: list[int] = []
    for gemm_keys in units:
        keys = [key for gemm_key in gemm_keys for key in grouped[gemm_key]]
        sizes.append(sum(elements[k] for k in keys))
        passing: dict[int, list[tuple[str, str]]] = {}  # recipe index -> its GEMMs within the limits
        for number, recipe in enumerate(recipes):
            for gemm_key in gemm_keys:
                results = [judged(key, recipe.format_for(key[2])) for key in grouped[gemm_key]]
                failed = next((text for ok, text, _ in results if not ok), None)
                if failed is None:
                    passing.setdefault(number, []).append(gemm_key)
                else:
                    for key in grouped[gemm_key]:
                        high_reasons.setdefault(key, f"high: {recipe.name} fails a limit here ({failed})")
        options = [_UnitOption({}, None, 0.0)]
        for number, allowed in passing.items():
            recipe = recipes[number]
            for count in range(1, len(allowed) + 1):
                for subset in itertools.combinations(allowed, count):
                    formats = {key: recipe.format_for(key[2]) for g in subset for key in grouped[g]}
                    objective = sum(judged(key, fmt)[2] for key, fmt in formats.items())
                    options.append(_UnitOption(formats, recipe, objective))
        unit_options.append(options)
    costed = [
        [
            _Option(
                str(index),
                _unit_bits(option.formats, _keys_of(units[u], grouped), elements, high_bits),
                option.objective,
                math.inf,
                [],
            )
            for index, option in enumerate(options)
        ]
        for u, options in enumerate(unit_options)
    ]
    if budget is None:
        picked = [min(range(len(opts)), key=lambda i, o=opts: (o[i].bits, o[i].noise)) for opts in costed]
        optimal = True
    else:
        fixed = total - sum(sizes)
        problem, problem_sizes = list(costed), list(sizes)
        if fixed:
            problem.append([_Option(HIGH, high_bits, 0.0, math.inf, [])])
            problem_sizes.append(fixed)
        cheapest = sum(min(o.bits for o in opts) * n for opts, n in zip(problem, problem_sizes, strict=True))
        if cheapest > budget * total + 1e-6 * total:
            return None
        picked, optimal = _solve_budget(problem, problem_sizes, budget)
        picked = picked[: len(units)]
    formats: dict[OperandKey, str] = {}
    site_recipes: dict[str, StackRecipe] = {}
    objective_total = 0.0
    for gemm_keys, options, index in zip(units, unit_options, picked, strict=True):
        option = options[index]
        formats.update(option.formats)
        objective_total += option.objective
        if option.recipe is not None:
            site_recipes[gemm_keys[0][0]] = option.recipe
        for gemm_key in gemm_keys:
            keys = grouped[gemm_key]
            if keys[0] in option.formats or any(k in high_reasons for k in keys):
                continue
            recipe = option.recipe or recipes[0]
            added = sum(judged(key, recipe.format_for(key[2]))[2] for key in keys)
            for key in keys:
                high_reasons[key] = (
                    f"high: within the bit budget, quantizing other GEMMs costs less; this GEMM in "
                    f"{recipe.name} would add {_number(added)} to the objective"
                )
    bits = _average_bits(formats, elements, total, high_bits)
    return _Solution(formats, site_recipes, objective_total, bits, optimal, high_reasons)


def _keys_of(gemm_keys: Sequence[tuple[str, str]], grouped: dict[tuple[str, str], list[OperandKey]]) -> list:
    return [key for gemm_key in gemm_keys for key in grouped[gemm_key]]


def _unit_bits(
    formats: dict[OperandKey, str], keys: Sequence[OperandKey], elements: dict[OperandKey, int], high: float
) -> float:
    size = sum(elements[k] for k in keys)
    if size == 0:
        return high
    return sum((_bits(formats[k]) if k in formats else high) * elements[k] for k in keys) / size


def _average_bits(
    formats: dict[OperandKey, str], elements: dict[OperandKey, int], total: int, high_bits: float = HIGH_BITS
) -> float:
    if total == 0:
        return math.nan
    return (
        sum((_bits(formats[key]) if key in formats else high_bits) * n for key, n in elements.items()) / total
    )


def _solve_layer_ends(
    recipe: StackRecipe,
    convertible: Sequence[OperandKey],
    elements: dict[OperandKey, int],
    total: int,
    budget: float | None,
    judged: Callable[[OperandKey, str], tuple[bool, str, float]],
    high_bits: float = HIGH_BITS,
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
    best: tuple[tuple[float, float], int, int, dict[OperandKey, str], float] | None = None
    count = len(layers)
    for first in range(count + 1):
        for last in range(count - first + 1):
            chosen = layers[first : count - last]
            keys = [k for layer in chosen for k in by_layer[layer]]
            results = [judged(k, recipe.format_for(k[2])) for k in keys]
            if not all(ok for ok, _, _ in results):
                continue
            quantized = {k: recipe.format_for(k[2]) for k in keys}
            bits = _average_bits(quantized, elements, total, high_bits)
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
    bits = _average_bits(quantized, elements, total, high_bits)
    sites = {key[0]: recipe for key in quantized}
    return _Solution(quantized, sites, objective, bits, True, reasons)


def recipe_bits(
    analysis: Analysis, target: Target, candidates: Sequence[str], high_bits: float = HIGH_BITS
) -> dict[str, float]:
    """The average bits of each of ``target``'s recipes whose formats are in ``candidates``, applied to
    everything the target converts (the rest high, counted as ``high_bits``: 16 where it runs in BF16; a
    module whose weight shape the recipe's kernels cannot take, :func:`numscope.plan.export.shape_problem`,
    stays high too): e.g. TE's uniform FP8 and NVFP4 plans on this model."""
    kinds = site_kinds(analysis)
    keys = analysis.keys()
    elements = {key: int(analysis.elements.get(key, 0)) for key in keys}
    total = sum(elements.values())
    convertible = {k for k in keys if kinds.get(k[0]) in LINEAR_KINDS}
    if target.granularity == "layer_ends":
        convertible = {k for k in convertible if layer_index(k[0]) is not None}
    shapes = analysis.weight_shapes()

    def runs(recipe: StackRecipe, site: str) -> bool:  # the stack's kernels take the module's shape
        return shape_problem(shapes.get(site, ()), recipe.measured, target.name) is None

    return {
        recipe.name: _average_bits(
            {k: recipe.format_for(k[2]) for k in convertible if runs(recipe, k[0])},
            elements,
            total,
            high_bits,
        )
        for recipe in target.recipes
        if all(f in candidates for f in recipe.measured)
    }
