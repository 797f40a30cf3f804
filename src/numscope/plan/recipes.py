"""The field's published low-precision training recipes as plans: ``Plan.recipe(name)``, ``--plan NAME``.

Each recipe says where it comes from (``source``) and what numscope emulates of it (``notes``): every
operand of every GEMM of the linear layers, in the format, scaling, rounding and transform the recipe
gives that role. Attention's two products (the sites named ``*.scores*`` and ``*.context*``) stay
unquantized in the recipes of libraries that quantize linear layers only (Transformer Engine, torchao,
DeepSeek-V3), through optional rules that models without attention simply do not match.

Orientation: a scale must be constant along the GEMM's contraction axis to factor out of its dot products.
numscope passes each operand in its GEMM's layout (see :mod:`numscope.sites`): the contraction axis is
the last one in fprop (input, weight) and dgrad (grad_output), the first one for dgrad's weight and for
both wgrad operands (the token axis). So "rowwise" (torchao's axiswise scaling) is ``row`` scaling where
the contraction axis is last and ``column`` scaling where it is first, and Transformer Engine's and
DeepSeek-V3's 1×128 tiles are ``block_shape (1, 128)`` or ``(128, 1)`` likewise. Block formats (MX,
NVFP4) always run their blocks along the contraction axis.
"""

from __future__ import annotations

import fnmatch
import glob
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from numscope.formats.scaling import Scaling
from numscope.plan.plan import Plan, register_recipes
from numscope.plan.spec import OperandSpec, PlanError, SiteSpec, _unknown
from numscope.vocab import CONTRACTION_FIRST, OPERAND_KEYS, Gemm, Operand

#: the site names of attention's two products (see numscope.sites: ``scores``, ``context``, numbered
#: ``scores0``, ``scores1``… where a module has several)
ATTENTION_PATTERNS: tuple[str, ...] = ("*.scores", "*.scores[0-9]*", "*.context", "*.context[0-9]*")
#: the share of linear layers the NVFP4 pretraining recipe keeps in BF16, counted from the last one
NVFP4_BF16_TAIL = 0.15
#: Transformer Engine's random Hadamard transform for NVFP4's wgrad operands: blocks of 16 with TE's fixed
#: sign vector (``get_wgrad_sign_vector`` in transformer_engine/pytorch/tensor/nvfp4_tensor.py, TE 2.20.0.dev0
#: at d0067d0; [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]), which numscope's seeded signs give
#: with the seed 28389 (diag(signs) · H₁₆ / 4, rows signed, as TE's ``sign_mat @ h``; tested)
TE_RHT = "rht16:28389"


@dataclass(frozen=True)
class NamedRecipe:
    """A published recipe: its name, where it is described, a one-line summary and how it is emulated."""

    name: str
    source: str
    summary: str
    notes: str
    build: Callable[[list[str] | None], Plan]
    #: the source code numscope follows: repository, commit or version, files
    code: str = ""
    #: whether the plan's layer choice depends on the model's sites (``build`` given them differs)
    needs_sites: bool = False


#: torchao's floor under every amax before its scale is computed (``EPS`` in torchao/float8/float8_utils.py,
#: ``amax_to_scale``: max / clamp(amax, min=EPS))
TORCHAO_EPS = 1e-12
#: DeepGEMM's floor under each tile's amax in its FP8 casts (``per_token_cast_to_fp8`` and
#: ``per_block_cast_to_fp8``: amax.clamp(1e-4)), the casts of DeepSeek-V3's recipe
DEEPGEMM_EPS = 1e-4


def _axiswise(gemm: str, operand: str, power_of_two: bool) -> Scaling:
    """torchao's axiswise scaling: one scale per slice along the contraction axis."""
    kind = "column" if (gemm, operand) in CONTRACTION_FIRST else "row"
    return Scaling(kind, power_of_two=power_of_two, amax_epsilon=TORCHAO_EPS)  # type: ignore[arg-type]


