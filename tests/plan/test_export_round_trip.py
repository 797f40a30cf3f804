"""Export then import: every preset and named recipe, exported to Transformer Engine, either comes back
operand by operand or the export lists each difference (issue 26).

Transformer Engine does not install on a CPU machine, so its recipe classes are stood in for by dataclasses
with the fields and defaults of ``transformer_engine/common/recipe/__init__.py`` (TE main, August 2026),
placed under that module name: the written file is executed as it would be on a GPU machine.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import sys
import types

import pytest
import yaml

import numscope
from numscope.plan import Plan
from numscope.plan.export import (
    ExportError,
    from_megatron,
    from_transformer_engine,
    to_megatron,
    to_transformer_engine,
)
from numscope.plan.presets import _PRESETS
from numscope.plan.recipes import RECIPES
from numscope.vocab import OPERAND_KEYS

MODULE = "transformer_engine.common.recipe"
WIDE = ("fp32", "tf32", "bf16", "fp16")


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"
    E2M1 = "E2M1"


@dataclasses.dataclass
class QParams:
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


@dataclasses.dataclass
class MMParams:
    use_split_accumulator: bool = True


@dataclasses.dataclass
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclasses.dataclass
class Float8CurrentScaling:
    use_power_2_scales: bool = False
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = dataclasses.field(default_factory=QParams)
    fp8_quant_fwd_weight: QParams = dataclasses.field(default_factory=QParams)
    fp8_quant_bwd_grad: QParams = dataclasses.field(default_factory=QParams)
    fp8_gemm_fprop: MMParams = dataclasses.field(default_factory=lambda: MMParams(False))
    fp8_gemm_dgrad: MMParams = dataclasses.field(default_factory=lambda: MMParams(True))
    fp8_gemm_wgrad: MMParams = dataclasses.field(default_factory=lambda: MMParams(True))
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None


@dataclasses.dataclass
class Float8BlockScaling:
    use_f32_scales: bool = False
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = dataclasses.field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_quant_fwd_weight: QParams = dataclasses.field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_quant_bwd_grad: QParams = dataclasses.field(default_factory=lambda: QParams(power_2_scale=True))
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = dataclasses.field(default_factory=MMParams)
    fp8_gemm_dgrad: MMParams = dataclasses.field(default_factory=MMParams)
    fp8_gemm_wgrad: MMParams = dataclasses.field(default_factory=MMParams)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None


@dataclasses.dataclass
class MXFP8BlockScaling:
    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None
    enable_2d_quantization: bool = False


@dataclasses.dataclass
class NVFP4BlockScaling:
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None


STAND_INS = (Format, QParams, MMParams, DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
             MXFP8BlockScaling, NVFP4BlockScaling)  # fmt: skip
for _cls in STAND_INS:
    _cls.__module__ = MODULE


@pytest.fixture
def transformer_engine(monkeypatch):
    """``transformer_engine.common.recipe`` importable, holding the stand-ins."""
    recipe = types.ModuleType(MODULE)
    for cls in STAND_INS:
        setattr(recipe, cls.__name__, cls)
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    root = types.ModuleType("transformer_engine")
    root.common = common
    for name, module in (
        ("transformer_engine", root),
        ("transformer_engine.common", common),
        (MODULE, recipe),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    return recipe


def bert_sites() -> list[tuple[str, str]]:
    from test_export import bert_sites as sites

    return sites()


ALL_PLANS = sorted(_PRESETS) + sorted(RECIPES)


@pytest.mark.parametrize("name", ALL_PLANS)
def test_te_export_imports_back_or_lists_each_difference(name: str, transformer_engine) -> None:
    sites = bert_sites()
    plan = Plan.named(name, [site for site, _ in sites])
    exported = to_transformer_engine(plan, sites, name)
    written: dict = {"__name__": "numscope_te"}
    exec(compile(exported.files["numscope_te.py"], "numscope_te.py", "exec"), written)
    debug = yaml.safe_load(exported.files["numscope_te_debug.yaml"]) or {}
    disabled = [
        (
            section["layers"]["layer_name_regex_pattern"],
            set(section["transformer_engine"]["DisableQuantizationGEMM"]["gemms"]),
        )
        for section in debug.values()
    ]
    differing = []
    for site, kind in sites:
        if kind != "linear":
            continue
        recipe = written["MODULE_RECIPES"].get(site, written["RECIPE"])
        imported = from_transformer_engine(recipe).for_site(site)
        high = set().union(*(gemms for pattern, gemms in disabled if re.fullmatch(pattern, site)))
        wanted = plan.for_site(site)
        for key in OPERAND_KEYS:
            spec = wanted.operand(*key)
            if key[0] in high:
                # TE's unquantized GEMM runs in the model's dtype: high, or a plain wide IEEE cast
                same = spec.is_high or (
                    spec.format in WIDE and spec.scaling is None and spec.rounding == "nearest"
                )
            else:
                same = spec == imported.operand(*key) and (
                    spec.is_high or wanted.accumulate_for(key[0]) == imported.accumulate_for(key[0])
                )
            if not same:
                differing.append((site, key))
    listed = "\n".join(exported.unexpressed)
    for site, key in differing:  # each difference is listed against its module
        assert site in listed, (name, site, key, listed[:2000])
    if not differing:
        assert all(
            ("(matmul)" in line or "(bmm)" in line or "(sdpa)" in line) for line in exported.unexpressed
        ), (
            name,
            exported.unexpressed,
        )


def test_te_plans_that_te_runs_round_trip_exactly(transformer_engine) -> None:
    """The TE recipes numscope names come back whole: nothing of the Linear layers differs."""
    sites = bert_sites()
    linear = [site for site, kind in sites if kind == "linear"]
    for name, recipe in (
        ("te_delayed", DelayedScaling()),
        ("te_current", Float8CurrentScaling()),
        ("te_block", Float8BlockScaling()),
        ("te_mxfp8", MXFP8BlockScaling()),
    ):
        plan, imported = Plan.recipe(name), from_transformer_engine(recipe)
        for site in linear:
            assert plan.for_site(site) == imported.for_site(site), name  # operands and accumulation


def test_te_import_reads_every_numerics_setting(transformer_engine) -> None:
    site = "layer.fc"
    current = from_transformer_engine(
        Float8CurrentScaling(
            fp8_format=Format.E4M3, fp8_quant_fwd_weight=QParams(power_2_scale=True, amax_epsilon=1e-6)
        )
    ).for_site(site)
    weight = current.operand("fprop", "weight").effective_scaling()
    assert weight.power_of_two and weight.amax_epsilon == 1e-6
    assert not current.operand("fprop", "input").effective_scaling().power_of_two
    assert current.operand("dgrad", "grad_output").format == "fp8_e4m3"  # E4M3, not HYBRID
    block = from_transformer_engine(
        Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
    ).for_site(site)
    assert block.operand("fprop", "input").effective_scaling().block_shape == (128, 128)
    assert block.operand("fprop", "weight").effective_scaling().block_shape == (1, 128)
    assert block.operand("dgrad", "weight").effective_scaling().block_shape == (128, 1)  # along contraction
    f32 = from_transformer_engine(
        Float8BlockScaling(
            **{
                f: QParams(power_2_scale=False)
                for f in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
            }
        )
    ).for_site(site)
    assert not f32.operand("wgrad", "input").effective_scaling().power_of_two
    hybrid = from_transformer_engine(MXFP8BlockScaling(fp8_format=Format.HYBRID)).for_site(site)
    assert hybrid.operand("wgrad", "grad_output").format == "mxfp8_e5m2@rceil"
    assert hybrid.operand("fprop", "input").format == "mxfp8_e4m3@rceil"
    plain = from_transformer_engine(
        NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True)
    ).for_site(site)
    for key in OPERAND_KEYS:
        spec = plain.operand(*key)
        assert (spec.format, spec.rounding, spec.transform) == ("nvfp4@nan", "nearest", None), key
    default = from_transformer_engine(NVFP4BlockScaling()).for_site(site)
    assert default.operand("wgrad", "grad_output").rounding == "stochastic"
    assert default.operand("wgrad", "input").transform == "rht16:28389"
    assert default.operand("fprop", "weight").format == "nvfp4@2d@nan"
    four = from_transformer_engine(NVFP4BlockScaling(disable_rht=True, nvfp4_4over6="all")).for_site(site)
    assert four.operand("fprop", "input").format == "nvfp4@4over6@mae@nan"
    assert four.operand("wgrad", "input").format == "nvfp4@4over6@mae@nan"  # its column-wise copy too
    assert four.operand("dgrad", "weight").format == "nvfp4@2d@4over6@mae@nan"
    assert four.operand("wgrad", "grad_output").format == "nvfp4@nan"  # gradients: never 4over6 in TE
    weights = from_transformer_engine(NVFP4BlockScaling(nvfp4_4over6="weights")).for_site(site)
    assert weights.operand("fprop", "weight").format == "nvfp4@2d@4over6@mae@nan"
    assert weights.operand("fprop", "input").format == "nvfp4@nan"


@pytest.mark.parametrize(
    "recipe,match",
    [
        (DelayedScaling(fp8_dpa=True), r"DelayedScaling\(fp8_dpa=True\): numscope emulates FP8 attention"),
        (Float8CurrentScaling(backward_override="high_precision"), r"backward_override='high_precision'"),
        (MXFP8BlockScaling(enable_2d_quantization=True), r"enable_2d_quantization=True"),
        (NVFP4BlockScaling(nvfp4_4over6="weights", nvfp4_4over6_err_mode="MSE"), r"err_mode='MSE'"),
        (NVFP4BlockScaling(nvfp4_4over6="all"), r"nvfp4_4over6='all' with RHT"),
        (
            NVFP4BlockScaling(nvfp4_4over6="all", nvfp4_4over6_e4m3_use_256="none", disable_rht=True),
            r"nvfp4_4over6_e4m3_use_256='none'",
        ),
        (NVFP4BlockScaling(row_scaled_activation=True), r"row_scaled_activation=True"),
        (Float8CurrentScaling(fp8_format=Format.E5M2), r"fp8_format=E5M2"),
    ],
)
def test_te_import_refuses_what_it_cannot_emulate(recipe, match: str, transformer_engine) -> None:
    with pytest.raises(ExportError, match=match):
        from_transformer_engine(recipe)


def test_te_import_checks_the_class_is_transformer_engines() -> None:
    impostor = type("DelayedScaling", (), {"fp8_format": "HYBRID"})()
    with pytest.raises(ExportError, match=r"DelayedScaling from module .* is not Transformer Engine's"):
        from_transformer_engine(impostor)


def megatron_config_checks(flags: list[str], num_layers: int) -> None:
    """TransformerConfig.__post_init__'s checks on the fp8/fp4 settings (Megatron-LM main,
    megatron/core/transformer/transformer_config.py; one pipeline stage), on the exported flags."""
    words = " ".join(line for line in flags if line.startswith("--")).split()
    values: dict[str, str | bool] = {}
    for index, word in enumerate(words):
        if word.startswith("--"):
            following = words[index + 1] if index + 1 < len(words) else "--"
            values[word] = True if following.startswith("--") else following
    fp8, fp4 = values.get("--fp8-format"), values.get("--fp4-format")
    assert fp8 in (None, "e4m3", "hybrid"), fp8  # Literal['e4m3', 'hybrid']
    assert fp4 in (None, "e2m1"), fp4
    if fp4 and fp8:
        raise ValueError("fp4 and fp8 cannot be used simultaneously. Please choose one.")
    recipe = values.get("--fp8-recipe", "delayed")
    assert recipe in ("delayed", "tensorwise", "mxfp8", "blockwise", "custom"), recipe
    if fp8 and values.get("--first-last-layers-bf16") and recipe == "delayed":
        raise ValueError("Delayed scaling does not support first / last layer in BF16.")
    if values.get("--first-last-layers-bf16"):
        for flag in ("--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"):
            assert 0 <= int(values.get(flag, 1)) <= num_layers, (flag, values)
    if fp4:
        assert values.get("--fp4-recipe", "nvfp4") == "nvfp4"


@pytest.mark.parametrize("name", ALL_PLANS)
def test_megatron_exports_pass_transformer_config_checks(name: str) -> None:
    sites = bert_sites()
    plan = Plan.named(name, [site for site, _ in sites])
    try:
        exported = to_megatron(plan, sites, name)
    except ExportError as refused:  # a refusal names the rule it would break
        assert "Megatron" in str(refused), refused
        return
    flags = exported.files["numscope_megatron_flags.txt"].splitlines()
    megatron_config_checks(flags, num_layers=4)


def test_megatron_refuses_a_delayed_plan_with_its_ends_high() -> None:
    sites = bert_sites()
    plan = Plan.recipe("te_delayed")
    for layer in (0, 3):
        plan = plan.with_rule(f"bert.encoder.layer.{layer}.*", numscope.SiteSpec())
    try:
        exported = to_megatron(plan, sites, "delayed, ends high")
    except ExportError as refused:
        assert "Delayed scaling does not support first / last layer in BF16" in str(refused)
        return
    flags = exported.files["numscope_megatron_flags.txt"].splitlines()
    megatron_config_checks(flags, num_layers=4)  # if it exports, Megatron must accept it
    assert exported.unexpressed


def test_accumulation_is_written_out_or_listed(transformer_engine) -> None:
    """Float8CurrentScaling's per-GEMM split accumulator follows the plan (written explicitly); a recipe with
    no such switch lists a plan whose accumulation differs from what TE runs."""
    sites = bert_sites()
    name = "bert.encoder.layer.0.output.dense"
    fp8 = to_transformer_engine(Plan.uniform("fp8"), sites, "fp8")  # fp32 everywhere: split accumulator on
    written: dict = {}
    exec(compile(fp8.files["numscope_te.py"], "numscope_te.py", "exec"), written)
    assert written["RECIPE"].fp8_gemm_fprop.use_split_accumulator is True
    assert from_transformer_engine(written["RECIPE"]).for_site(name).accumulate == "fp32"
    te = to_transformer_engine(Plan.recipe("te_current"), sites, "te_current")
    exec(compile(te.files["numscope_te.py"], "numscope_te.py", "exec"), written)
    assert written["RECIPE"].fp8_gemm_fprop.use_split_accumulator is False
    assert written["RECIPE"].fp8_gemm_wgrad.use_split_accumulator is True
    delayed = Plan.recipe("te_delayed")
    slow = numscope.SiteSpec(delayed.for_site(name).operands)  # fprop promoted: not what TE's constant runs
    listed = to_transformer_engine(delayed.with_rule(name, slow), sites, "delayed, fprop fp32").unexpressed
    assert (
        f"{name} fprop accumulate fp32: TE's DelayedScaling runs this GEMM accumulating in fp22"
        in "\n".join(listed)
    )


def _same(spec, got, gemm: str, wanted_accumulate: str, got_accumulate: str) -> bool:
    if spec.is_high or (spec.format in WIDE and spec.scaling is None and spec.rounding == "nearest"):
        return got.is_high  # the stack runs it in the model's dtype
    return spec == got and wanted_accumulate == got_accumulate


@pytest.mark.parametrize("name", ALL_PLANS)
def test_megatron_export_imports_back_or_lists_each_difference(name: str) -> None:
    """The flags read back (from_megatron: the TE recipe Megatron-LM builds from them) give the plan on every
    Linear site, or the export lists the difference: by the site's name, or model-wide (Megatron-LM sets
    one recipe for all layers)."""
    sites = bert_sites()
    plan = Plan.named(name, [site for site, _ in sites])
    try:
        exported = to_megatron(plan, sites, name)
    except ExportError:
        return  # refusals: test_megatron_exports_pass_transformer_config_checks
    imported = from_megatron(exported.files["numscope_megatron_flags.txt"], sites)
    names = [site for site, _ in sites]
    model_wide = [line for line in exported.unexpressed if not any(line.startswith(n) for n in names)]
    unnamed = []
    for site, kind in sites:
        if kind != "linear":
            continue
        wanted, got = plan.for_site(site), imported.for_site(site)
        for key in OPERAND_KEYS:
            same = _same(wanted.operand(*key), got.operand(*key), key[0], wanted.accumulate_for(key[0]),
                         got.accumulate_for(key[0]))  # fmt: skip
            if not same and not any(line.startswith(site) for line in exported.unexpressed):
                unnamed.append((site, key))
    assert not unnamed or model_wide, (name, unnamed[:3], exported.unexpressed)


def test_megatron_plans_that_megatron_runs_round_trip_exactly() -> None:
    """TE's current scaling with its layer ends high and wgrad high, and TE's NVFP4 recipe switches, come
    back whole from the flags."""
    sites = bert_sites()
    linear = [site for site, kind in sites if kind == "linear"]
    plan = Plan.recipe("te_current")
    for layer in (0, 3):
        plan = plan.with_rule(f"bert.encoder.layer.{layer}.*", numscope.SiteSpec())
    for pattern in ("cls.*",):
        plan = plan.with_rule(pattern, numscope.SiteSpec())
    exported = to_megatron(plan, sites, "te_current, ends high")
    assert not [line for line in exported.unexpressed if "(sdpa)" not in line], exported.unexpressed
    imported = from_megatron(exported.files["numscope_megatron_flags.txt"], sites)
    for site in linear:
        assert plan.for_site(site) == imported.for_site(site), site
    nvfp4 = from_megatron(
        ["--fp4-format e2m1", "--fp4-recipe nvfp4", "# export NVTE_NVFP4_DISABLE_RHT=1"], sites
    ).for_site("bert.encoder.layer.1.output.dense")
    assert nvfp4.operand("wgrad", "input").transform is None
    assert nvfp4.operand("wgrad", "grad_output").rounding == "stochastic"
    assert (
        from_megatron(["--fp8-format hybrid", "--fp8-recipe tensorwise", "--no-fp8-wgrad"], sites)
        .for_site("bert.encoder.layer.0.output.dense")
        .operand("wgrad", "input")
        .is_high
    )
    assert from_megatron(["--fp8-format hybrid"], sites).for_site(linear[0]).accumulate_for("fprop") == "fp22"
    with pytest.raises(ExportError, match="fp4 and fp8 cannot be used simultaneously"):
        from_megatron(["--fp8-format e4m3", "--fp4-format e2m1"], sites)
