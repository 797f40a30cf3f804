"""The plans the study compares, as operand → format maps: operands of a model's analysis, the orders
heuristics and random draws give them, an order filled to an average-bit budget (:func:`fill_order`), and
every plan of every budget."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from numscope._names import layer_index
from numscope.analysis import Analysis, OperandKey
from numscope.plan import HIGH, OperandSpec, Plan
from numscope.study.config import PlanStudyConfig, StudyError
from numscope.study.gap_models import GapModel, SensitivityModel
from numscope.study.operands import Operands, format_bits
from numscope.vocab import GEMMS, Gemm, Operand


def order_first_last(operands: Operands) -> list[OperandKey]:
    """Megatron's ``--first-last-layers-bf16``: sites outside the layers (embeddings, head) first, then the
    first and last layer, then inwards; site order within a rank."""
    sites = operands.sites()
    layers = sorted({i for s in sites if (i := layer_index(s)) is not None})
    if not layers:
        return list(operands.keys)
    first, last = layers[0], layers[-1]

    def rank(key: OperandKey) -> int:
        layer = layer_index(key[0])
        return -1 if layer is None else min(layer - first, last - layer)

    return sorted(operands.keys, key=lambda k: (rank(k), operands.keys.index(k)))


def order_last_layers(operands: Operands) -> list[OperandKey]:
    """The NVFP4 recipe's last linear layers in high precision: the last sites (call order) first."""
    sites = operands.sites()
    position = {site: i for i, site in enumerate(sites)}
    return sorted(operands.keys, key=lambda k: (-position[k[0]], operands.keys.index(k)))


def order_wgrad_high(operands: Operands) -> list[OperandKey]:
    """torchao's ``rowwise_with_gw_hp``: the weight-gradient GEMM's operands first, then gradients."""
    role = {Gemm.WGRAD: 0, Gemm.DGRAD: 1, Gemm.FPROP: 2}
    return sorted(
        operands.keys, key=lambda k: (role[k[1]], k[2] != Operand.GRAD_OUTPUT, operands.keys.index(k))
    )


def order_gradients_high(operands: Operands) -> list[OperandKey]:
    """Per GEMM role, as Transformer Engine's hybrid gives gradients the wide format: every
    ``grad_output`` operand first, then the rest, in site order."""
    return sorted(operands.keys, key=lambda k: (k[2] != Operand.GRAD_OUTPUT, operands.keys.index(k)))


def order_objective(order: Sequence[OperandKey]) -> Callable[[OperandKey, str], float]:
    """An advisor objective that makes a heuristic's order the advisor's choice: quantizing the k-th
    operand of ``order`` (kept high first) costs 2^(n − k), more than all later ones together, so that the
    bit budget keeps the heuristic's first operands high whatever the granularity (a target's units)."""
    rank = {key: index for index, key in enumerate(order)}
    count = len(order)

    def objective(key: OperandKey, label: str) -> float:
        return 0.0 if label == HIGH else math.ldexp(1.0, count - rank.get(key, count))

    return objective


HEURISTIC_ORDERS: dict[str, Callable[[Operands], list[OperandKey]]] = {
    "first/last layers": order_first_last,
    "last layers": order_last_layers,
    "wgrad high": order_wgrad_high,
    "gradients high": order_gradients_high,
}


def order_random(operands: Operands, seed: int) -> list[OperandKey]:
    rng = np.random.default_rng(seed)
    return [operands.keys[i] for i in rng.permutation(len(operands.keys))]


def shuffle_formats(
    formats: Mapping[OperandKey, str | OperandSpec], operands: Operands, seed: int
) -> dict[OperandKey, str | OperandSpec]:
    """A control for a chosen plan: the same formats moved to random places. Each format is dealt out again
    among the operands with the same element count, so the plan keeps its formats and its exact average
    bits (and each format's share of the elements) while where they sit is drawn at random: what the plan
    gains over its shuffled self is due to where it put its bits, not to which formats it used."""
    rng = np.random.default_rng(seed)
    groups: dict[int, list[OperandKey]] = {}
    for key in operands.keys:
        groups.setdefault(operands.elements[key], []).append(key)
    out: dict[OperandKey, str | OperandSpec] = {}
    for keys in groups.values():
        labels = [formats[k] for k in keys]
        out.update(zip(keys, (labels[i] for i in rng.permutation(len(labels))), strict=True))
    return out