def _tile(
    gemm: str, operand: str, power_of_two: bool, amax_epsilon: float = 0.0, from_decode: bool = False
) -> Scaling:
    """A 1×128 tile along the contraction axis (activations and gradients)."""
    shape = (128, 1) if (gemm, operand) in CONTRACTION_FIRST else (1, 128)
    return Scaling(
        "block",
        block_shape=shape,
        power_of_two=power_of_two,
        amax_epsilon=amax_epsilon,
        scale_from_decode=from_decode,
    )


def linear_only(spec: SiteSpec) -> Plan:
    """``spec`` for every site, attention's products left high (rules that may match nothing)."""
    plan = Plan(spec)
    for pattern in ATTENTION_PATTERNS:
        reason = {"fprop/input": "the recipe quantizes linear layers only"}
        plan = plan.with_rule(pattern, SiteSpec(), reason, optional=True)
    return plan


#: the output GEMM without promotion to FP32 (Hopper's fast accumulation), the others with it: Transformer
#: Engine's per-tensor FP8 recipes (``_2X_ACC_FPROP = False`` in transformer_engine/pytorch/module/base.py;
#: Float8CurrentScaling's ``fp8_gemm_fprop = MMParams(use_split_accumulator=False)``) and torchao's float8
#: (``gemm_config_output = Float8GemmConfig(use_fast_accum=True)`` in torchao/float8/config.py)
FAST_FPROP = {Gemm.FPROP: "fp22", Gemm.DGRAD: "fp32", Gemm.WGRAD: "fp32"}


def _hybrid(scaling: Scaling | None, accumulate: str | dict[str, str] = "fp32") -> SiteSpec:
    """Transformer Engine's HYBRID format: E4M3 for input and weight, E5M2 for grad_output."""
    operands = {}
    for gemm, operand in OPERAND_KEYS:
        fmt = "fp8_e5m2" if operand == Operand.GRAD_OUTPUT else "fp8_e4m3"
        operands[(gemm, operand)] = OperandSpec(fmt, scaling=scaling)
    return SiteSpec(operands, accumulate)


def _te_delayed(sites: list[str] | None) -> Plan:
    return linear_only(_hybrid(Scaling("delayed", history_len=1024, amax_compute="max"), FAST_FPROP))


def _te_current(sites: list[str] | None) -> Plan:
    return linear_only(_hybrid(Scaling("tensor"), FAST_FPROP))


def _fine_grained(
    accumulate: str, power_of_two: bool, amax_epsilon: float = 0.0, from_decode: bool = False
) -> SiteSpec:
    operands = {}
    for gemm, operand in OPERAND_KEYS:
        if operand == Operand.WEIGHT:
            scaling = Scaling(
                "block",
                block_shape=(128, 128),
                power_of_two=power_of_two,
                amax_epsilon=amax_epsilon,
                scale_from_decode=from_decode,
            )
        else:
            scaling = _tile(gemm, operand, power_of_two, amax_epsilon, from_decode)
        operands[(gemm, operand)] = OperandSpec("fp8_e4m3", scaling=scaling)
    return SiteSpec(operands, accumulate)


def _te_block(sites: list[str] | None) -> Plan:
    return linear_only(_fine_grained("fp32", power_of_two=True))


def _te_mxfp8(sites: list[str] | None) -> Plan:
    return linear_only(SiteSpec.uniform("mxfp8_e4m3@rceil"))


def _nvfp4_spec() -> SiteSpec:
    operands = {}
    for gemm, operand in OPERAND_KEYS:
        rounding = "stochastic" if operand == Operand.GRAD_OUTPUT else "nearest"
        fmt = "nvfp4@2d@nan" if operand == Operand.WEIGHT else "nvfp4@nan"  # @nan: TE's NaN behaviour
        transform = TE_RHT if gemm == Gemm.WGRAD else None
        operands[(gemm, operand)] = OperandSpec(fmt, rounding=rounding, transform=transform)
    return SiteSpec(operands)


def _linear_sites(sites: list[str]) -> list[str]:
    """The sites of ``sites`` (in call order) that are not attention's products."""
    return [name for name in sites if not any(fnmatch.fnmatchcase(name, p) for p in ATTENTION_PATTERNS)]


