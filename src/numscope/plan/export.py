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

import glob
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from numscope._atomic import atomic_write_text
from numscope._names import layer_index
from numscope.errors import NumscopeError
from numscope.formats.spec import BlockFormat
from numscope.plan.plan import Plan
from numscope.plan.recipes import FAST_FPROP, TE_RHT, TORCHAO_EPS
from numscope.plan.spec import OperandSpec, SiteSpec
from numscope.vocab import GEMMS, OPERAND_KEYS, OPERANDS, Gemm, Operand

TARGETS: tuple[str, ...] = ("torchao", "te", "megatron")
#: operands whose contraction axis is their first (the layouts numscope hands to handlers)
_CONTRACTION_FIRST = {
    (Gemm.DGRAD, Operand.WEIGHT),
    (Gemm.WGRAD, Operand.GRAD_OUTPUT),
    (Gemm.WGRAD, Operand.INPUT),
}
#: torchao's CastConfig field for each (gemm, operand)
_TORCHAO_FIELDS = {
    (Gemm.FPROP, Operand.INPUT): "cast_config_input",
    (Gemm.FPROP, Operand.WEIGHT): "cast_config_weight",
    (Gemm.DGRAD, Operand.GRAD_OUTPUT): "cast_config_grad_output",
    (Gemm.DGRAD, Operand.WEIGHT): "cast_config_weight_for_grad_input",
    (Gemm.WGRAD, Operand.GRAD_OUTPUT): "cast_config_grad_output_for_grad_weight",
    (Gemm.WGRAD, Operand.INPUT): "cast_config_input_for_grad_weight",
}
_FP8_DTYPES = {"fp8_e4m3": "E4M3", "fp8_e5m2": "E5M2"}
#: torchao's per-GEMM configs (Float8GemmConfig.use_fast_accum: True is Hopper's fast accumulation, fp22
#: here; False promotes to FP32); its defaults: fast for the output GEMM only (torchao/float8/config.py)
_TORCHAO_GEMMS = {
    Gemm.FPROP: "gemm_config_output",
    Gemm.DGRAD: "gemm_config_grad_input",
    Gemm.WGRAD: "gemm_config_grad_weight",
}


class ExportError(NumscopeError, ValueError):
    """A plan that cannot be exported as asked (no sites given, an unknown target)."""


@dataclass
class Export:
    """What an export writes: ``files`` (name → text) and the lines of what the target cannot express."""

    target: str
    files: dict[str, str]
    unexpressed: list[str] = field(default_factory=list)

    def save(self, folder: str | os.PathLike[str]) -> list[Path]:
        """Write every file into ``folder`` (created), atomically; returns their paths."""
        directory = Path(folder)
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for name, text in self.files.items():
            atomic_write_text(directory / name, text)
            written.append(directory / name)
        return written


