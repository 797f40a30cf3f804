"""The plan as torchao's float8 and MX training configs (:func:`to_torchao`), and back
(:func:`from_torchao`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from numscope.formats.spec import BlockFormat
from numscope.plan.export.common import (
    _FP8_DTYPES,
    Export,
    ExportError,
    _describe,
    _enum_name,
    _high,
    _linear_sites,
)
from numscope.plan.plan import Plan
from numscope.plan.recipes import TORCHAO_EPS
from numscope.plan.spec import OperandSpec, SiteSpec
from numscope.vocab import CONTRACTION_FIRST, GEMMS, OPERAND_KEYS, OPERANDS, Gemm, Operand

#: torchao's CastConfig field for each (gemm, operand)
_TORCHAO_FIELDS = {
    (Gemm.FPROP, Operand.INPUT): "cast_config_input",
    (Gemm.FPROP, Operand.WEIGHT): "cast_config_weight",
    (Gemm.DGRAD, Operand.GRAD_OUTPUT): "cast_config_grad_output",
    (Gemm.DGRAD, Operand.WEIGHT): "cast_config_weight_for_grad_input",
    (Gemm.WGRAD, Operand.GRAD_OUTPUT): "cast_config_grad_output_for_grad_weight",
    (Gemm.WGRAD, Operand.INPUT): "cast_config_input_for_grad_weight",
}
#: torchao's per-GEMM configs (Float8GemmConfig.use_fast_accum: True is Hopper's fast accumulation, fp22
#: here; False promotes to FP32); its defaults: fast for the output GEMM only (torchao/float8/config.py)
_TORCHAO_GEMMS = {
    Gemm.FPROP: "gemm_config_output",
    Gemm.DGRAD: "gemm_config_grad_input",
    Gemm.WGRAD: "gemm_config_grad_weight",
}


def _torchao_cast(gemm: str, operand: str, spec: OperandSpec) -> tuple[str, bool | None] | str:
    """(CastConfig source, power-of-two scales or None) of one operand, or why torchao cannot do it."""
    if _high(spec):
        return "CastConfig(scaling_type=ScalingType.DISABLED)", None
    if spec.format not in _FP8_DTYPES:
        return f"{spec.format}: torchao.float8 casts to fp8_e4m3 or fp8_e5m2 only"
    scaling = spec.effective_scaling()
    axiswise = "column" if (gemm, operand) in CONTRACTION_FIRST else "row"
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
            "plans recommended for the target torchao carry the floor)"
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
        kind = "tensor" if granularity == "TENSORWISE" else ("column" if key in CONTRACTION_FIRST else "row")
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