def _te_nvfp4(sites: list[str] | None) -> Plan:
    plan = linear_only(_nvfp4_spec())
    if sites is None:
        return plan
    linear = _linear_sites(sites)
    kept = linear[len(linear) - math.ceil(NVFP4_BF16_TAIL * len(linear)) :] if linear else []
    bf16 = SiteSpec.uniform(OperandSpec("bf16", overflow="propagate"))
    for name in kept:
        reason = {"fprop/input": "the last ~15% of linear layers stay in BF16"}
        plan = plan.with_rule(glob.escape(name), bf16, reason)
    return plan


def _deepseek_v3(sites: list[str] | None) -> Plan:
    """FP8 fine-grained everywhere but the output head (the last linear site, known from ``sites``) and the
    MoE gating (sites named ``*.gate``), which the report keeps in their original precision."""
    plan = linear_only(
        _fine_grained("fp22_promote128", power_of_two=False, amax_epsilon=DEEPGEMM_EPS, from_decode=True)
    )
    kept = {"fprop/input": "DeepSeek-V3 keeps the MoE gating in its original precision"}
    plan = plan.with_rule("*.gate", SiteSpec(), kept, optional=True)
    if sites:
        linear = _linear_sites(sites)
        if linear:
            head = {"fprop/input": "DeepSeek-V3 keeps the output head in its original precision"}
            plan = plan.with_rule(glob.escape(linear[-1]), SiteSpec(), head)
    return plan


def _torchao_tensorwise(sites: list[str] | None) -> Plan:
    return linear_only(_hybrid(Scaling("tensor", amax_epsilon=TORCHAO_EPS), FAST_FPROP))


def _torchao_rowwise(sites: list[str] | None) -> Plan:
    operands = {
        key: OperandSpec("fp8_e4m3", scaling=_axiswise(*key, power_of_two=True)) for key in OPERAND_KEYS
    }
    return linear_only(SiteSpec(operands, FAST_FPROP))


def _torchao_rowwise_with_gw_hp(sites: list[str] | None) -> Plan:
    operands = {
        (Gemm.FPROP, Operand.INPUT): OperandSpec(
            "fp8_e4m3", scaling=_axiswise(Gemm.FPROP, Operand.INPUT, True)
        ),
        (Gemm.FPROP, Operand.WEIGHT): OperandSpec(
            "fp8_e4m3", scaling=_axiswise(Gemm.FPROP, Operand.WEIGHT, True)
        ),
        (Gemm.DGRAD, Operand.GRAD_OUTPUT): OperandSpec(
            "fp8_e4m3", scaling=_axiswise(Gemm.DGRAD, Operand.GRAD_OUTPUT, True)
        ),
        (Gemm.DGRAD, Operand.WEIGHT): OperandSpec(
            "fp8_e4m3", scaling=Scaling("tensor", power_of_two=True, amax_epsilon=TORCHAO_EPS)
        ),
    }  # wgrad: both operands in high precision
    return linear_only(SiteSpec(operands, FAST_FPROP))


def _torchao_mxfp8(sites: list[str] | None) -> Plan:
    return linear_only(SiteSpec.uniform("mxfp8_e4m3"))


def _mxfp4_tseng(sites: list[str] | None) -> Plan:
    operands = {}
    for gemm, operand in OPERAND_KEYS:
        if gemm == Gemm.FPROP:
            operands[(gemm, operand)] = OperandSpec("bf16", overflow="propagate")
        else:
            operands[(gemm, operand)] = OperandSpec(
                "mxfp4_e2m1", rounding="stochastic", transform="rht64:fresh"
            )
    return Plan(SiteSpec(operands))