def _linear_sites(
    plan: Plan,
    sites: Iterable[tuple[str, str]],
    target: str | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> tuple[dict[str, SiteSpec], list[str]]:
    """The Linear sites' specs, and one line for each other quantized site (no target converts those).

    With ``shapes`` (a Linear site's weight shape, out × in features), a module the target's kernels cannot
    quantize at that shape (:func:`shape_problem`) is listed; for torchao and TE it stays in high precision
    (Megatron cannot keep one module high: the line says so; its flags cover the transformer layers only)."""
    linear, others = {}, []
    for name, kind in sites:
        spec = plan.for_site(name)
        if kind in ("linear", "conv1d"):
            shape = (shapes or {}).get(name)
            checked = target is not None and shape is not None
            if checked and (target != "megatron" or layer_index(name) is not None):
                quantized = [spec.operand(g, o) for g, o in OPERAND_KEYS if not _high(spec.operand(g, o))]
                problem = shape_problem(shape, [q.format for q in quantized], target)  # type: ignore[arg-type]
                if problem is not None:
                    kept = (
                        "Megatron cannot keep one module high: pad it, or TE leaves it unquantized"
                        if target == "megatron"
                        else "the module stays in high precision"
                    )
                    others.append(f"{name}: {problem}; {kept}")
                    if target != "megatron":
                        spec = SiteSpec()
            linear[name] = spec
        elif not all(_high(spec.operand(g, o)) for g, o in OPERAND_KEYS):
            others.append(f"{name} ({kind}): only Linear layers are converted; it stays in high precision")
    return linear, others


def shape_problem(shape: Sequence[int], formats: Sequence[str], target: str) -> str | None:
    """Why ``target``'s kernels cannot quantize a module whose weight has ``shape`` and whose quantized
    operands are in ``formats`` (``weight N x K: ... in multiples of M``); None where they can, or where
    nothing is quantized. The one shape check of export, ``recommend --target`` and the target's recipes."""
    if not formats:
        return None
    multiple, why = shape_multiple(formats, target)
    if not any(int(d) % multiple for d in shape):
        return None
    return f"weight {' x '.join(str(int(d)) for d in shape)}: {why} in multiples of {multiple}"


def shape_multiple(formats: Sequence[str], target: str) -> tuple[int, str]:
    """``(multiple, what needs it)`` for a module whose quantized operands are in ``formats`` on
    ``target`` (torchao, te, megatron): both weight dimensions (and the tokens of a batch) must be
    multiples of it."""
    specs = [OperandSpec(name).format_spec() for name in formats]
    block = any(isinstance(f, BlockFormat) for f in specs)
    if target == "torchao":
        if block:
            return (
                32,
                "torchao's MX cast needs the blocked dimension (torchao/prototype/mx_formats/mx_tensor.py)",
            )
        return 16, "torchao's float8 GEMM needs in and out features (torchao/float8/float8_linear_utils.py)"
    if any(f is not None and f.name.startswith("nvfp4") for f in specs):
        return (
            16,
            "TE's NVFP4 quantizer needs both dimensions (NVFP4Quantizer.is_quantizable, nvfp4_tensor.py)",
        )
    if block:
        return (
            32,
            "TE's MXFP8 quantizer needs both dimensions (MXFP8Quantizer.is_quantizable, mxfp8_tensor.py)",
        )
    return (
        16,
        "TE's FP8 Linear needs both dimensions (te.autocast's note, transformer_engine/pytorch/"
        "quantization.py)",
    )


#: formats a target runs in the model's own dtype (no scaling, no quantization kernel)
_WIDE = ("fp32", "tf32", "bf16", "fp16")


def _high(spec: OperandSpec) -> bool:
    """Whether a target keeps the operand in high precision: unquantized, or a plain wide IEEE cast (which
    a bf16/fp16 model computes in anyway)."""
    return spec.is_high or (spec.format in _WIDE and spec.scaling is None and spec.rounding == "nearest")


def _describe(spec: OperandSpec) -> str:
    return f"{spec.format} ({spec.describe_scaling()}, {spec.rounding})"


# -- torchao ----------------------------------------------------------------------------------------------


def _torchao_cast(gemm: str, operand: str, spec: OperandSpec) -> tuple[str, bool | None] | str:
    """(CastConfig source, power-of-two scales or None) of one operand, or why torchao cannot do it."""
    if _high(spec):
        return "CastConfig(scaling_type=ScalingType.DISABLED)", None
    if spec.format not in _FP8_DTYPES:
        return f"{spec.format}: torchao.float8 casts to fp8_e4m3 or fp8_e5m2 only"
    scaling = spec.effective_scaling()
    axiswise = "column" if (gemm, operand) in _CONTRACTION_FIRST else "row"
    kind = None if scaling is None else scaling.kind
    if kind not in ("tensor", axiswise) or spec.rounding != "nearest" or spec.transform is not None:
        return (
            f"{_describe(spec)}: torchao.float8 scales per tensor or axiswise along the contraction axis "
            "(here 'row' or 'column' scaling), rounds to nearest, and has no transform"
        )
    assert scaling is not None
    if scaling.margin or scaling.amax_epsilon not in (0.0, TORCHAO_EPS) or spec.flush_subnormals:
        return (
            f"{_describe(spec)}: torchao has no margin or subnormal flush, and floors every amax at "
            f"{TORCHAO_EPS:g} (EPS), not at {scaling.amax_epsilon:g}"
        )
    granularity = "TENSORWISE" if kind == "tensor" else "AXISWISE"
    source = (
        f"CastConfig(scaling_granularity=ScalingGranularity.{granularity}, "
        f"target_dtype={_FP8_DTYPES[spec.format]})"
    )
    return source, scaling.power_of_two


#: the operand each torchao cast config casts, and the dtype torchao gives a disabled one by default
_ROLE_DTYPE = {Operand.INPUT: "E4M3", Operand.WEIGHT: "E4M3", Operand.GRAD_OUTPUT: "E5M2"}


def _torchao_config(spec: SiteSpec) -> str | tuple[str, ...]:
    """The Float8LinearConfig source of one site spec, or the reasons torchao cannot express it.

    torchao's constraints: both operands of a GEMM are quantized or neither is, and an operand (input,
    weight, grad_output) has one fp8 dtype in both GEMMs it enters (a disabled cast names that dtype too).
    """
    results, problems, powers = {}, [], set()
    for gemm in GEMMS:
        if spec.accumulate_for(gemm) not in ("fp22", "fp32"):
            problems.append(
                f"{gemm} accumulate {spec.accumulate_for(gemm)}: torchao's float8 GEMM accumulates in fp22 "
                "(use_fast_accum=True) or promotes to fp32"
            )
    for gemm, operand in OPERAND_KEYS:
        result = _torchao_cast(gemm, operand, spec.operand(gemm, operand))
        if isinstance(result, str):
            problems.append(f"{gemm}/{operand} {result}")
        else:
            results[(gemm, operand)] = result
            if result[1] is not None:
                powers.add(result[1])
    for gemm in GEMMS:
        kinds = {_high(spec.operand(gemm, operand)) for operand in OPERANDS[gemm]}
        if len(kinds) > 1:
            problems.append(
                f"{gemm}: one operand quantized, the other not; torchao quantizes both or neither"
            )
    dtypes: dict[str, set[str]] = {}
    for (_, operand), (source, _) in results.items():
        if "target_dtype=" in source:
            dtypes.setdefault(operand, set()).add(source.rsplit("target_dtype=", 1)[1].rstrip(")"))
    for operand, found in dtypes.items():
        if len(found) > 1:
            problems.append(f"{operand} in {' and '.join(sorted(found))}: torchao casts it to one dtype")
    if len(powers) > 1:
        problems.append("power-of-two and other scales mixed: torchao rounds scales per module")
    if problems:
        return tuple(problems)
    casts = []
    for (gemm, operand), (source, _) in results.items():
        if source.endswith("DISABLED)"):  # the dtype the operand has where it is quantized
            dtype = next(iter(dtypes.get(operand, {_ROLE_DTYPE[operand]})))
            source = f"CastConfig(scaling_type=ScalingType.DISABLED, target_dtype={dtype})"
        casts.append(f"        {_TORCHAO_FIELDS[(gemm, operand)]}={source},")
    gemms = [
        f"        {field}=Float8GemmConfig(use_fast_accum={spec.accumulate_for(gemm) == 'fp22'}),"
        for gemm, field in _TORCHAO_GEMMS.items()
    ]
    power = powers.pop() if powers else False
    tail = [*gemms, f"        round_scales_to_power_of_2={power},", "        emulate=emulate,", "    )"]
    return "\n".join(["Float8LinearConfig(", *casts, *tail])


#: numscope's MXFP8 formats and torchao's name of their scale rule (ScaleCalculationMode)
_TORCHAO_MX_RULES = {
    "mxfp8_e4m3": "FLOOR",
    "mxfp8_e4m3@rceil": "RCEIL",
    "mxfp8_e4m3@ceil": "CEIL",
    "mxfp8_e4m3@even": "EVEN",
}


def _is_block(spec: OperandSpec) -> bool:
    return isinstance(spec.format_spec(), BlockFormat)


def _torchao_mx_config(spec: SiteSpec) -> str | tuple[str, ...]:
    """The MXFP8TrainingOpConfig source of a site spec whose quantized operands are MX, or the reasons
    torchao cannot express it: torchao 0.18 trains Linear layers in MXFP8 only (E4M3 elements, blocks of 32
    along the contraction axis, E8M0 scales), both operands of fprop and dgrad quantized, wgrad quantized
    or left in high precision (``wgrad_with_hp``), one scale rule for all."""
    if spec.accumulate != "fp32":
        return (f"accumulate {spec.describe_accumulate()}: torchao's MXFP8 GEMMs accumulate in fp32",)
    problems, rules = [], set()
    for gemm, operand in OPERAND_KEYS:
        operand_spec = spec.operand(gemm, operand)
        if _high(operand_spec) and gemm == Gemm.WGRAD:
            continue
        rule = _TORCHAO_MX_RULES.get(operand_spec.format)
        exact = (
            operand_spec.rounding == "nearest"
            and operand_spec.transform is None
            and not operand_spec.flush_subnormals
            and operand_spec.scaling is None
        )
        if rule is None or not exact:
            problems.append(
                f"{gemm}/{operand} {_describe(operand_spec)}: torchao's MX training runs mxfp8_e4m3 (scale "
                "rules floor, rceil, ceil, even) with nearest rounding, for both operands of fprop and dgrad"
            )
        else:
            rules.add(rule)
    wgrad = {_high(spec.operand(Gemm.WGRAD, operand)) for operand in OPERANDS[Gemm.WGRAD]}
    if len(wgrad) > 1:
        problems.append("wgrad: one operand quantized, the other not; torchao quantizes both or neither")
    if len(rules) > 1:
        problems.append(f"scale rules {', '.join(sorted(rules))} mixed: torchao uses one per module")
    if problems:
        return tuple(problems)
    return "\n".join(
        [
            "MXFP8TrainingOpConfig(",
            "        kernel_preference=KernelPreference.EMULATED if emulate else KernelPreference.AUTO,",
            f"        wgrad_with_hp={wgrad == {True}},",
            f"        scale_calculation_mode=ScaleCalculationMode.{rules.pop()},",
            "    )",
        ]
    )


def to_torchao(
    plan: Plan,
    sites: Iterable[tuple[str, str]],
    source: str = "a numscope plan",
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> Export:
    """A torchao module reproducing ``plan`` on the model whose ``(site name, kind)`` pairs are ``sites``
    (``shapes``: Linear weight shapes, checked against torchao's kernels)."""
    linear, unexpressed = _linear_sites(plan, sites, "torchao", shapes)
    groups: dict[str, list[str]] = {}
    unfloored: list[str] = []  # float8 modules whose operands have no amax floor
    for name, spec in linear.items():
        if all(_high(spec.operand(g, o)) for g, o in OPERAND_KEYS):
            continue
        block = any(_is_block(spec.operand(g, o)) for g, o in OPERAND_KEYS)
        config = _torchao_mx_config(spec) if block else _torchao_config(spec)
        if isinstance(config, tuple):
            unexpressed += [f"{name}: {reason}; the module stays in high precision" for reason in config]
            continue
        groups.setdefault(config, []).append(name)
        scalings = [spec.operand(g, o).effective_scaling() for g, o in OPERAND_KEYS]
        if not block and any(sc is not None and sc.amax_epsilon == 0 for sc in scalings):
            unfloored.append(name)
    if unfloored:
        named = ", ".join(unfloored[:3]) + (", ..." if len(unfloored) > 3 else "")
        unexpressed.append(
            f"{len(unfloored)} float8 module(s) ({named}): torchao floors every amax at {TORCHAO_EPS:g} (EPS "
            "in torchao/float8/float8_utils.py), the plan's operands have no floor; converted with torchao's "
            f"(they differ only where an amax is below {TORCHAO_EPS:g}; the recipes torchao_* and "
            "'recommend --target torchao' carry the floor)"
        )
    mx = any(config.startswith("MXFP8") for config in groups)
    if mx:
        unexpressed.append(
            "MXFP8 modules with a bias: torchao 0.18's MXFP8 training drops the bias (measured: its forward "
            "and gradient); convert() leaves such a module in high precision and warns"
        )
    lines = [
        f'"""torchao training for {source}, exported by numscope (float8 and MXFP8 Linear layers).',
        "",
        "    from numscope_torchao import convert",
        "    convert(model)                  # emulate=True runs torchao's emulation, e.g. on a CPU",
        "",
        "Modules are selected by their qualified names in the model the plan was made for. MXFP8 layers need",
        "in and out features, and the tokens of a batch, in multiples of 32 (torchao's block size).",
        '"""',
        "",
        "import warnings",
        "",
        "import torch",
        "from torchao.float8 import (",
        "    CastConfig,",
        "    Float8GemmConfig,",
        "    Float8LinearConfig,",
        "    ScalingGranularity,",
        "    ScalingType,",
        ")",
        "from torchao.float8 import convert_to_float8_training",
        *(
            [
                "from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig",
                "from torchao.prototype.mx_formats.config import ScaleCalculationMode",
                "from torchao.quantization import quantize_",
                "from torchao.quantization.quantize_.common import KernelPreference",
            ]
            if mx
            else []
        ),
        "",
        "E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2",
        "",
        "#: the modules of each configuration",
        "MODULES = {",
        *(f"    {index}: {sorted(names)!r}," for index, names in enumerate(groups.values())),
        "}",
        "#: what torchao cannot express of the plan (those modules stay in high precision)",
        "UNEXPRESSED = [",
        *(f"    {line!r}," for line in unexpressed),
        "]",
        "",
        "",
        "def configs(emulate: bool = False) -> dict:",
        "    return {",
        *(
            f"        {index}: {config.replace(chr(10) + '    ', chr(10) + '        ')},"
            for index, config in enumerate(groups)
        ),
        "    }",
        "",
        "",
        "def convert(model: torch.nn.Module, emulate: bool = False) -> torch.nn.Module:",
        '    """Convert the plan\'s Linear modules to torchao float8 or MXFP8 training, in place."""',
        "    for index, config in configs(emulate).items():",
        "        names = set(MODULES[index])",
        "        if isinstance(config, Float8LinearConfig):",
        "            chosen = lambda module, fqn, names=names: fqn in names  # noqa: E731",
        "            convert_to_float8_training(model, config=config, module_filter_fn=chosen)",
        "            continue",
        "        biased = sorted(n for n, m in model.named_modules() if n in names and m.bias is not None)",
        "        if biased:",
        "            warnings.warn(f'torchao MXFP8 training drops a Linear bias; kept high: {biased}')",
        "        kept = names - set(biased)",
        "        quantize_(model, config, filter_fn=lambda module, fqn, kept=kept: fqn in kept)",
        "    return model",
        "",
    ]
    return Export("torchao", {"numscope_torchao.py": "\n".join(lines)}, unexpressed)


# -- Transformer Engine -----------------------------------------------------------------------------------


#: the QParams field of a TE recipe that quantizes each operand
_TE_QPARAMS = {
    Operand.INPUT: "fp8_quant_fwd_inp",
    Operand.WEIGHT: "fp8_quant_fwd_weight",
    Operand.GRAD_OUTPUT: "fp8_quant_bwd_grad",
}

#: the placeholder an NVFP4 operand votes for; its switches are decided over the whole plan
_NVFP4 = "NVFP4BlockScaling"
#: Float8CurrentScaling's per-GEMM accumulation switches (MMParams.use_split_accumulator: False is Hopper's
#: fast accumulation, fp22 here; True promotes to FP32)
_TE_MMPARAMS = {Gemm.FPROP: "fp8_gemm_fprop", Gemm.DGRAD: "fp8_gemm_dgrad", Gemm.WGRAD: "fp8_gemm_wgrad"}
#: how TE accumulates each GEMM of a recipe by default (a SiteSpec accumulate value): Float8CurrentScaling's
#: MMParams default to a fast fprop (only this recipe has switches: _TE_MMPARAMS); DelayedScaling takes the
#: module constants _2X_ACC_FPROP = False, _2X_ACC_DGRAD = _2X_ACC_WGRAD = True
#: (transformer_engine/pytorch/module/base.py); Float8BlockScaling asserts the split accumulator for all
#: three; the block-scaled MXFP8 and NVFP4 GEMMs run on Blackwell, whose tensor cores accumulate in FP32
_TE_ACCUMULATE: dict[str, str | Mapping[str, str]] = {
    "Float8CurrentScaling": FAST_FPROP,
    "DelayedScaling": FAST_FPROP,
    "Float8BlockScaling": "fp32",
    "MXFP8BlockScaling": "fp32",
    _NVFP4: "fp32",
}


def _te_runs(kind: str, gemm: str) -> str:
    """The accumulator TE runs ``gemm`` of the recipe class ``kind`` in by default."""
    runs = _TE_ACCUMULATE.get(kind, "fp32")
    return runs if isinstance(runs, str) else runs[gemm]


def _te_accumulation(recipe: str, site: SiteSpec) -> tuple[str, list[str]]:
    """``recipe`` with its accumulation written out (Float8CurrentScaling's three MMParams, from ``site``'s
    quantized GEMMs), and what TE cannot run of ``site``'s accumulation under that recipe."""
    kind = recipe.split("(", 1)[0]
    problems = []
    quantized = [g for g in GEMMS if not all(_high(site.operand(g, o)) for o in OPERANDS[g])]
    if kind == "Float8CurrentScaling":
        switches = []
        for gemm in GEMMS:
            wanted = site.accumulate_for(gemm) if gemm in quantized else "fp32"
            if wanted not in ("fp22", "fp32"):
                problems.append(
                    f"{gemm} accumulate {wanted}: TE's FP8 GEMM accumulates in fp22 (fast accumulation, "
                    "use_split_accumulator=False) or promotes to fp32 (True)"
                )
                wanted = "fp32"
            switches.append(f"{_TE_MMPARAMS[gemm]}=MMParams(use_split_accumulator={wanted == 'fp32'})")
        return f"{recipe[:-1]}, {', '.join(switches)})", problems
    for gemm in quantized:
        wanted, runs = site.accumulate_for(gemm), _te_runs(kind, gemm)
        if wanted != runs:
            problems.append(
                f"{gemm} accumulate {wanted}: TE's {kind} runs this GEMM accumulating in {runs} "
                "(no setting changes it)"
            )
    return recipe, problems


def _te_recipe(spec: OperandSpec, gemm: str, operand: str) -> str | None:
    """The TE recipe an operand's spec is an instance of (``None``: none is); NVFP4 operands give
    :data:`_NVFP4`, whose switches :func:`_nvfp4_recipe` sets from every NVFP4 operand of the plan."""
    fmt, scaling = spec.format_spec(), spec.effective_scaling()
    if isinstance(fmt, BlockFormat) and fmt.tensor_scale:
        options = set(fmt.options)
        if not options <= {"2d", "4over6", "mae", "nan"}:  # per-row scales, divide: not TE's NVFP4
            return None
        transform_ok = spec.transform is None or (spec.transform == TE_RHT and gemm == Gemm.WGRAD)
        rounding_ok = spec.rounding == "nearest" or (
            spec.rounding == "stochastic" and operand == Operand.GRAD_OUTPUT
        )
        two_d_ok = "2d" not in options or operand == Operand.WEIGHT
        # TE's Four Over Six: MAE, on inputs and weights only, without RHT or stochastic rounding
        four_ok = "4over6" not in options or (
            "mae" in options and operand != Operand.GRAD_OUTPUT and spec.transform is None
        )
        plain = spec.scaling is None and not spec.flush_subnormals
        return _NVFP4 if transform_ok and rounding_ok and two_d_ok and four_ok and plain else None
    if spec.rounding != "nearest" or spec.transform is not None:
        return None
    if isinstance(fmt, BlockFormat):
        plain = spec.scaling is None and not spec.flush_subnormals
        if fmt.name == "mxfp8_e4m3@rceil" and plain:
            return "MXFP8BlockScaling(fp8_format=Format.E4M3)"
        if fmt.name == "mxfp8_e5m2@rceil" and plain and operand == Operand.GRAD_OUTPUT:
            return "MXFP8BlockScaling(fp8_format=Format.HYBRID)"  # TE's HYBRID: E5M2 gradients
        return None
    if spec.format not in _FP8_DTYPES or scaling is None:
        return None
    if scaling.kind == "block" and spec.format == "fp8_e4m3" and scaling.power_of_two:
        tiles = ((1, 128), (128, 1), (128, 128))
        return "Float8BlockScaling(fp8_format=Format.E4M3)" if scaling.block_shape in tiles else None
    hybrid = spec.format == ("fp8_e5m2" if operand == Operand.GRAD_OUTPUT else "fp8_e4m3")
    if not hybrid and spec.format != "fp8_e4m3":
        return None
    fp8_format = "Format.HYBRID" if hybrid and operand == Operand.GRAD_OUTPUT else "Format.E4M3"
    if scaling.kind == "tensor" and not scaling.margin:
        if not scaling.power_of_two and not scaling.amax_epsilon:
            return f"Float8CurrentScaling(fp8_format={fp8_format})"
        # TE sets these per operand role (QParams); the vote asks every role alike, so a module whose roles
        # differ gets two votes and is listed
        params = f"QParams(power_2_scale={scaling.power_of_two}, amax_epsilon={scaling.amax_epsilon!r})"
        roles = ", ".join(f"{field}={params}" for field in _TE_QPARAMS.values())
        return f"Float8CurrentScaling(fp8_format={fp8_format}, {roles})"
    if scaling.kind == "delayed":
        return (
            f"DelayedScaling(fp8_format={fp8_format}, margin={scaling.margin}, "
            f"amax_history_len={scaling.history_len}, amax_compute_algo={scaling.amax_compute!r})"
        )
    return None


#: NVFP4BlockScaling's switches and, for each, the operands whose spec decides it and how
_NVFP4_SWITCHES = (
    ("disable_rht", f"TE's random Hadamard transform ({TE_RHT}: its fixed signs) on wgrad's operands",
     lambda g, o, spec: spec.transform != TE_RHT if g == Gemm.WGRAD else None),
    ("disable_stochastic_rounding", "stochastic rounding of grad_output",
     lambda g, o, spec: spec.rounding != "stochastic" if o == Operand.GRAD_OUTPUT else None),
    ("disable_2d_quantization", "16x16 weight scales (nvfp4@2d)",
     lambda g, o, spec: "2d" not in spec.format_spec().options if o == Operand.WEIGHT else None),
)  # fmt: skip


def _nvfp4_recipe(operands: Sequence[tuple[str, str, OperandSpec]]) -> tuple[str, list[str]]:
    """TE's NVFP4BlockScaling with every switch written out, from the plan's NVFP4 operands
    ``(gemm, operand, spec)``; and a line for each switch the operands disagree on (TE sets it once)."""
    settings, problems = [], []
    for name, what, decides in _NVFP4_SWITCHES:
        votes = [decides(g, o, spec) for g, o, spec in operands]
        values = [v for v in votes if v is not None]
        value = max(set(values), key=values.count) if values else True
        if len(set(values)) > 1:
            problems.append(
                f"NVFP4 operands differ in {what}: TE's recipe switches it for every layer ({name}={value})"
            )
        settings.append(f"{name}={value}")
    four = {}  # TE's Four Over Six scope: inputs ('activations') and weights, each all or none
    for role in (Operand.INPUT, Operand.WEIGHT):
        votes = ["4over6" in spec.format_spec().options for _, o, spec in operands if o == role]
        four[role] = bool(votes) and max(set(votes), key=votes.count)
        if len(set(votes)) > 1:
            problems.append(f"NVFP4 {role}s differ in Four Over Six: TE's recipe switches it for every layer")
    scope = {(True, True): "all", (True, False): "activations", (False, True): "weights"}.get(
        (four[Operand.INPUT], four[Operand.WEIGHT]), "none"
    )
    settings.append(f"nvfp4_4over6={scope!r}")
    if scope != "none":
        settings += ["nvfp4_4over6_e4m3_use_256='all'", "nvfp4_4over6_err_mode='MAE'"]
    return f"NVFP4BlockScaling({', '.join(settings)})", problems


#: what TE's NVFP4 does that a plan's NVFP4 operand without ``@nan`` does not
_NVFP4_NAN = (
    "NVFP4 without @nan: TE makes a tensor that holds a NaN all NaN (its tensor scale is NaN), where "
    "numscope's plain NVFP4 keeps the NaN in its block"
)


def _merge_hybrid(recipes: set[str]) -> set[str]:
    """One module's recipes with E4M3-only FP8 votes joined to HYBRID where a gradient votes HYBRID (TE's
    HYBRID is E4M3 for input and weight, E5M2 for gradients)."""
    if not any("Format.HYBRID" in recipe for recipe in recipes):
        return set(recipes)
    return {r if "Float8BlockScaling" in r else r.replace("Format.E4M3", "Format.HYBRID") for r in recipes}


def _one_recipe(recipes: dict[str, int]) -> str:
    """The recipe most operands follow; E4M3-only votes join HYBRID where gradients are E5M2 (TE's HYBRID
    is E4M3 forward and E5M2 for gradients)."""
    if not recipes:
        return "Float8CurrentScaling(fp8_format=Format.HYBRID)"
    merged: dict[str, int] = {}
    hybrid = any("Format.HYBRID" in recipe for recipe in recipes)
    for recipe, count in recipes.items():
        key = (
            recipe.replace("Format.E4M3", "Format.HYBRID")
            if hybrid and "Float8BlockScaling" not in recipe
            else recipe
        )
        merged[key] = merged.get(key, 0) + count
    return max(merged, key=lambda recipe: merged[recipe])


def to_transformer_engine(
    plan: Plan,
    sites: Iterable[tuple[str, str]],
    source: str = "a numscope plan",
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> Export:
    """TE's recipe (``numscope_te.py``) and debug-tools YAML (``numscope_te_debug.yaml``) for ``plan``:
    Transformer Engine 2.13 or later (``te.autocast(recipe=...)``, ``DisableQuantizationGEMM``);
    ``shapes``: Linear weight shapes, checked against TE's quantizers."""
    linear, unexpressed = _linear_sites(plan, sites, "te", shapes)
    recipes: dict[str, int] = {}
    planned: dict[tuple[str, str, str], str] = {}
    nvfp4: list[tuple[str, str, OperandSpec]] = []
    without_nan: list[str] = []
    high: dict[str, list[str]] = {}
    for name, spec in linear.items():
        for gemm in GEMMS:
            specs = [spec.operand(gemm, operand) for operand in OPERANDS[gemm]]
            if all(_high(s) for s in specs):
                high.setdefault(name, []).append(gemm)
                continue
            for operand, operand_spec in zip(OPERANDS[gemm], specs, strict=True):
                recipe = None if _high(operand_spec) else _te_recipe(operand_spec, gemm, operand)
                if _high(operand_spec):
                    unexpressed.append(
                        f"{name} {gemm}/{operand} high beside a quantized operand: TE quantizes both "
                        "operands of a GEMM or neither; the GEMM runs quantized"
                    )
                elif recipe is None:
                    unexpressed.append(
                        f"{name} {gemm}/{operand} {_describe(operand_spec)}: no TE recipe has these numerics "
                        "for this operand"
                    )
                else:
                    recipes[recipe] = recipes.get(recipe, 0) + 1
                    planned[(name, gemm, operand)] = recipe
                    if recipe == _NVFP4:
                        nvfp4.append((gemm, operand, operand_spec))
                        if "nan" not in operand_spec.format_spec().options and name not in without_nan:
                            without_nan.append(name)
                            unexpressed.append(f"{name} {_NVFP4_NAN}")
    base = _one_recipe(recipes)
    per_module: dict[str, set[str]] = {}
    for (name, _, _), recipe in planned.items():
        per_module.setdefault(name, set()).add(recipe)
    spelled: dict[str, str] = {}  # each module's recipe with its accumulation written out
    for name, raw in per_module.items():
        found = _merge_hybrid(raw)
        if found == {base.replace("Format.HYBRID", "Format.E4M3")} and "Float8BlockScaling" not in base:
            found = {base}  # E4M3-only FP8 runs as the model's HYBRID for input and weight
        if len(found) > 1:
            unexpressed.append(
                f"{name}: operands planned as {' and '.join(sorted(found))}: TE runs one recipe per module "
                "(its autocast region)"
            )
            continue
        spelled[name], problems = _te_accumulation(found.pop(), linear[name])
        unexpressed += [f"{name} {problem}" for problem in problems]
    of_base = [r for r in spelled.values() if r == base or r.startswith(base[:-1] + ", fp8_gemm_fprop")]
    chosen = max(of_base, key=of_base.count) if of_base else _te_accumulation(base, plan.default)[0]
    module_recipes = {name: recipe for name, recipe in spelled.items() if recipe != chosen}
    if _NVFP4 in (chosen, *module_recipes.values()):
        spelled, problems = _nvfp4_recipe(nvfp4)
        unexpressed += problems
        chosen = spelled if chosen == _NVFP4 else chosen
        module_recipes = {n: spelled if r == _NVFP4 else r for n, r in module_recipes.items()}
    sections = {}
    for index, (name, gemms) in enumerate(sorted(high.items())):
        sections[f"numscope_high_{index}"] = {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": f"^{re.escape(name)}$"},
            "transformer_engine": {"DisableQuantizationGEMM": {"enabled": True, "gemms": list(gemms)}},
        }
    recipe_file = "\n".join(
        [
            f'"""Transformer Engine recipe for {source}, exported by numscope (TE 2.13 or later).',
            "",
            "    with te.autocast(enabled=True, recipe=RECIPE):",
            "        loss = model(batch)",
            "",
            "The GEMMs the plan keeps in high precision are in numscope_te_debug.yaml (TE's debug tools:",
            "debug_api.initialize(config_file='numscope_te_debug.yaml', feature_dirs=[...])); TE layers are",
            "matched by name: build them with name=<the module's qualified name>. The tokens of a batch (the",
            "rows of each GEMM) must suit TE's kernels: FP8 multiples of 8 (assert_dim_for_fp8_exec,",
            "transformer_engine/pytorch/utils.py); MXFP8 and NVFP4 block wgrad's operands along them",
            "(32, 16).",
            '"""',
            "",
            "from transformer_engine.common.recipe import (",
            "    DelayedScaling,",
            "    Float8BlockScaling,",
            "    Float8CurrentScaling,",
            "    Format,",
            "    MMParams,",
            "    MXFP8BlockScaling,",
            "    NVFP4BlockScaling,",
            "    QParams,",
            ")",
            "",
            f"RECIPE = {chosen}",
            "#: modules that run another recipe than RECIPE (apply(model) gives each its autocast region)",
            "MODULE_RECIPES = {",
            *(f"    {name!r}: {recipe}," for name, recipe in sorted(module_recipes.items())),
            "}",
            "#: what TE cannot express of the plan",
            "UNEXPRESSED = [",
            *(f"    {line!r}," for line in unexpressed),
            "]",
            "",
            "",
            "def apply(model):",
            '    """Run each module of MODULE_RECIPES in its own te.autocast region (the innermost',
            '    region decides a module\'s recipe); the rest runs under te.autocast(recipe=RECIPE)."""',
            "    import transformer_engine.pytorch as te",
            "",
            "    for name, module in model.named_modules():",
            "        if name in MODULE_RECIPES:",
            "            recipe = MODULE_RECIPES[name]",
            "",
            "            def forward(*args, _forward=module.forward, _recipe=recipe, **kwargs):",
            "                with te.autocast(enabled=True, recipe=_recipe):",
            "                    return _forward(*args, **kwargs)",
            "",
            "            module.forward = forward",
            "    return model",
            "",
        ]
    )
    debug = yaml.safe_dump(sections, sort_keys=False) if sections else "{}\n"
    files = {"numscope_te.py": recipe_file, "numscope_te_debug.yaml": debug}
    return Export("te", files, unexpressed)


# -- Megatron-LM ------------------------------------------------------------------------------------------


def to_megatron(
    plan: Plan,
    sites: Iterable[tuple[str, str]],
    source: str = "a numscope plan",
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> Export:
    """Megatron-LM's ``--fp8-*`` flags for ``plan``: the recipe of its quantized transformer layers and how
    many leading and trailing layers stay in BF16 (``--first-last-layers-bf16``); ``shapes`` as for TE."""
    linear, unexpressed = _linear_sites(plan, sites, "megatron", shapes)
    by_layer: dict[int, list[SiteSpec]] = {}
    for name, spec in linear.items():
        layer = layer_index(name)
        if layer is not None:
            by_layer.setdefault(layer, []).append(spec)
        elif not all(_high(spec.operand(g, o)) for g, o in OPERAND_KEYS):
            unexpressed.append(f"{name}: outside the transformer layers, which Megatron's fp8 flags cover")
    layers = sorted(by_layer)
    quantized = [
        layer
        for layer in layers
        if any(not _high(s.operand(g, o)) for s in by_layer[layer] for g, o in OPERAND_KEYS)
    ]
    quantized_operands = [
        (g, o, s.operand(g, o))
        for layer in quantized
        for s in by_layer[layer]
        for g, o in OPERAND_KEYS
        if not _high(s.operand(g, o))
    ]
    recipes = {_te_recipe(spec, g, o) for g, o, spec in quantized_operands}
    wgrad_high = all(
        _high(s.operand(Gemm.WGRAD, o))
        for layer in quantized
        for s in by_layer[layer]
        for o in OPERANDS[Gemm.WGRAD]
    )
    flags = []
    if quantized:
        first = [layer for layer in layers if layer < quantized[0]]
        last = [layer for layer in layers if layer > quantized[-1]]
        partly = sorted(
            {
                f"{g}/{o}"
                for layer in quantized
                for s in by_layer[layer]
                for g, o in OPERAND_KEYS
                if _high(s.operand(g, o)) and not (wgrad_high and g == Gemm.WGRAD)
            }
        )
        if partly:
            unexpressed.append(
                f"{', '.join(partly)} high inside quantized layers: Megatron quantizes every GEMM of a "
                "quantized layer (only wgrad can stay high, with --no-fp8-wgrad)"
            )
        for layer in layers:
            if quantized[0] < layer < quantized[-1] and layer not in quantized:
                unexpressed.append(
                    f"layer {layer} stays high between quantized layers: Megatron keeps only ends in BF16"
                )
        named = sorted(recipe for recipe in recipes if recipe is not None)
        recipe = _one_recipe({name: 1 for name in named})
        if None in recipes:
            unexpressed.append(
                f"some quantized operands have numerics no TE recipe has; the flags use {recipe}"
            )
        if len({r.replace("Format.E4M3", "Format.HYBRID") for r in named}) > 1:
            unexpressed.append(f"the quantized layers mix recipes {', '.join(named)}; the flags use {recipe}")
        if recipe == _NVFP4:
            nvfp4 = [(g, o, spec) for g, o, spec in quantized_operands if _te_recipe(spec, g, o) == _NVFP4]
            recipe, problems = _nvfp4_recipe(nvfp4)
            if any("nan" not in spec.format_spec().options for _, _, spec in nvfp4):
                problems.append(_NVFP4_NAN)
            unexpressed += problems
        if "QParams(" in recipe:
            unexpressed.append(
                "power-of-two scales or an amax epsilon (TE's QParams): Megatron-LM builds "
                "Float8CurrentScaling(fp8_format=...) with TE's defaults (megatron/core/fp8_utils.py); "
                "the flags give tensorwise scaling without them"
            )
        if recipe.startswith("DelayedScaling") and (first or last):
            raise ExportError(
                "delayed scaling with leading or trailing layers high: Megatron-LM's TransformerConfig "
                "rejects it ('Delayed scaling does not support first / last layer in BF16', "
                "megatron/core/transformer/transformer_config.py); keep every layer quantized or use "
                "current scaling"
            )
        kind = recipe.split("(", 1)[0]  # built with TE's defaults: no MMParams switch reaches it
        differing = sorted(
            {
                (g, s.accumulate_for(g))
                for layer in quantized
                for s in by_layer[layer]
                for g in GEMMS
                if s.accumulate_for(g) != _te_runs(kind, g) and not (wgrad_high and g == Gemm.WGRAD)
            }
        )
        for gemm, wanted in differing:
            unexpressed.append(
                f"{gemm} accumulate {wanted}: Megatron-LM builds {kind} with TE's defaults "
                f"(megatron/core/fp8_utils.py), which run {gemm} accumulating in {_te_runs(kind, gemm)}"
            )
        flags += _megatron_flags(recipe)
        if wgrad_high:
            flags.append("--no-fp8-wgrad")
        if first or last:
            flags += [
                "--first-last-layers-bf16",
                f"--num-layers-at-start-in-bf16 {len(first)}",
                f"--num-layers-at-end-in-bf16 {len(last)}",
            ]
    text = "\n".join(
        [f"# Megatron-LM flags for {source}, exported by numscope", *flags]
        + [f"# not expressed: {line}" for line in unexpressed]
    )
    return Export("megatron", {"numscope_megatron_flags.txt": text + "\n"}, unexpressed)


def _megatron_flags(recipe: str) -> list[str]:
    fmt = "hybrid" if "HYBRID" in recipe else "e4m3"
    if recipe.startswith("DelayedScaling"):
        history = re.search(r"amax_history_len=(\d+)", recipe)
        algo = re.search(r"amax_compute_algo='(\w+)'", recipe)
        margin = re.search(r"margin=(\d+)", recipe)
        return [
            f"--fp8-format {fmt}",
            "--fp8-recipe delayed",
            f"--fp8-margin {margin.group(1)}",
            f"--fp8-amax-history-len {history.group(1)}",
            f"--fp8-amax-compute-algo {algo.group(1)}",
        ]
    if recipe.startswith("MXFP8"):
        return [f"--fp8-format {fmt}", "--fp8-recipe mxfp8"]  # Megatron passes fp8_format on
    if recipe.startswith("Float8BlockScaling"):
        return ["--fp8-format e4m3", "--fp8-recipe blockwise"]
    if recipe.startswith("NVFP4"):
        switches = dict(re.findall(r"(\w+)=(True|False)", recipe))
        environment = [
            f"#   export NVTE_NVFP4_{name.upper()}={1 if value == 'True' else 0}"
            for name, value in switches.items()
        ]
        for name, value in re.findall(r"nvfp4_(4over6\w*)='(\w+)'", recipe):  # TE reads these too
            environment.append(f"#   export NVTE_NVFP4_{name.upper()}={value}")
        return [
            "--fp4-format e2m1",
            "--fp4-recipe nvfp4",
            "# Megatron-LM builds TE's NVFP4BlockScaling() with its defaults, which TE reads from the",
            "# environment when it is imported; set before launching:",
            *environment,
        ]
    return [f"--fp8-format {fmt}", "--fp8-recipe tensorwise"]


def _megatron_settings(flags: str | Iterable[str]) -> dict[str, str | bool]:
    """The ``--flag value`` pairs and ``NVTE_*`` environment settings of Megatron-LM flags (the text
    :func:`to_megatron` writes, or a list of arguments)."""
    lines = flags.splitlines() if isinstance(flags, str) else list(flags)
    words: list[str] = []
    settings: dict[str, str | bool] = {}
    for line in lines:
        line = line.strip()
        found = re.match(r"#\s*export\s+(NVTE_\w+)=(\S+)", line)
        if found:
            settings[found.group(1)] = found.group(2)
        elif not line.startswith("#"):
            words += line.split()
    for index, word in enumerate(words):
        if word.startswith("--"):
            following = words[index + 1] if index + 1 < len(words) else "--"
            settings[word] = True if following.startswith("--") else following
    return settings


def from_megatron(flags: str | Iterable[str], sites: Iterable[tuple[str, str]]) -> Plan:
    """Megatron-LM's fp8/fp4 flags (and the ``NVTE_NVFP4_*`` environment TE reads) as a plan for the model
    whose ``(site name, kind)`` pairs are ``sites``: the TE recipe Megatron-LM builds from them
    (megatron/core/fp8_utils.py, fp4_utils.py: ``Float8CurrentScaling(fp8_format=...)``,
    ``DelayedScaling`` with margin, history and algorithm, ``Float8BlockScaling``, ``MXFP8BlockScaling``,
    ``NVFP4BlockScaling()``), read as :func:`from_transformer_engine` reads it, on every Linear site of the
    transformer layers; ``--first-last-layers-bf16`` keeps the leading and trailing layers high,
    ``--no-fp8-wgrad`` wgrad; everything outside the layers stays high."""
    settings = _megatron_settings(flags)
    fp8, fp4 = settings.get("--fp8-format"), settings.get("--fp4-format")
    if fp8 and fp4:
        raise ExportError("fp4 and fp8 cannot be used simultaneously (Megatron-LM's TransformerConfig)")
    attributes: dict[str, Any] = {}
    if fp4:
        if settings.get("--fp4-recipe", "nvfp4") != "nvfp4":
            raise ExportError(f"--fp4-recipe {settings['--fp4-recipe']}: numscope reads nvfp4")
        kind = "NVFP4BlockScaling"
        for switch in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            attributes[switch] = settings.get(f"NVTE_NVFP4_{switch.upper()}", "0") == "1"
        attributes["nvfp4_4over6"] = settings.get("NVTE_NVFP4_4OVER6", "none")
        attributes["nvfp4_4over6_e4m3_use_256"] = settings.get("NVTE_NVFP4_4OVER6_E4M3_USE_256", "all")
        attributes["nvfp4_4over6_err_mode"] = settings.get("NVTE_NVFP4_4OVER6_ERR_MODE", "MAE")
    elif fp8:
        if fp8 not in ("e4m3", "hybrid"):
            raise ExportError(f"--fp8-format {fp8}: Megatron-LM allows e4m3 and hybrid")
        recipe = settings.get("--fp8-recipe", "delayed")
        kinds = {
            "delayed": "DelayedScaling",
            "tensorwise": "Float8CurrentScaling",
            "blockwise": "Float8BlockScaling",
            "mxfp8": "MXFP8BlockScaling",
        }
        if recipe not in kinds:
            raise ExportError(f"--fp8-recipe {recipe}: numscope reads {', '.join(kinds)}")
        kind = kinds[str(recipe)]
        attributes["fp8_format"] = str(fp8).upper() if kind != "Float8BlockScaling" else "E4M3"
        if kind == "DelayedScaling":
            attributes["margin"] = int(settings.get("--fp8-margin", 0))
            attributes["amax_history_len"] = int(settings.get("--fp8-amax-history-len", 1))
            attributes["amax_compute_algo"] = str(settings.get("--fp8-amax-compute-algo", "most_recent"))
    else:
        return Plan(SiteSpec())
    # the recipe object Megatron-LM builds, as TE's class (read by attribute)
    recipe_object = type(kind, (), {"__module__": "transformer_engine.common.recipe", **attributes})()
    spec = from_transformer_engine(recipe_object).default
    if settings.get("--no-fp8-wgrad"):
        spec = SiteSpec({k: v for k, v in spec.operands.items() if k[0] != Gemm.WGRAD}, spec.accumulate)
    listed = list(sites)
    layers = sorted({i for name, _ in listed if (i := layer_index(name)) is not None})
    ends = bool(settings.get("--first-last-layers-bf16"))
    first = int(settings.get("--num-layers-at-start-in-bf16", 1)) if ends else 0
    last = int(settings.get("--num-layers-at-end-in-bf16", 1)) if ends else 0
    quantized = set(layers[first : len(layers) - last])
    plan = Plan(SiteSpec())
    for name, site_kind in listed:
        if site_kind in ("linear", "conv1d") and layer_index(name) in quantized:
            plan = plan.with_rule(glob.escape(name), spec)
    return plan


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


# -- import: the libraries' own configurations as plans ----------------------------------------------------


def _enum_name(value: object) -> str:
    return str(getattr(value, "name", value)).upper()


def from_torchao(config: object) -> Plan:
    """A torchao ``Float8LinearConfig`` or ``MXFP8TrainingOpConfig`` as a plan, so that numscope emulates
    and measures it exactly (the MX one: ``mxfp8_e4m3`` with its scale rule, wgrad high for
    ``wgrad_with_hp``).

    Read by attribute (torchao need not be importable here): each cast config becomes its operand's spec
    (DISABLED: high; TENSORWISE: per-tensor scaling; AXISWISE: row or column scaling along the contraction
    axis), ``round_scales_to_power_of_2`` the power-of-two option, each ``gemm_config_*``'s
    ``use_fast_accum`` its GEMM's accumulation (fp22, else fp32); attention products stay high, as torchao
    converts Linear layers only.
    """
    from numscope.formats.scaling import Scaling
    from numscope.plan.recipes import linear_only

    if hasattr(config, "scale_calculation_mode") and hasattr(
        config, "wgrad_with_hp"
    ):  # MXFP8TrainingOpConfig
        rule = _enum_name(config.scale_calculation_mode)
        fmt = next((name for name, mode in _TORCHAO_MX_RULES.items() if mode == rule), None)
        if fmt is None:
            raise ExportError(f"scale_calculation_mode {rule}: no numscope MX scale rule of that name")
        high = bool(config.wgrad_with_hp)
        return linear_only(
            SiteSpec({(g, o): "high" if high and g == Gemm.WGRAD else fmt for g, o in OPERAND_KEYS})
        )
    power = bool(getattr(config, "round_scales_to_power_of_2", False))
    names = {"FLOAT8_E4M3FN": "fp8_e4m3", "FLOAT8_E5M2": "fp8_e5m2"}
    operands = {}
    for key, field_name in _TORCHAO_FIELDS.items():
        cast = getattr(config, field_name)
        if _enum_name(cast.scaling_type) == "DISABLED":
            continue
        dtype = str(cast.target_dtype).rsplit(".", 1)[-1].upper()
        if dtype not in names:
            raise ExportError(
                f"{field_name}: torchao target dtype {cast.target_dtype} has no numscope format"
            )
        granularity = _enum_name(cast.scaling_granularity)
        kind = "tensor" if granularity == "TENSORWISE" else ("column" if key in _CONTRACTION_FIRST else "row")
        scaling = Scaling(kind, power_of_two=power, amax_epsilon=TORCHAO_EPS)  # type: ignore[arg-type]
        operands[key] = OperandSpec(names[dtype], scaling=scaling)
    accumulate = {}
    for gemm, field_name in _TORCHAO_GEMMS.items():
        gemm_config = getattr(config, field_name, None)
        fast = (
            gemm == Gemm.FPROP if gemm_config is None else bool(getattr(gemm_config, "use_fast_accum", False))
        )
        accumulate[gemm] = "fp22" if fast else "fp32"
    return linear_only(SiteSpec(operands, accumulate))


#: TE's recipe classes numscope reads (transformer_engine/common/recipe/__init__.py)
TE_RECIPES = (
    "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling",
)  # fmt: skip


def _te_refuse(kind: str, setting: str, why: str) -> ExportError:
    return ExportError(f"Transformer Engine {kind}({setting}): {why}; numscope cannot import this recipe")


def _te_qparams(recipe: object, kind: str, operand: str, power_default: bool) -> tuple[bool, float]:
    """``(power_2_scale, amax_epsilon)`` of the recipe's QParams for ``operand``."""
    params = getattr(recipe, _TE_QPARAMS[operand], None)
    power = bool(getattr(params, "power_2_scale", power_default))
    epsilon = float(getattr(params, "amax_epsilon", 0.0))
    for switch in ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization"):
        if getattr(params, switch, False):
            raise _te_refuse(
                kind, f"{_TE_QPARAMS[operand]}.{switch}=True", "an FP8 recipe has no such option"
            )
    return power, epsilon


def from_transformer_engine(recipe: object) -> Plan:
    """A Transformer Engine recipe object as a plan, read by attribute (TE need not be importable here):
    ``DelayedScaling`` (format, margin, history length, amax algorithm), ``Float8CurrentScaling`` (format,
    each operand's ``QParams``: power-of-two scales, amax epsilon), ``Float8BlockScaling`` (format, block
    dimension 1 or 2 of inputs, weights and gradients, power-of-two scales), ``MXFP8BlockScaling`` (E4M3 or
    HYBRID, TE's rounded-up E8M0 scale) and ``NVFP4BlockScaling`` (its RHT, stochastic-rounding and 2-D
    switches).

    The class must come from ``transformer_engine`` (a class named like one elsewhere is refused). Settings
    numscope cannot emulate are refused by name, never dropped: FP8 attention (``fp8_dpa``, ``fp8_mha``),
    ``backward_override``, MXFP8's 2-D weight scales, NVFP4's row-scaled activations and 4over6. Attention
    products stay high, as TE converts Linear layers only. GEMM accumulation: Float8CurrentScaling's
    ``fp8_gemm_fprop``/``dgrad``/``wgrad`` (``use_split_accumulator=False`` is fp22, Hopper's fast
    accumulation; True fp32), DelayedScaling's fixed fp22 fprop, FP32 elsewhere. Not read: ``reduce_amax``
    (a distributed setting that does not change one process's numerics).
    """
    from numscope.formats.scaling import Scaling
    from numscope.plan.recipes import _nvfp4_spec, _tile, linear_only

    kind = type(recipe).__name__
    module = type(recipe).__module__ or ""
    if kind not in TE_RECIPES:
        raise ExportError(
            f"a Transformer Engine recipe of type {kind!r} is not known; known: {', '.join(TE_RECIPES)}"
        )
    if module.split(".")[0] != "transformer_engine":
        raise ExportError(
            f"{kind} from module {module!r} is not Transformer Engine's (transformer_engine.common.recipe)"
        )
    for flag in ("fp8_dpa", "fp8_mha"):
        if getattr(recipe, flag, False):
            raise _te_refuse(
                kind, f"{flag}=True", "numscope emulates FP8 attention only through its own plans"
            )
    override = getattr(recipe, "backward_override", None)
    if override is not None:
        raise _te_refuse(kind, f"backward_override={override!r}", "numscope has no such backward mode")
    hybrid_default = kind in ("DelayedScaling", "Float8CurrentScaling")  # TE's defaults
    fmt = _enum_name(getattr(recipe, "fp8_format", "HYBRID" if hybrid_default else "E4M3"))
    if fmt not in ("HYBRID", "E4M3"):
        raise _te_refuse(kind, f"fp8_format={fmt}", "numscope reads HYBRID and E4M3 (TE's own choices)")

    def element(operand: str) -> str:
        return "fp8_e5m2" if fmt == "HYBRID" and operand == Operand.GRAD_OUTPUT else "fp8_e4m3"

    operands: dict[tuple[str, str], OperandSpec] = {}
    if kind == "NVFP4BlockScaling":
        if getattr(recipe, "row_scaled_activation", False):
            raise _te_refuse(kind, "row_scaled_activation=True", "numscope's import reads the default only")
        scope = str(getattr(recipe, "nvfp4_4over6", "none"))
        scopes = {
            "none": (),
            "weights": (Operand.WEIGHT,),
            "activations": (Operand.INPUT,),
            "all": (Operand.INPUT, Operand.WEIGHT),
        }
        if scope not in scopes:
            raise _te_refuse(kind, f"nvfp4_4over6={scope!r}", "TE allows none, weights, activations, all")
        four_roles = scopes[scope]
        if four_roles:
            mode = str(getattr(recipe, "nvfp4_4over6_err_mode", "MAE")).upper()
            if mode != "MAE":
                raise _te_refuse(
                    kind, f"nvfp4_4over6_err_mode={mode!r}", "numscope emulates TE's Four Over Six with MAE"
                )
            bound = str(getattr(recipe, "nvfp4_4over6_e4m3_use_256", "all"))
            if bound != "all" and bound != scope:
                raise _te_refuse(
                    kind,
                    f"nvfp4_4over6_e4m3_use_256={bound!r}",
                    "numscope's Four Over Six uses the 256 bound",
                )
            if Operand.INPUT in four_roles and not getattr(recipe, "disable_rht", False):
                raise _te_refuse(
                    kind, f"nvfp4_4over6={scope!r} with RHT", "TE raises: 4over6 does not support RHT"
                )
        for key, spec in _nvfp4_spec().operands.items():  # TE's defaults, each switch undoing one
            if getattr(recipe, "disable_rht", False):
                spec = replace(spec, transform=None)
            if getattr(recipe, "disable_stochastic_rounding", False):
                spec = replace(spec, rounding="nearest")
            options = [o for o in spec.format_spec().options if o != "nan"]  # type: ignore[union-attr]
            if getattr(recipe, "disable_2d_quantization", False):
                options = [o for o in options if o != "2d"]
            if key[1] in four_roles:
                options += ["4over6", "mae"]
            spec = replace(spec, format="@".join(["nvfp4", *options, "nan"]))
            operands[key] = spec
        return linear_only(SiteSpec(operands, _TE_ACCUMULATE[kind]))
    if kind == "MXFP8BlockScaling":
        if getattr(recipe, "enable_2d_quantization", False):
            raise _te_refuse(
                kind, "enable_2d_quantization=True", "numscope's MXFP8 has 1-D blocks of 32 only"
            )
        for gemm, operand in OPERAND_KEYS:
            name = "mxfp8_e5m2@rceil" if element(operand) == "fp8_e5m2" else "mxfp8_e4m3@rceil"
            operands[(gemm, operand)] = OperandSpec(name)
        return linear_only(SiteSpec(operands, _TE_ACCUMULATE[kind]))
    for gemm, operand in OPERAND_KEYS:
        if kind == "DelayedScaling":
            scaling = Scaling(
                "delayed",
                margin=int(getattr(recipe, "margin", 0)),
                history_len=int(getattr(recipe, "amax_history_len", 1024)),
                amax_compute=str(getattr(recipe, "amax_compute_algo", "max")),  # type: ignore[arg-type]
            )
        elif kind == "Float8CurrentScaling":
            power, epsilon = _te_qparams(
                recipe, kind, operand, bool(getattr(recipe, "use_power_2_scales", False))
            )
            scaling = Scaling("tensor", power_of_two=power, amax_epsilon=epsilon)
        else:  # Float8BlockScaling
            power, epsilon = _te_qparams(recipe, kind, operand, not getattr(recipe, "use_f32_scales", False))
            field_name = {Operand.INPUT: "x", Operand.WEIGHT: "w", Operand.GRAD_OUTPUT: "grad"}[
                operand
            ] + "_block_scaling_dim"
            dim = int(getattr(recipe, field_name, 2 if operand == Operand.WEIGHT else 1))
            if dim not in (1, 2):
                raise _te_refuse(
                    kind, f"{field_name}={dim}", "TE allows 1 (1x128 tiles) or 2 (128x128 blocks)"
                )
            if dim == 2:
                scaling = Scaling("block", block_shape=(128, 128), power_of_two=power, amax_epsilon=epsilon)
            else:
                scaling = _tile(gemm, operand, power, epsilon)
        operands[(gemm, operand)] = OperandSpec(element(operand), scaling=scaling)
    accumulate = _TE_ACCUMULATE[kind]
    if kind == "Float8CurrentScaling":  # its MMParams, TE's defaults where a field is missing
        accumulate = {}
        for gemm, field_name in _TE_MMPARAMS.items():
            default = _te_runs(kind, gemm) == "fp32"
            params = getattr(recipe, field_name, None)
            split = default if params is None else bool(getattr(params, "use_split_accumulator", default))
            accumulate[gemm] = "fp32" if split else "fp22"
    return linear_only(SiteSpec(operands, accumulate))
