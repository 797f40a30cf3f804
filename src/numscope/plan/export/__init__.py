"""Carry a plan to where models train at speed: torchao, Transformer Engine, Megatron-LM.

numscope chooses the numerics on emulated GEMMs; these functions write what each library needs to run
the same choice on its kernels, for the model's own sites (a plan is glob rules; an export is per module):

* :func:`to_torchao` — a Python module for torchao: one ``Float8LinearConfig`` per distinct float8 choice
  of the plan's Linear sites (each operand of each GEMM: E4M3 or E5M2, per tensor or axiswise along the
  contraction axis, or left in high precision) or one ``MXFP8TrainingOpConfig`` per MXFP8 choice (scale
  rule; wgrad in MXFP8 or high), and ``convert(model)``, which converts exactly those modules
  (``convert_to_float8_training`` / ``quantize_`` with a filter on their names).
* :func:`to_transformer_engine` — a Python module with the TE recipe the plan's quantized operands share
  (``Float8CurrentScaling``, ``DelayedScaling``, ``Float8BlockScaling``, ``MXFP8BlockScaling`` or
  ``NVFP4BlockScaling``) and TE's debug-tools YAML (``DisableFP8GEMM``) for the GEMMs the plan keeps high.
  TE layers are matched by the ``name=`` given to them: build them with the module's qualified name.
* :func:`to_megatron` — Megatron-LM's ``--fp8-*`` flags and the leading and trailing layers it keeps in BF16.

Every export lists, one line each, what the target cannot express (``Export.unexpressed``): a format it
has no kernel for, per-operand choices it fixes, attention products, convolutions. Nothing is dropped
silently: such a module is left in high precision by the export and named there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from numscope._callable import make_callable as _make_callable
from numscope.plan.export.common import TARGETS, Export, ExportError, shape_multiple, shape_problem
from numscope.plan.export.megatron import from_megatron, to_megatron
from numscope.plan.export.te import TE_RECIPES, from_transformer_engine, to_transformer_engine
from numscope.plan.export.torchao import from_torchao, to_torchao
from numscope.plan.plan import Plan

__all__ = [
    "TARGETS",
    "TE_RECIPES",
    "Export",
    "ExportError",
    "export",
    "from_megatron",
    "from_torchao",
    "from_transformer_engine",
    "shape_multiple",
    "shape_problem",
    "to_megatron",
    "to_torchao",
    "to_transformer_engine",
]


def export(
    plan: Plan,
    target: str,
    sites: Sequence[tuple[str, str]],
    source: str = "a numscope plan",
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> Export:
    """:func:`to_torchao`, :func:`to_transformer_engine` or :func:`to_megatron` by ``target``; ``shapes``
    (a Linear site's weight shape) has each module checked against the target's shape rules."""
    functions = {"torchao": to_torchao, "te": to_transformer_engine, "megatron": to_megatron}
    if target not in functions:
        raise ExportError(f"unknown export target {target!r}; allowed: {', '.join(TARGETS)}")
    if not sites:
        raise ExportError("an export needs the model's sites (numscope.sites(model, example_inputs))")
    return functions[target](plan, sites, source, shapes)


_make_callable(__name__, "export")  # numscope.export(plan, target, sites) is export(...)