_TE = "Transformer Engine, transformer_engine.common.recipe"
_TE_CODE = "NVIDIA/TransformerEngine at d0067d0 (2.20.0.dev0): transformer_engine/common/recipe/__init__.py"
_TORCHAO_CODE = (
    "pytorch/ao v0.18.0: torchao/float8/config.py (Float8LinearConfig.from_recipe_name, Float8GemmConfig), "
    "torchao/float8/float8_utils.py (EPS)"
)
RECIPES: dict[str, NamedRecipe] = {
    recipe.name: recipe
    for recipe in (
        NamedRecipe(
            "te_delayed",
            f"{_TE}.DelayedScaling (defaults: HYBRID, amax_history_len=1024, amax_compute_algo='max')",
            "FP8 HYBRID with delayed scaling: E4M3 input/weight, E5M2 grad_output, amax history of 1024",
            "margin 0; the first step uses the current amax (TE uses scale 1 there); fprop accumulates as "
            "Hopper's fast accumulation (fp22: TE's fixed _2X_ACC_FPROP = False), dgrad and wgrad in fp32",
            _te_delayed,
            f"{_TE_CODE}; transformer_engine/pytorch/module/base.py (_2X_ACC_FPROP/DGRAD/WGRAD)",
        ),
        NamedRecipe(
            "te_current",
            f"{_TE}.Float8CurrentScaling (default fp8_format HYBRID)",
            "FP8 HYBRID with per-tensor current scaling (the preset 'fp8', its fprop accumulated fast)",
            "amax_epsilon 0, scales not rounded to powers of two (TE's defaults); fprop without the split "
            "accumulator (fp8_gemm_fprop=MMParams(use_split_accumulator=False): fp22), dgrad and wgrad fp32",
            _te_current,
            _TE_CODE,
        ),
        NamedRecipe(
            "te_block",
            f"{_TE}.Float8BlockScaling (default fp8_format E4M3)",
            "FP8 E4M3 everywhere; 1x128 tiles for inputs and gradients, 128x128 for weights, "
            "power-of-two scales",
            "tiles along each GEMM's contraction axis (1x128 in fprop/dgrad, 128x1 for wgrad operands); "
            "every GEMM promotes to fp32 (TE asserts the split accumulator)",
            _te_block,
            _TE_CODE,
        ),
        NamedRecipe(
            "te_mxfp8",
            f"{_TE}.MXFP8BlockScaling (default fp8_format E4M3)",
            "MXFP8 E4M3 for every operand, gradients included; the E8M0 scale rounded up (rceil)",
            "blocks of 32 along each GEMM's contraction axis; fp32 accumulation (Blackwell's block-scaled "
            "GEMMs)",
            _te_mxfp8,
            _TE_CODE,
        ),
        NamedRecipe(
            "te_nvfp4",
            f"{_TE}.NVFP4BlockScaling; NVIDIA, 'Pretraining Large Language Models with NVFP4' (2025)",
            "NVFP4: 16x16 weight scales, random Hadamard transform (16) on wgrad, stochastic rounding of "
            "gradients, the last ~15% of linear layers in BF16",
            "the BF16 layers need the model's sites (Plan.recipe(name, sites) or numscope train, which "
            "passes them); the RHT is TE's: its fixed sign vector (rht16:28389); a NaN makes its tensor all "
            "NaN, as TE's quantizer (@nan); fp32 accumulation",
            _te_nvfp4,
            f"{_TE_CODE}; transformer_engine/pytorch/tensor/nvfp4_tensor.py (get_wgrad_sign_vector)",
            needs_sites=True,
        ),
        NamedRecipe(
            "deepseek_v3",
            "DeepSeek-AI, 'DeepSeek-V3 Technical Report' (2024), section 3.3 (FP8 training)",
            "FP8 E4M3 everywhere, 1x128 activation/gradient tiles, 128x128 weight blocks, partial sums "
            "promoted to FP32 every 128 products",
            "accumulation emulated as E8M13 (about the 14 bits the report measured) in runs of 128; tile "
            "amaxes floored at 1e-4 as DeepGEMM's casts; the output head (the last linear site, when the "
            "model's sites are given) and MoE gates (*.gate) high. As DeepGEMM computes: sf = amax/448, "
            "codes e4m3(x·(1/sf)) (scale_from_decode), the codes' products summed per run of 128 and "
            "each run's sum scaled by sa·sb at its promotion, fused into the FP32 total (float32 "
            "operands; the E8M13 accumulator is numscope's model of the tensor core's)",
            _deepseek_v3,
            "deepseek-ai/DeepGEMM at 38939a4: deep_gemm/utils/math.py (per_token_cast_to_fp8, "
            "per_block_cast_to_fp8); deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh "
            "(final_accum += scale_a * scale_b * accum at each promotion)",
            needs_sites=True,
        ),
        NamedRecipe(
            "torchao_tensorwise",
            "torchao, Float8LinearConfig.from_recipe_name('tensorwise')",
            "FP8 with per-tensor scaling: E4M3 input/weight, E5M2 grad_output",
            "scales not rounded to powers of two (torchao's default for this recipe); amax floored at "
            "torchao's EPS 1e-12; the output GEMM accumulates fast (fp22: gemm_config_output's "
            "use_fast_accum=True), the gradient GEMMs in fp32",
            _torchao_tensorwise,
            _TORCHAO_CODE,
        ),
        NamedRecipe(
            "torchao_rowwise",
            "torchao, Float8LinearConfig.from_recipe_name('rowwise')",
            "FP8 E4M3 for every operand, one power-of-two scale per row along the contraction axis",
            "axiswise scaling is row or column scaling, whichever keeps the scale along the contraction; "
            "amax floored at torchao's EPS 1e-12; the output GEMM accumulates fast (fp22)",
            _torchao_rowwise,
            _TORCHAO_CODE,
        ),
        NamedRecipe(
            "torchao_rowwise_with_gw_hp",
            "torchao, Float8LinearConfig.from_recipe_name('rowwise_with_gw_hp')",
            "FP8 E4M3 rowwise for fprop and dgrad (dgrad's weight per tensor), wgrad in high precision",
            "power-of-two scales, as torchao's rowwise recipes round them; the output GEMM accumulates fast "
            "(fp22)",
            _torchao_rowwise_with_gw_hp,
            _TORCHAO_CODE,
        ),
        NamedRecipe(
            "torchao_mxfp8",
            "torchao, MXLinearConfig.from_recipe_name('mxfp8_cublas') (torchao.prototype.mx_formats)",
            "MXFP8 E4M3 for every operand, E8M0 block scales by the OCP rule (floor), blocks of 32",
            "blocks along each GEMM's contraction axis; fp32 accumulation; torchao's 'mxfp8_cublas_rceil' "
            "rounds the scale up instead (te_mxfp8's numerics); torchao 0.18's MX training drops a Linear's "
            "bias and needs every dimension a multiple of 32, which this emulation does not",
            _torchao_mxfp8,
            "pytorch/ao: torchao/prototype/mx_formats/config.py (MXLinearRecipeName), README.md",
        ),
        NamedRecipe(
            "mxfp4_tseng2025",
            "Tseng, Yu, Park, 'Training LLMs with MXFP4' (AISTATS 2025, arXiv:2502.20586)",
            "BF16 forward; MXFP4 backward (dgrad, wgrad) with stochastic rounding and a random Hadamard "
            "transform",
            "RHT in blocks of 64 with fresh random signs for every backward GEMM call, shared by its two "
            "operands (rht64:fresh, as the authors' code: HBS=64, signs drawn in each backward); the paper "
            "scales by 3/4 before stochastic rounding so that it cannot overflow, numscope saturates "
            "instead; attention products included",
            _mxfp4_tseng,
            "amazon-science/mxfp4-llm at 0cc57fe: patch_override_scripts/Megatron-LM.patch "
            "(MXFP4LinearWithGradAccumulationAndAsyncCommunication.backward), microxcaling.patch",
        ),
    )
}


def recipe(name: str, sites: Iterable[str] | None = None) -> Plan:
    """The plan of the recipe ``name`` (see :data:`RECIPES`); ``sites``: the model's site names in call
    order, for recipes whose layer choice depends on the model."""
    found = RECIPES.get(name) if isinstance(name, str) else None
    if found is None:
        raise PlanError(_unknown("recipe", str(name), RECIPES))
    return found.build(None if sites is None else list(sites))


def recipes() -> list[NamedRecipe]:
    """Every named recipe, in a stable order."""
    return list(RECIPES.values())


register_recipes(RECIPES, recipe)