def benefit_per_bit(analysis: Analysis, operands: Operands, low: str, high: str) -> dict[OperandKey, float]:
    """The advisor's metric of where bits pay: noise removed by going ``low`` → ``high``, per bit spent."""
    from numscope.advisor import operand_noise

    extra = format_bits(high) - format_bits(low)
    return {
        k: (operand_noise(analysis, k, low) - operand_noise(analysis, k, high))
        / (extra * operands.elements[k])
        for k in operands.keys
    }


def order_inverse(analysis: Analysis, operands: Operands, low: str, high: str) -> list[OperandKey]:
    """Bits where the metrics say they matter least: ascending benefit per bit."""
    benefit = benefit_per_bit(analysis, operands, low, high)
    return sorted(operands.keys, key=lambda k: (benefit[k], operands.keys.index(k)))


def fill_order(
    order: Sequence[OperandKey], operands: Operands, budget: float, low: str, high: str
) -> dict[OperandKey, str]:
    """Every operand ``low``; then, walking ``order``, each one ``high`` when the average stays within the
    budget. A budget below all-``low`` is an error."""
    formats = {k: low for k in operands.keys}
    total = sum(operands.elements.values())
    used = sum(operands.elements.values()) * format_bits(low)
    if used > budget * total + 1e-9:
        raise StudyError(f"budget {budget:g} bits is below all-{low} ({format_bits(low):g} bits per element)")
    extra = format_bits(high) - format_bits(low)
    for key in order:
        cost = extra * operands.elements[key]
        if used + cost <= budget * total + 1e-9:
            formats[key] = high
            used += cost
    return formats


def plan_of(formats: Mapping[OperandKey, str | OperandSpec], reason: str = "") -> Plan:
    """A plan with one exact-name rule per site giving each operand its format; other sites stay high."""
    return Plan.per_operand(formats, dict.fromkeys(formats, reason) if reason else None)


def role_plan(operands: Operands, gemm: str, low: str) -> dict[OperandKey, str]:
    """Calibration: ``low`` on every operand of one GEMM role, the rest high."""
    return {k: (low if k[1] == gemm else HIGH) for k in operands.keys}


@dataclass
class StudyPlan:
    name: str
    family: str
    budget: float | None
    formats: dict[OperandKey, str] | None  # None: a named plan (uniform, fp32)
    preset: str | None = None
    made: Plan | None = None  # a plan the advisor made as it is (a target's: its recipes' specs, high sites)

    def plan(self) -> Plan:
        if self.made is not None:
            return self.made
        return Plan.named(self.preset) if self.preset else plan_of(self.formats or {}, self.name)


