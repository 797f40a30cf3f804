"""The recipes a training stack offers, as plans for one model: what ``numscope forecast --target T``
puts side by side. Transformer Engine's and torchao's are the named recipes (:mod:`numscope.plan.recipes`);
Megatron-LM's are its ``--fp8-recipe`` / ``--fp4-recipe`` numerics on the transformer layers' Linear
sites, each with and without ``--first-last-layers-bf16`` (one layer at each end in BF16). A Linear
module whose weight shape the stack's kernels cannot take (:func:`numscope.plan.export.shape_problem`, e.g.
an LM head of 30,527 rows for TE's FP8 GEMMs, which need multiples of 16) stays high in every recipe, as
it would in the stack, and as ``recommend --target`` keeps it."""

from __future__ import annotations

import glob
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from numscope._names import layer_index
from numscope.plan import Plan, SiteSpec
from numscope.plan.targets import LINEAR_KINDS, STACKS

TE_RECIPES = ("te_current", "te_delayed", "te_block", "te_mxfp8", "te_nvfp4")
TORCHAO_RECIPES = ("torchao_tensorwise", "torchao_rowwise", "torchao_rowwise_with_gw_hp", "torchao_mxfp8")
#: Megatron-LM's recipes: its flags, and the named recipe whose numerics it runs on a Linear site
MEGATRON_RECIPES = (
    ("--fp8-recipe tensorwise", "te_current"),
    ("--fp8-recipe mxfp8", "te_mxfp8"),
    ("--fp4-recipe nvfp4", "te_nvfp4"),
)


@dataclass(frozen=True)
class StackPlan:
    """One recipe of a stack applied to a model: ``name`` (short, for tables and files), ``label`` (the
    stack's own words for it) and its plan."""

    name: str
    label: str
    plan: Plan


def stack_plans(
    target: str, sites: Sequence[tuple[str, str]], shapes: Mapping[str, Sequence[int]] | None = None
) -> list[StackPlan]:
    """Every recipe of ``target`` (``te``, ``torchao`` or ``megatron``) as a plan for the model whose
    ``sites`` are ``(name, kind)`` in call order; ``shapes``: site name → its weight's shape (out, in),
    for the modules the stack's kernels cannot take (kept high)."""
    from numscope.plan.recipes import RECIPES

    names = [name for name, _ in sites]
    if target == "te":
        plans = [StackPlan(n, RECIPES[n].source.split(";")[0], Plan.recipe(n, names)) for n in TE_RECIPES]
    elif target == "torchao":
        plans = [StackPlan(n, RECIPES[n].source, Plan.recipe(n, names)) for n in TORCHAO_RECIPES]
    elif target == "megatron":
        plans = _megatron(sites)
    else:
        raise ValueError(f"unknown stack {target!r}; allowed: {', '.join(STACKS)}")
    return [replace(p, plan=_high_where_shapes_fail(p.plan, target, sites, shapes or {})) for p in plans]


def _high_where_shapes_fail(
    plan: Plan, target: str, sites: Sequence[tuple[str, str]], shapes: Mapping[str, Sequence[int]]
) -> Plan:
    from numscope.plan.export import shape_problem

    for name, kind in sites:
        if kind not in LINEAR_KINDS or name not in shapes:
            continue
        formats = [spec.format for spec in plan.for_site(name).operands.values() if not spec.is_high]
        problem = shape_problem(shapes[name], formats, target)
        if problem is not None:
            plan = plan.with_rule(glob.escape(name), SiteSpec(), {"fprop/input": f"high: {problem}"})
    return plan


def _megatron(sites: Sequence[tuple[str, str]]) -> list[StackPlan]:
    layered = [name for name, kind in sites if kind in LINEAR_KINDS and layer_index(name) is not None]
    layers = sorted({layer_index(name) for name in layered})  # type: ignore[type-var]
    ends = {layers[0], layers[-1]} if len(layers) > 1 else set(layers)
    out = []
    for flag, numerics in MEGATRON_RECIPES:
        recipe = Plan.recipe(numerics)  # without sites: no layer of its own kept high
        for with_ends in (False, True):
            plan = Plan(SiteSpec())
            for name in layered:
                if with_ends and layer_index(name) in ends:
                    continue
                plan = plan.with_rule(glob.escape(name), recipe.for_site(name))
            short = flag.split()[-1]
            label = f"{flag}{' --first-last-layers-bf16' if with_ends else ''}"
            out.append(StackPlan(f"megatron_{short}{'+ends' if with_ends else ''}", label, plan))
    return out
