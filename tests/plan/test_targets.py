"""Plans for a training stack (``recommend --target``): only what the stack runs, exported whole."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import numscope
from numscope.advisor import AdvisorError, advise
from numscope.plan import HIGH, Plan
from numscope.plan.export import ExportError, export, to_megatron, to_transformer_engine
from numscope.plan.spec import PlanError
from numscope.plan.targets import TARGETS, get_target
from numscope.vocab import GEMMS, OPERANDS
from numscope.workflow import analysis_average_bits
from tiny_models import tiny_bert

CANDIDATES = ["bf16", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3@rceil", "nvfp4", "mxfp4_e2m1"]
NO_LIMITS = dict(max_be_ratio=None, min_sqnr_db=None, max_underflow_pct=None, max_overflow_pct=None)
STACKS = ("te", "torchao", "megatron")


def observe_bert(vocab_size: int = 96, steps: int = 2):
    """A 2-layer BERT masked LM observed for ``steps`` training steps: its analysis and its sites."""
    model = tiny_bert(vocab_size=vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    with numscope.observe(model, candidates=CANDIDATES) as observer:
        for _ in range(steps):
            ids = torch.randint(5, vocab_size, (4, 16))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            observer.step()
    analysis = observer.analysis()
    sites = [tuple(pair) for pair in analysis.meta["site_kinds"]]
    return analysis, sites


@pytest.fixture(scope="module")
def observed():
    return observe_bert()


def _cheapest(analysis, target: str) -> float:
    return advise(analysis, target=target, **NO_LIMITS).average_bits


def _quantized_formats(plan: Plan, sites) -> set[str]:
    return {
        plan.for_site(name).operand(g, o).format
        for name, _ in sites
        for g in GEMMS
        for o in OPERANDS[g]
        if not plan.for_site(name).operand(g, o).is_high
    }


@pytest.mark.parametrize("target", STACKS)
def test_a_target_plan_is_what_its_stack_runs_and_exports_whole(observed, target: str) -> None:
    analysis, sites = observed
    cheapest = _cheapest(analysis, target)
    budget = (cheapest + 32.0) / 2
    result = advise(analysis, target=target, bit_budget=budget, **NO_LIMITS)
    plan = result.plan
    assert result.average_bits <= budget + 1e-9
    assert math.isclose(analysis_average_bits(plan, analysis), result.average_bits, rel_tol=1e-9)
    assert cheapest < result.average_bits  # the budget left room, and the solver spent some of it
    stack = get_target(target)
    formats = _quantized_formats(plan, sites)
    recipes = [set(r.formats.values()) for r in stack.recipes]
    if stack.one_recipe:
        assert formats and any(formats <= recipe for recipe in recipes)  # one recipe for the model
    for name, _ in sites:  # one recipe per module (TE: its autocast region)
        assert any(_quantized_formats(plan, [(name, "")]) <= recipe for recipe in recipes), name
    layers_quantized = {}
    for name, kind in sites:
        spec = plan.for_site(name)
        if kind not in ("linear", "conv1d"):
            assert spec.is_high, name  # attention products: no stack converts them
            continue
        for gemm in GEMMS:
            states = {spec.operand(gemm, operand).is_high for operand in OPERANDS[gemm]}
            assert len(states) == 1, (name, gemm)  # both operands of a GEMM quantized, or neither
        layer = numscope._names.layer_index(name)
        if spec.operand("fprop", "input").format.startswith("fp8_"):  # what the stack's FP8 GEMM runs
            fast = target == "megatron"  # Megatron builds TE's Float8CurrentScaling with its defaults
            assert spec.accumulate_for("fprop") == ("fp22" if fast else "fp32"), (target, name)
        if target == "megatron":
            if layer is None:
                assert spec.is_high, name  # the output layer is outside Megatron's fp8/fp4 layers
            else:
                whole = {spec.operand(g, o).is_high for g in GEMMS for o in OPERANDS[g]}
                assert len(whole) == 1, name
                layers_quantized.setdefault(layer, set()).update(whole)
    if target == "megatron":
        pattern = [layers_quantized[layer] == {False} for layer in sorted(layers_quantized)]
        assert all(len(states) == 1 for states in layers_quantized.values())
        inner = [i for i, quantized in enumerate(pattern) if quantized]
        assert inner, "the budget left room for quantized layers"
        assert inner == list(range(inner[0], inner[-1] + 1))  # ends high, never a middle layer
    assert export(plan, target, sites).unexpressed == []
    rows = {choice.reason for choice in result.choices if choice.format != HIGH}
    assert all(f"{target} recipe" in row and "noise" in row for row in rows)  # the objective and its value


def test_the_budget_keeps_high_the_gemm_whose_quantization_costs_most(observed) -> None:
    analysis, sites = observed
    costly = ("bert.encoder.layer.1.output.dense", "dgrad")

    def objective(key, label):
        return 1000.0 if key[:2] == costly else 1.0

    everything = advise(analysis, target="te", objective=objective, **NO_LIMITS)
    keys = [k for k in analysis.operands if k[:2] == costly]
    total = sum(analysis.elements.values())
    room = sum(analysis.elements[k] * (32.0 - 4.5) for k in keys) / total
    result = advise(
        analysis, target="te", objective=objective, bit_budget=everything.average_bits + room, **NO_LIMITS
    )
    high = {c.key for c in result.choices if c.format == HIGH and c.key[0] in dict(sites)}
    linear = {name for name, kind in sites if kind == "linear"}
    assert {k for k in high if k[0] in linear} == set(keys)
    assert {c.format for c in result.choices if c.format != HIGH} == {"nvfp4"}  # measured as
    assert _quantized_formats(result.plan, sites) <= {"nvfp4@nan"}  # planned as TE runs it
    assert "would add 2e+03 to the objective" in next(c.reason for c in result.choices if c.key == keys[0])


def test_te_runs_a_module_in_another_recipe_where_that_costs_less_and_the_export_says_how(observed) -> None:
    """NVFP4 hurts one module a lot and FP8 hardly: within a budget that cannot keep it high, TE's plan
    runs that module under FP8 (its own autocast region) and the rest in NVFP4."""
    analysis, sites = observed
    target = "bert.encoder.layer.1.output.dense"

    def objective(key, label):
        return 1000.0 if key[0] == target and label == "nvfp4" else 1.0

    cheapest = advise(analysis, target="te", objective=objective, **NO_LIMITS).average_bits
    keys = [k for k in analysis.operands if k[0] == target]
    room = sum(analysis.elements[k] * (8.0 - 4.5) for k in keys) / sum(analysis.elements.values())
    result = advise(
        analysis, target="te", objective=objective, bit_budget=cheapest + room * 1.01, **NO_LIMITS
    )
    assert _quantized_formats(result.plan, [(target, "")]) == {"fp8_e4m3", "fp8_e5m2"}
    others = [(name, kind) for name, kind in sites if name != target]
    assert _quantized_formats(result.plan, others) == {"nvfp4@nan"}
    exported = export(result.plan, "te", sites)
    assert exported.unexpressed == []
    text = exported.files["numscope_te.py"]
    spelled = (  # accumulation written out: every GEMM promoted to fp32, as the target's plan accumulates
        "Float8CurrentScaling(fp8_format=Format.HYBRID, "
        "fp8_gemm_fprop=MMParams(use_split_accumulator=True), "
        "fp8_gemm_dgrad=MMParams(use_split_accumulator=True), "
        "fp8_gemm_wgrad=MMParams(use_split_accumulator=True))"
    )
    assert f"    {target!r}: {spelled}," in text
    assert result.plan.for_site(target).accumulate == "fp32"
    assert "RECIPE = NVFP4BlockScaling(" in text and "def apply(model):" in text


def test_megatron_keeps_the_layer_that_costs_most_high_at_an_end(observed) -> None:
    analysis, sites = observed

    def objective(key, label):
        return 1000.0 if ".layer.1." in key[0] else 1.0

    cheapest = advise(analysis, target="megatron", objective=objective, **NO_LIMITS).average_bits
    linear = {name for name, kind in sites if kind == "linear"}
    last = [k for k in analysis.operands if ".layer.1." in k[0] and k[0] in linear]
    room = sum(analysis.elements[k] * (32.0 - 4.5) for k in last) / sum(analysis.elements.values())
    budget = cheapest + room * 1.01
    result = advise(analysis, target="megatron", objective=objective, bit_budget=budget, **NO_LIMITS)
    for name, kind in sites:
        if kind == "linear" and ".layer." in name:
            assert result.plan.for_site(name).is_high == (".layer.1." in name), name
    text = export(result.plan, "megatron", sites).files["numscope_megatron_flags.txt"]
    assert "--num-layers-at-start-in-bf16 0" in text and "--num-layers-at-end-in-bf16 1" in text


def test_without_a_budget_a_target_takes_its_cheapest_recipe_within_the_limits(observed) -> None:
    analysis, sites = observed
    loose = advise(analysis, target="te", **NO_LIMITS)
    assert _quantized_formats(loose.plan, sites) == {"nvfp4@nan"}
    strict = advise(analysis, target="te", min_sqnr_db=60.0, max_be_ratio=None)
    assert strict.plan.for_site("bert.encoder.layer.0.attention.self.query").is_high
    assert any("fails a limit" in c.reason for c in strict.choices)


def test_the_emulation_target_is_the_plain_advisor(observed) -> None:
    analysis, _ = observed
    assert (
        advise(analysis, target="emulation", bit_budget=7, **NO_LIMITS).plan
        == advise(analysis, bit_budget=7, **NO_LIMITS).plan
    )


def test_target_mistakes_are_named(observed) -> None:
    analysis, _ = observed
    with pytest.raises(AdvisorError, match="unknown target 'tee'; did you mean 'te'"):
        advise(analysis, target="tee")
    with pytest.raises(AdvisorError, match="decides per gemm"):
        advise(analysis, target="te", per_operand={"*": {"min_sqnr_db": 1}})
    with pytest.raises(AdvisorError, match=r"impossible for target 'te'.*raise `bit_budget`"):
        advise(analysis, target="te", bit_budget=4.0, **NO_LIMITS)
    old = replace(analysis, meta={k: v for k, v in analysis.meta.items() if k != "site_kinds"})
    with pytest.raises(AdvisorError, match=r"does not record its sites' kinds.*analyze again"):
        advise(old, target="torchao")
    with pytest.raises(AdvisorError, match="none of its recipes was measured; observe with fp8_e4m3"):
        advise(analysis, target="torchao", candidates=["bf16", "nvfp4"])
    assert set(TARGETS) == {"emulation", "te", "torchao", "megatron"}
    with pytest.raises(PlanError):
        get_target("onnx")


# -- what the exports write for the numerics the targets choose --------------------------------------------
def test_transformer_engine_gets_every_nvfp4_switch_written_out(observed) -> None:
    _, sites = observed
    names = [name for name, _ in sites]
    plain = to_transformer_engine(Plan.uniform("nvfp4"), sites).files["numscope_te.py"]
    assert (
        "RECIPE = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, "
        "disable_2d_quantization=True, nvfp4_4over6='none')" in plain
    )
    recipe = to_transformer_engine(Plan.recipe("te_nvfp4", names), sites)
    assert (
        "RECIPE = NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=False, "
        "disable_2d_quantization=False, nvfp4_4over6='none')" in recipe.files["numscope_te.py"]
    )
    assert "DisableQuantizationGEMM" in recipe.files["numscope_te_debug.yaml"]
    assert "te.autocast(enabled=True, recipe=RECIPE)" in recipe.files["numscope_te.py"]
    assert not any("differ in" in line for line in recipe.unexpressed)
    mixed = Plan.uniform("nvfp4").with_rule(
        "bert.encoder.layer.0.*",
        numscope.SiteSpec.uniform(numscope.OperandSpec("nvfp4", rounding="stochastic")),
    )
    lines = to_transformer_engine(mixed, sites).unexpressed
    assert any("stochastic rounding of grad_output" in line for line in lines)  # not silently one way


def test_megatron_refuses_delayed_scaling_with_layers_kept_high_and_sets_nvfp4_switches(observed) -> None:
    _, sites = observed
    delayed = Plan.recipe("te_delayed").with_rule("bert.encoder.layer.0.*", numscope.SiteSpec())
    with pytest.raises(ExportError, match="Delayed scaling does not support first / last layer in BF16"):
        to_megatron(delayed, sites)
    text = to_megatron(Plan.uniform("nvfp4"), sites).files["numscope_megatron_flags.txt"]
    assert "--fp4-recipe nvfp4" in text and "export NVTE_NVFP4_DISABLE_RHT=1" in text
    assert "export NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1" in text


def test_heuristic_plans_follow_the_order_the_sites_ran_not_their_names() -> None:
    """A causal LM's head is named lm_head, which sorts before model.layers.*: the recorded call order puts
    it last, where the layer-position heuristics must find it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from numscope.study.operands import Operands

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with numscope.observe(model, candidates=["fp8_e4m3"]) as observer:
        ids = torch.randint(0, 64, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        observer.step()
    sites = Operands.from_analysis(observer.analysis()).sites()
    assert sites[-1] == "lm_head" and sites[0].startswith("model.layers.0.")
    assert sorted(sites)[0] == "lm_head"  # by name it would have come first


@pytest.mark.parametrize(
    ("criterion", "value", "allowed"),
    [("max_be_ratio", -5.0, "a ratio > 0"), ("max_underflow_pct", -1.0, "a share from 0 to 100"),
     ("max_overflow_pct", 200.0, "a share from 0 to 100"), ("min_sqnr_db", 1e9, "dB from -200 to 200"),
     ("min_grad_cosine", 2.0, "a cosine from -1 to 1")],
)  # fmt: skip
def test_a_limit_outside_its_meaning_is_refused(observed, criterion: str, value: float, allowed: str) -> None:
    analysis, _ = observed
    with pytest.raises(AdvisorError, match=f"criterion {criterion} is {value!r}; allowed: {allowed}"):
        advise(analysis, **{criterion: value})


def test_a_target_plan_keeps_high_a_module_the_stack_cannot_quantize_at_its_shape() -> None:
    """A vocabulary of 100 (not a multiple of 16 or 32): the observer records the head's weight shape, the
    target's plan keeps the head high, saying why, and the export of that plan, checked against the same
    shapes, lists nothing."""
    analysis, sites = observe_bert(vocab_size=100, steps=1)
    shapes = {name: tuple(shape) for name, shape in analysis.meta["weight_shapes"]}
    assert shapes["cls.predictions.decoder"] == (100, 32)
    assert shapes["bert.encoder.layer.0.intermediate.dense"] == (64, 32)
    for target in ("te", "torchao"):
        recommendation = advise(analysis, target=target, **NO_LIMITS)
        head = [c for c in recommendation.choices if c.site == "cls.predictions.decoder"]
        assert head and all(c.format == HIGH for c in head), target
        assert any("weight 100 x 32" in c.reason and "multiples of" in c.reason for c in head), head[0].reason
        quantized = [c for c in recommendation.choices if c.format != HIGH]
        assert quantized, target  # the rest of the model is still quantized
        exported = export(recommendation.plan, target, sites, target, shapes)
        assert all("(matmul)" in line for line in exported.unexpressed), exported.unexpressed


@pytest.mark.parametrize("target", STACKS)
def test_what_a_stack_runs_in_bf16_counts_16_bits_and_its_plan_fits_a_budget_only_that_makes_possible(
    observed, target: str
) -> None:
    from numscope.advisor.target import recipe_bits

    analysis, sites = observed
    at32, at16 = (_cheapest(analysis, target), advise(analysis, target=target, high_bits=16, **NO_LIMITS))
    fixed = 1 - sum(  # the share of elements the stack cannot convert: attention products, the outside
        n for k, n in analysis.elements.items() if dict(sites).get(k[0]) == "linear"
    ) / sum(analysis.elements.values())
    assert fixed > 0.05 and at16.average_bits <= at32 - 16 * fixed + 1e-6  # at least those 16 bits cheaper
    budget = (at16.average_bits + at32) / 2  # below what FP32 around the GEMMs allows
    with pytest.raises(AdvisorError, match="stays high, 32 bits"):
        advise(analysis, target=target, bit_budget=budget, **NO_LIMITS)
    planned = advise(analysis, target=target, bit_budget=budget, high_bits=16, **NO_LIMITS)
    assert planned.average_bits <= budget + 1e-9
    assert all(c.bits == 16 for c in planned.choices if c.format == HIGH)
    bits32 = recipe_bits(analysis, get_target(target), analysis.candidates)
    bits16 = recipe_bits(analysis, get_target(target), analysis.candidates, high_bits=16)
    assert all(bits16[name] < bits32[name] for name in bits32)
    with pytest.raises(AdvisorError, match="high_bits 16: only with a stack target"):
        advise(analysis, high_bits=16, **NO_LIMITS)
