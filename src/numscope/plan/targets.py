"""What each training stack can run: the numerics and the granularity a plan made for it may use.

``numscope recommend --target T`` (:func:`numscope.advisor.advise` with ``target=``) chooses only among
what the target expresses, so that ``numscope export --to T`` carries the plan whole. Each target is data:

* **recipes** — the numerics a quantized GEMM can run, each a format per operand role (``input``,
  ``weight``, ``grad_output``) that numscope's observer measures under that very name, with that format's
  default scaling (per-tensor current amax for FP8, the block scale for MX and NVFP4): so the plan the
  advisor writes is exactly what the stack runs, not a stand-in.
* **granularity** — what can stay in high precision: ``gemm`` (any of fprop, dgrad, wgrad of any Linear
  module) or ``layer_ends`` (leading and trailing transformer layers, every GEMM of the layer).
* **one_recipe** — whether the whole model runs one recipe (Megatron-LM's flags) or each module may take
  its own (Transformer Engine's ``te.autocast`` regions, sequential or nested, one per module; torchao's
  per-module configs).

Only Linear sites (``nn.Linear``, transformers' ``Conv1D``) are converted by any stack; attention's
products, convolutions and other matmul sites stay high. Where each fact comes from is in ``source``.
The ``emulation`` target is every format numscope has, per operand: plans for studying, not for a kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from numscope.formats.scaling import Scaling
from numscope.plan.recipes import FAST_FPROP, TORCHAO_EPS
from numscope.plan.spec import PlanError, _unknown
from numscope.vocab import Operand

EMULATION = "emulation"
#: site kinds every stack converts (numscope.sites: nn.Linear and transformers' Conv1D)
LINEAR_KINDS = ("linear", "conv1d")


@dataclass(frozen=True)
class StackRecipe:
    """One numerics a stack runs a quantized GEMM in: a measured format name per operand role.

    name: short name (used in reasons and tables); label: the stack's own name for it.
    """

    name: str
    label: str
    formats: Mapping[str, str]
    #: the scaling the stack gives every operand of this recipe where it differs from the measured format's
    #: default in a way the observer does not measure (torchao's amax floor); None: the format's own
    scaling: Scaling | None = None
    #: how the stack's GEMMs of this recipe accumulate (a name, or gemm -> name; see SiteSpec.accumulate):
    #: per-tensor FP8 runs its output GEMM with Hopper's fast accumulation in TE, Megatron and torchao
    accumulate: str | Mapping[str, str] = "fp32"
    #: the format the plan names where it differs from the measured one only where the observer cannot see
    #: it (TE's NVFP4 turns a tensor holding a NaN all NaN: ``nvfp4@nan``; finite tensors alike)
    planned: Mapping[str, str] = field(default_factory=dict)

    def format_for(self, operand: str) -> str:
        return self.formats[operand]

    def plan_format(self, measured: str) -> str:
        """The format a plan gives an operand measured in ``measured``."""
        return self.planned.get(measured, measured)

    @property
    def measured(self) -> tuple[str, ...]:
        """The format names the observer must have measured for this recipe."""
        return tuple(dict.fromkeys(self.formats.values()))


@dataclass(frozen=True)
class Target:
    """A training stack as the advisor sees it (see the module docstring)."""

    name: str
    description: str
    source: str
    recipes: tuple[StackRecipe, ...] = ()
    granularity: str = "gemm"
    one_recipe: bool = True
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def is_emulation(self) -> bool:
        return self.name == EMULATION


_HYBRID = StackRecipe(
    "fp8",
    "FP8 E4M3 input/weight, E5M2 grad_output, per-tensor current scaling",
    {Operand.INPUT: "fp8_e4m3", Operand.WEIGHT: "fp8_e4m3", Operand.GRAD_OUTPUT: "fp8_e5m2"},
)
#: TE's Float8CurrentScaling with every GEMM promoted to FP32 (fp8_gemm_fprop=MMParams(
#: use_split_accumulator=True), which the export writes: TE can, and it is the more accurate choice)
_TE_HYBRID = StackRecipe("fp8", "Float8CurrentScaling(fp8_format=Format.HYBRID)", _HYBRID.formats)
#: Megatron-LM builds Float8CurrentScaling with TE's defaults: fprop without the split accumulator
_MEGATRON_HYBRID = StackRecipe(
    "fp8", "--fp8-format hybrid --fp8-recipe tensorwise", _HYBRID.formats, accumulate=FAST_FPROP
)
_TE_MXFP8 = StackRecipe(
    "mxfp8",
    "MXFP8BlockScaling(fp8_format=Format.E4M3)",
    {
        Operand.INPUT: "mxfp8_e4m3@rceil",
        Operand.WEIGHT: "mxfp8_e4m3@rceil",
        Operand.GRAD_OUTPUT: "mxfp8_e4m3@rceil",
    },
)
_TE_NVFP4 = StackRecipe(
    "nvfp4",
    "NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True)",
    {Operand.INPUT: "nvfp4", Operand.WEIGHT: "nvfp4", Operand.GRAD_OUTPUT: "nvfp4"},
    planned={"nvfp4": "nvfp4@nan"},
)
_TE_SOURCE = (
    "Transformer Engine >= 2.13: transformer_engine/common/recipe/__init__.py (Float8CurrentScaling, "
    "MXFP8BlockScaling, NVFP4BlockScaling and its disable_rht / disable_stochastic_rounding / "
    "disable_2d_quantization switches); transformer_engine/debug/features/disable_quantization_gemm.py "
    "(DisableQuantizationGEMM: any of fprop, dgrad, wgrad of a named layer in high precision, any format); "
    "docs/features/low_precision_training/introduction/introduction.rst (several recipes in one model)"
)

TARGETS: dict[str, Target] = {
    target.name: target
    for target in (
        Target(
            EMULATION,
            "every format numscope measured, chosen per operand (numscope's own emulation; no stack runs "
            "every such plan)",
            "numscope",
            granularity="operand",
            one_recipe=False,
        ),
        Target(
            "te",
            "Transformer Engine: per Linear module a recipe (FP8 current scaling, MXFP8 or plain NVFP4: "
            "its own te.autocast region), and any GEMM of any Linear layer kept in high precision",
            _TE_SOURCE,
            (_TE_HYBRID, _TE_MXFP8, _TE_NVFP4),
            "gemm",
            False,
            (
                "TE runs the recipe of the innermost autocast region a module's forward runs in "
                "(docs/features/low_precision_training/introduction: sequential and nested contexts); "
                "the export wraps each module whose recipe is not the model's in its own region",
                "NVFP4 is TE's recipe with its random Hadamard transform, stochastic rounding and 16x16 "
                "weight scales switched off: those are not measured by the observer",
                "attention products (TE's fused attention) and non-Linear sites stay high",
            ),
        ),
        Target(
            "torchao",
            "torchao float8 training: per Linear module, each GEMM in FP8 (E4M3 input/weight, E5M2 "
            "grad_output, tensorwise scaling) or in high precision",
            "torchao 0.18: torchao/float8/config.py (Float8LinearConfig, CastConfig per operand and GEMM, "
            "ScalingType.DISABLED), convert_to_float8_training(module_filter_fn=...)",
            (
                StackRecipe(
                    "fp8",
                    "Float8LinearConfig (tensorwise, E4M3/E5M2)",
                    _HYBRID.formats,
                    Scaling("tensor", amax_epsilon=TORCHAO_EPS),
                ),
            ),
            "gemm",
            False,
            (
                "torchao quantizes both operands of a GEMM or neither, and casts an operand to one dtype",
                "torchao floors every amax at 1e-12 (EPS, torchao/float8/float8_utils.py): its plans carry "
                "that floor; the observer measures without it (the same unless an amax is below 1e-12)",
                "torchao's MXFP8 training is not offered: torchao 0.18 drops a Linear's bias under it and "
                "needs every dimension a multiple of 32",
            ),
        ),
        Target(
            "megatron",
            "Megatron-LM: one recipe for the transformer layers (--fp8-recipe tensorwise or mxfp8, "
            "--fp4-recipe nvfp4), the first and last layers optionally in BF16; the output layer and "
            "everything outside the layers stay high",
            "Megatron-LM (main of 2026-08, after core_v0.19.0): "
            "megatron/core/transformer/transformer_config.py "
            "(first_last_layers_bf16, num_layers_at_start/end_in_bf16; not with delayed scaling), "
            "megatron/core/fp8_utils.py, megatron/core/fp4_utils.py (NVFP4BlockScaling from TE, whose "
            "switches are TE's NVTE_NVFP4_DISABLE_* environment variables)",
            (_MEGATRON_HYBRID, _TE_MXFP8, _TE_NVFP4),
            "layer_ends",
            True,
            (
                "every GEMM of a quantized layer is quantized; only whole leading and trailing layers stay "
                "high",
            ),
        ),
    )
}

STACKS: tuple[str, ...] = tuple(name for name in TARGETS if name != EMULATION)
"""The training stacks among the targets (te, torchao, megatron): what a plan can be exported to."""


def get_target(name: str) -> Target:
    """The :class:`Target` called ``name``; a :class:`PlanError` listing the known ones otherwise."""
    found = TARGETS.get(name) if isinstance(name, str) else None
    if found is None:
        raise PlanError(_unknown("target", str(name), TARGETS))
    return found