def budget_plans(
    analysis: Analysis,
    operands: Operands,
    config: PlanStudyConfig,
    gap_model: GapModel | None = None,
    sensitivity: tuple[SensitivityModel, GapModel] | None = None,
) -> list[StudyPlan]:
    """Every plan of every budget: numscope's (its calibrated variant given ``gap_model``; given
    ``sensitivity``, the sensitivity plan with and without the fitted role weights), the heuristics, the
    random orders and the inverse, each filled to the budget."""
    from numscope.advisor import advise

    off = dict(max_be_ratio=None, max_underflow_pct=None, max_overflow_pct=None, min_sqnr_db=None)
    variants: dict[str, dict[str, Any]] = {"numscope": {}}  # name → how the advisor is asked
    if gap_model is not None and gap_model.noise_weights():
        variants["numscope calibrated"] = {"noise_weights": gap_model.noise_weights()}
    if sensitivity is not None:
        scores, fitted = sensitivity

        def loss_impact(key: OperandKey, label: str) -> float:
            return fitted.coefficients[key[1]] * scores.score(key, label)

        variants["numscope sensitivity"] = {"objective": loss_impact}
        # the same measured sensitivities without the fitted role weights: where a role's weight is fitted
        # from a calibration run inside its noise, this shows what the weights cost or bought
        variants["numscope sensitivity unweighted"] = {"objective": scores.score}
    plans = []
    for budget in config.budgets:
        tag = f"@{budget:g}"
        for name, asked in variants.items():
            rec = advise(analysis, candidates=[config.low, config.high], bit_budget=budget, **asked, **off)
            formats = {c.key: c.format for c in rec.choices}
            plans.append(StudyPlan(f"{name}{tag}", "numscope", budget, formats))
        if config.target is not None:  # what the stack runs, among every format it has (noise objective)
            asked = variants.get("numscope calibrated", {})  # the calibrated role weights where fitted
            total = target_budget(analysis, config, budget)
            rec = advise(analysis, bit_budget=total, target=config.target, **asked, **off)
            formats = {c.key: c.format for c in rec.choices}
            name = f"numscope {config.target}{tag}"
            plans.append(StudyPlan(name, "numscope", budget, formats, made=rec.plan))
        for name, order in HEURISTIC_ORDERS.items():
            formats = fill_order(order(operands), operands, budget, config.low, config.high)
            plans.append(StudyPlan(f"{name}{tag}", "heuristic", budget, formats))
        for index in range(config.random_plans):
            seed = int(1000 * budget) * 100 + index
            formats = fill_order(order_random(operands, seed), operands, budget, config.low, config.high)
            plans.append(StudyPlan(f"random {index + 1}{tag}", "random", budget, formats))
        inverse = order_inverse(analysis, operands, config.low, config.high)
        plans.append(
            StudyPlan(
                f"inverse{tag}",
                "inverse",
                budget,
                fill_order(inverse, operands, budget, config.low, config.high),
            )
        )
    for plan in plans:  # the advisor also assigns operands without elements; keep the study's operands
        default = HIGH if plan.made is not None else config.low  # a target keeps what it cannot run high
        plan.formats = {k: (plan.formats or {}).get(k, default) for k in operands.keys}
    return plans


def target_budget(analysis: Analysis, config: PlanStudyConfig, budget: float) -> float:
    """A target plan's bit budget for the study's ``budget``: as far from the target's cheapest recipe
    everywhere towards its FP8 recipe everywhere (:func:`numscope.advisor.target.recipe_bits`: what the
    stack cannot convert, attention's two products, other matmuls, shapes its kernels refuse, at 32 bits
    in both) as ``budget`` lies from the study's low format towards its high one. A stack cannot reach the
    budget of a plan that quantizes what it cannot convert, so its plan sits at the same place in its own
    range (6 bits: 44% of the way, near the demo's midway rule); its row's bits say what it costs in all."""
    from numscope.advisor.target import recipe_bits
    from numscope.plan.targets import get_target

    low, high = (OperandSpec(label).bits_per_element() for label in (config.low, config.high))
    bits = recipe_bits(analysis, get_target(str(config.target)), analysis.candidates)
    if "fp8" not in bits:
        raise StudyError(f"target {config.target}: its FP8 recipe was not measured by the FP32 run")
    cheapest = min(bits.values())
    position = (budget - low) / (high - low)
    # never below the cheapest recipe (rounded up): rounding must not make the budget impossible
    return max(round(cheapest + position * (bits["fp8"] - cheapest), 2), math.ceil(cheapest * 100) / 100)


def calibration_plans(operands: Operands, config: PlanStudyConfig) -> list[StudyPlan]:
    return [
        StudyPlan(
            f"{config.low.split('_')[0]} {gemm} only",
            "calibration",
            None,
            role_plan(operands, gemm, config.low),
        )
        for gemm in GEMMS
    ]


def uniform_formats(name: str, operands: Operands) -> dict[OperandKey, str]:
    """The format a preset gives each operand (for its bits and its predicted gap)."""
    plan = Plan.named(name)
    return {k: plan.for_site(k[0]).operand(k[1], k[2]).format for k in operands.keys}


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", name)


def _preset_of(label: str) -> str | None:
    """The uniform preset whose every operand is ``label`` (e.g. ``mxfp4`` for ``mxfp4_e2m1``), if any."""
    for name in Plan.presets():
        formats = {spec.format for spec in Plan.named(name).default.operands.values()}
        if formats == {label}:
            return name
    return None
