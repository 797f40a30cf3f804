"""The plan as a Transformer Engine recipe and debug-tools YAML (:func:`to_transformer_engine`) and back
(:func:`from_transformer_engine`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

import yaml

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
from numscope.plan.recipes import FAST_FPROP, TE_RHT
from numscope.plan.spec import OperandSpec, SiteSpec
from numscope.vocab import GEMMS, OPERAND_KEYS, OPERANDS, Gemm, Operand

#: TE's recipe classes numscope reads (transformer_engine/common/recipe/__init__.py)
TE_RECIPES = (
    "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling",
)  # fmt: skip

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


_MXFP8_NEAR = (
    "by the OCP rule's scale (2^(floor(log2 amax) - emax)), which TE does not run: they run under TE's "
    "MXFP8BlockScaling, whose scale rounds up (@rceil): a block whose amax has a mantissa above 1.75 "
    "(the E4M3 and E5M2 maxima, 448 and 57344, are 1.75 times a power of two) is scaled a power of two "
    "higher by TE, where the OCP rule clamps its largest elements to the maximum; every other block is "
    "scaled the same"
)


#: TE's recipe for MXFP8 by the OCP scale rule, which it runs with the scale rounded up (@rceil)
_NEAR_RECIPES = {
    "mxfp8_e4m3": "MXFP8BlockScaling(fp8_format=Format.E4M3)",
    "mxfp8_e5m2": "MXFP8BlockScaling(fp8_format=Format.HYBRID)",
}


def _near_recipe(spec: OperandSpec) -> str | None:
    """The TE recipe nearest an operand no TE recipe runs exactly: MXFP8 by the OCP scale rule (TE's
    MXFP8BlockScaling rounds its scale up), else None."""
    plain = spec.scaling is None and not spec.flush_subnormals and spec.rounding == "nearest"
    return _NEAR_RECIPES.get(spec.format_spec().name) if plain and spec.transform is None else None


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


#: the names of transformer_engine.common.recipe a recipe's source may use
_RECIPE_NAMES = (
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MMParams",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QParams",
)


def _used_names(*sources: str) -> list[str]:
    """The names of :data:`_RECIPE_NAMES` that the recipes' sources call or read: what the file imports."""
    text = " ".join(sources)
    return [name for name in _RECIPE_NAMES if re.search(rf"\b{name}\b", text)]


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
    unmatched: list[tuple[str, str]] = []  # (module, operand described) that no TE recipe runs as planned
    nearly: dict[str, list[str]] = {}  # module -> its MXFP8 operands by the OCP scale rule
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
                near = None if recipe is not None or _high(operand_spec) else _near_recipe(operand_spec)
                if near is not None:  # TE's MXFP8 for the OCP scale rule: listed, and counted as what runs
                    recipe = near
                    nearly.setdefault(name, []).append(f"{gemm}/{operand}")
                if _high(operand_spec):
                    unexpressed.append(
                        f"{name} {gemm}/{operand} high beside a quantized operand: TE quantizes both "
                        "operands of a GEMM or neither; the GEMM runs quantized"
                    )
                elif recipe is None:
                    unmatched.append((name, f"{name} {gemm}/{operand} {_describe(operand_spec)}"))
                else:
                    recipes[recipe] = recipes.get(recipe, 0) + 1
                    planned[(name, gemm, operand)] = recipe
                    if recipe == _NVFP4:
                        nvfp4.append((gemm, operand, operand_spec))
                        if "nan" not in operand_spec.format_spec().options and name not in without_nan:
                            without_nan.append(name)
                            unexpressed.append(f"{name} {_NVFP4_NAN}")
    unexpressed += [f"{name}: {len(keys)} MXFP8 operands {_MXFP8_NEAR}" for name, keys in nearly.items()]
    base = _one_recipe(recipes)
    unmatched_at = len(unexpressed)  # their lines go here once each module's recipe is known
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
    unexpressed[unmatched_at:unmatched_at] = [
        f"{described}: no TE recipe has these numerics for this operand; TE runs it under "
        f"{module_recipes.get(name, chosen)}"
        for name, described in unmatched
    ]
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
            *(f"    {name}," for name in _used_names(chosen, *module_recipes.values())),
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
