"""numscope.plan: presets, rule lookup, YAML round trip, validation messages, site checks, average bits."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import yaml

import numscope
from numscope.plan import (
    ACCUMULATE,
    GEMMS,
    OPERAND_KEYS,
    OPERANDS,
    OperandSpec,
    Plan,
    PlanError,
    PlanRow,
    Rule,
    SiteSpec,
)
from tiny_models import tiny_bert

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "plans"


def formats_of(spec: SiteSpec) -> dict[str, str]:
    return {f"{g}/{o}": spec.operand(g, o).format for g, o in OPERAND_KEYS}


def uniform_formats(name: str) -> dict[str, str]:
    return {f"{g}/{o}": name for g, o in OPERAND_KEYS}


# -- contract constants ----------------------------------------------------------------------------------


def test_contract_constants():
    assert GEMMS == ("fprop", "dgrad", "wgrad")
    assert OPERANDS == {
        "fprop": ("input", "weight"),
        "dgrad": ("grad_output", "weight"),
        "wgrad": ("grad_output", "input"),
    }
    assert ACCUMULATE == ("fp32", "bf16", "fp16", "fp22", "fp22_promote128")
    assert issubclass(PlanError, ValueError)
    assert numscope.Plan is Plan


# -- presets -----------------------------------------------------------------------------------------------

PRESET_FORMATS = {
    "fp32": uniform_formats("high"),
    "bf16": uniform_formats("bf16"),
    "fp16": uniform_formats("fp16"),
    "fp8": {
        "fprop/input": "fp8_e4m3",
        "fprop/weight": "fp8_e4m3",
        "dgrad/grad_output": "fp8_e5m2",
        "dgrad/weight": "fp8_e4m3",
        "wgrad/grad_output": "fp8_e5m2",
        "wgrad/input": "fp8_e4m3",
    },
    "fp8_e4m3": uniform_formats("fp8_e4m3"),
    "mxfp8": uniform_formats("mxfp8_e4m3"),
    "mxfp6": uniform_formats("mxfp6_e3m2"),
    "mxfp4": uniform_formats("mxfp4_e2m1"),
    "nvfp4": uniform_formats("nvfp4"),
    "int8": uniform_formats("int8"),
    "e5m2_grads": {
        **uniform_formats("high"),
        "dgrad/grad_output": "fp8_e5m2",
        "wgrad/grad_output": "fp8_e5m2",
    },
}
# the kind of scaling each preset's operands get (None = plain element cast / unquantized)
PRESET_SCALING = {
    "fp32": None,
    "bf16": None,
    "fp16": None,
    "fp8": "tensor",
    "fp8_e4m3": "tensor",
    "mxfp8": "block",
    "mxfp6": "block",
    "mxfp4": "block",
    "nvfp4": "block",
    "int8": "tensor",
    "e5m2_grads": None,
}


@pytest.mark.parametrize("name", sorted(PRESET_FORMATS))
def test_preset_formats_and_scaling(name):
    plan = Plan.uniform(name)
    assert plan.rules == ()
    spec = plan.for_site("any.site.name")
    assert formats_of(spec) == PRESET_FORMATS[name]
    assert spec.accumulate == "fp32"
    for gemm, operand in OPERAND_KEYS:
        op = spec.operand(gemm, operand)
        scaling = op.effective_scaling()
        assert (scaling.kind if scaling else None) == PRESET_SCALING[name], (gemm, operand)
        assert op.rounding == "nearest"


def test_the_loss_scaling_preset_overflows_to_inf_so_the_scaler_backs_off():
    spec = Plan.uniform("e5m2_grads").default
    assert {spec.operand(gemm, "grad_output").overflow for gemm in ("dgrad", "wgrad")} == {"propagate"}
    values = torch.tensor([1.0, 62000.0, 2.0**-17, 2.0**-16])  # E5M2: max 57344 (61440 rounds up), 2^-16
    quantized = numscope.quantize(values, "fp8_e5m2", overflow="propagate")
    assert quantized.tolist() == [1.0, float("inf"), 0.0, 2.0**-16]


def test_presets_are_listed_in_the_docstring_table():
    assert set(Plan.presets()) == set(PRESET_FORMATS)
    doc = Plan.uniform.__doc__
    for name in Plan.presets():
        assert f"\n        {name} " in doc


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(PlanError) as info:
        Plan.uniform("fp9")
    message = str(info.value)
    assert "unknown preset 'fp9'" in message
    for name in Plan.presets():
        assert name in message


def test_fp32_preset_is_unquantized_everywhere():
    spec = Plan.uniform("fp32").default
    assert spec.is_high
    assert all(spec.operand(g, o).is_high for g, o in OPERAND_KEYS)
    assert spec.operand("dgrad", "weight").effective_scaling() is None


# -- operand and site specs --------------------------------------------------------------------------------


def test_operand_spec_is_canonical():
    assert OperandSpec("mxfp8").format == "mxfp8_e4m3"
    assert OperandSpec("float16").format == "fp16"
    assert OperandSpec("mxfp8_e4m3", numscope.Scaling("block")) == OperandSpec("mxfp8_e4m3")
    assert OperandSpec("fp8_e4m3", "tensor") == OperandSpec("fp8_e4m3")
    assert OperandSpec("bf16", "none") == OperandSpec("bf16")
    delayed = OperandSpec("fp8_e5m2", {"kind": "delayed", "history_len": 4})
    assert delayed.scaling == numscope.Scaling("delayed", history_len=4)
    assert delayed.effective_scaling() == numscope.Scaling("delayed", history_len=4)
    assert OperandSpec("fp8_e4m3", "none").effective_scaling() is None
    assert OperandSpec("HIGH").is_high


def test_site_spec_equality_drops_high_and_accepts_string_keys():
    explicit = SiteSpec({("fprop", "input"): "fp8_e4m3", ("wgrad", "input"): OperandSpec("high")})
    assert explicit == SiteSpec({"fprop/input": OperandSpec("fp8_e4m3")})
    assert explicit.operand("wgrad", "input").is_high
    assert explicit.operand("dgrad", "grad_output").is_high
    assert list(explicit.operands) == [("fprop", "input")]
    with pytest.raises(PlanError, match="unknown operand 'grad_output'; allowed for fprop: input, weight"):
        explicit.operand("fprop", "grad_output")
    with pytest.raises(PlanError, match="unknown gemm 'fwd'; allowed: fprop, dgrad, wgrad"):
        SiteSpec({("fwd", "input"): "bf16"})


def test_specs_are_frozen_and_hashable():
    plan = Plan.uniform("fp8").with_rule("a.*", SiteSpec.uniform("bf16"), {"fprop/input": "why"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rules = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.default.operands[("fprop", "input")] = OperandSpec("bf16")  # type: ignore[index]
    with pytest.raises(TypeError):
        plan.rules[0].reasons["fprop/input"] = "other"  # type: ignore[index]
    same = Plan.uniform("fp8").with_rule("a.*", SiteSpec.uniform("bf16"), {"fprop/input": "why"})
    assert plan == same and hash(plan) == hash(same)
    assert len({plan, same, Plan.uniform("fp8")}) == 2
    assert plan != Plan.uniform("fp8").with_rule("a.*", SiteSpec.uniform("bf16"), {"fprop/input": "other"})


def test_with_rule_returns_a_new_plan():
    base = Plan.uniform("fp8")
    extended = base.with_rule("head", SiteSpec())
    assert base.rules == ()
    assert extended.rules == (Rule("head", SiteSpec()),)
    assert extended.for_site("head").is_high
    assert base.for_site("head") == base.default
    assert extended.with_default(SiteSpec.uniform("bf16")).for_site("body") == SiteSpec.uniform("bf16")


def test_python_constructors_validate():
    with pytest.raises(PlanError, match="unknown format 'fp8_e4m4'; did you mean 'fp8_e4m3'"):
        OperandSpec("fp8_e4m4")
    with pytest.raises(PlanError, match="format 'high' leaves the operand unquantized; rounding does not"):
        OperandSpec("high", rounding="stochastic")
    with pytest.raises(
        PlanError, match="unknown rounding 'up'; allowed: nearest, nearest_away, stochastic, zero"
    ):
        OperandSpec("bf16", rounding="up")
    with pytest.raises(PlanError, match="unknown accumulate 'fp8'; allowed: fp32, bf16, fp16"):
        SiteSpec(accumulate="fp8")
    with pytest.raises(PlanError, match="scaling axis 0 is not a plan setting"):
        OperandSpec("mxfp8_e4m3", numscope.Scaling("block", axis=0))


# -- lookup: the last matching rule wins -------------------------------------------------------------------


def test_last_matching_rule_wins_and_rules_replace_the_default():
    bf16, fp16 = SiteSpec.uniform("bf16"), SiteSpec.uniform("fp16", accumulate="fp16")
    only_wgrad = SiteSpec({("wgrad", "grad_output"): "fp8_e5m2"})
    plan = Plan(
        SiteSpec.uniform("fp8_e4m3"),
        (Rule("*.layer.*", bf16), Rule("*.layer.1.*", fp16), Rule("*.layer.1.out", only_wgrad)),
    )
    assert plan.for_site("enc.layer.0.query") == bf16
    assert plan.for_site("enc.layer.1.query") == fp16
    assert plan.for_site("enc.layer.1.out") == only_wgrad
    # a rule is used whole: what it does not set is high, not the default's format
    assert plan.for_site("enc.layer.1.out").operand("fprop", "input").is_high
    assert plan.for_site("embeddings.proj") == plan.default
    assert plan.rule_for("embeddings.proj") is None
    assert plan.rule_for("enc.layer.1.query") is plan.rules[1]
    # the same rules in the other order: the broad rule, now last, wins everywhere it matches
    reversed_plan = Plan(plan.default, tuple(reversed(plan.rules)))
    assert reversed_plan.for_site("enc.layer.1.query") == bf16
    assert reversed_plan.for_site("enc.layer.1.out") == bf16


def test_patterns_are_case_sensitive_whole_name_globs():
    plan = Plan(SiteSpec(), (Rule("layer.?.q", SiteSpec.uniform("bf16")),))
    assert not plan.for_site("layer.1.q").is_high
    assert plan.for_site("Layer.1.q").is_high
    assert plan.for_site("layer.10.q").is_high
    assert plan.for_site("x.layer.1.q").is_high


# -- YAML --------------------------------------------------------------------------------------------------


def rich_plan() -> Plan:
    tile = OperandSpec("fp8_e4m3", numscope.Scaling("block", block_shape=(1, 128), power_of_two=True))
    delayed = OperandSpec(
        "fp8_e5m2", numscope.Scaling("delayed", history_len=32, amax_compute="most_recent", margin=1)
    )
    rules = (
        Rule("*.attention.self.scores", SiteSpec(), {"fprop/input": "scores feed softmax"}),
        Rule(
            "bert.encoder.layer.*.output.dense",
            SiteSpec(
                {
                    ("fprop", "input"): OperandSpec("mxfp8_e4m3@rceil", rounding="stochastic"),
                    ("fprop", "weight"): tile,
                    ("wgrad", "grad_output"): delayed,
                    ("dgrad", "grad_output"): OperandSpec("fp8_e5m2", overflow="propagate"),
                    ("dgrad", "weight"): OperandSpec("fp16", flush_subnormals=True),
                },
                accumulate="bf16",
            ),
            {"fprop/input": "backward error 1.2e-3 <= 2x bf16", "wgrad/grad_output": "wide range"},
        ),
    )
    return Plan(Plan.uniform("fp8").default, rules, {"dgrad/grad_output": "TE hybrid"})


def test_yaml_round_trip(tmp_path):
    plan = rich_plan()
    path = tmp_path / "plan.yaml"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert loaded.rules[1].reasons["fprop/input"] == "backward error 1.2e-3 <= 2x bf16"
    assert loaded.default_reasons == {"dgrad/grad_output": "TE hybrid"}
    assert loaded.source == str(path)
    assert Plan.from_dict(plan.to_dict()) == plan
    # the file is legible YAML with the version key first
    data = yaml.safe_load(path.read_text())
    assert next(iter(data)) == "numscope_plan" and data["numscope_plan"] == 1
    assert data["rules"][0] == {
        "match": "*.attention.self.scores",
        "all": "high",
        "reasons": {"fprop/input": "scores feed softmax"},
    }


@pytest.mark.parametrize("name", sorted(PRESET_FORMATS))
def test_every_preset_round_trips(tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    Plan.uniform(name).save(path)
    assert Plan.load(path) == Plan.uniform(name)


def test_save_replaces_the_file_atomically(tmp_path):
    path = tmp_path / "plan.yaml"
    Plan.uniform("bf16").save(path)
    before = os.stat(path).st_ino
    Plan.uniform("fp8").save(path)
    assert os.stat(path).st_ino != before  # a new file moved into place, not an in-place rewrite
    assert Plan.load(path) == Plan.uniform("fp8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml"]


def test_shorthands_layer_broadest_first():
    plan = Plan.from_dict(
        {
            "numscope_plan": 1,
            "default": {
                "all": "bf16",
                "backward": "fp8_e5m2",
                "weight": "fp8_e4m3",
                "wgrad": {"input": {"format": "mxfp8", "rounding": "stochastic"}},
                "dgrad": "fp16",
            },
        }
    )
    assert formats_of(plan.default) == {
        "fprop/input": "bf16",
        "fprop/weight": "fp8_e4m3",
        "dgrad/grad_output": "fp16",
        "dgrad/weight": "fp16",
        "wgrad/grad_output": "fp8_e5m2",
        "wgrad/input": "mxfp8_e4m3",
    }
    assert plan.default.operand("wgrad", "input").rounding == "stochastic"
    hybrid = Plan.from_dict(
        {
            "numscope_plan": 1,
            "default": {"input": "fp8_e4m3", "weight": "fp8_e4m3", "grad_output": "fp8_e5m2"},
        }
    )
    assert hybrid == Plan.uniform("fp8")
    assert Plan.from_dict({"numscope_plan": 1}) == Plan.uniform("fp32")


# -- validation messages -----------------------------------------------------------------------------------

BAD_PLANS = [
    (
        "default:\n  fprop: {input: fp8_e4m4}\n",
        "plan.yaml: default.fprop.input: unknown format 'fp8_e4m4'; did you mean 'fp8_e4m3'",
    ),
    (
        "rules:\n  - {match: a, all: high}\n  - match: b\n    fprop: {grad_input: bf16}\n",
        "plan.yaml: rules[1].fprop: unknown operand 'grad_input'; allowed for fprop: input, weight",
    ),
    (
        "rules:\n  - match: a\n    fprp: bf16\n",
        "plan.yaml: rules[0]: unknown key 'fprp'; did you mean 'fprop'? allowed: match, optional, all, "
        "forward, backward, input, weight, grad_output, fprop, dgrad, wgrad, accumulate, reasons",
    ),
    (
        "rules:\n  - match: 3\n    all: high\n",
        "plan.yaml: rules[0].match must be a string, got int",
    ),
    (
        "rules:\n  - all: high\n",
        "plan.yaml: rules[0]: missing key 'match'",
    ),
    (
        "rules: {match: a}\n",
        "plan.yaml: rules must be a list of rules, got dict",
    ),
    (
        "default:\n  all: {format: fp8_e4m3, scaling: {kind: delayed, histroy_len: 8}}\n",
        "plan.yaml: default.all.scaling: unknown scaling key 'histroy_len'; did you mean 'history_len'? "
        "allowed: kind, margin, power_of_two, block_shape, history_len, amax_compute, reduce_amax",
    ),
    (
        "default:\n  all: {format: fp8_e4m3, scaling: current}\n",
        "plan.yaml: default.all.scaling: unknown scaling kind 'current'; allowed: none, tensor, delayed, "
        "row, column, block",
    ),
    (
        "default:\n  all: {format: fp8_e4m3, scaling: {kind: tensor, margin: 1.5}}\n",
        "plan.yaml: default.all.scaling.margin must be an int, got float",
    ),
    (
        "default:\n  all: {format: 8}\n",
        "plan.yaml: default.all.format must be a string, got int",
    ),
    (
        "default:\n  all: bf16\n  accumulate: fp8\n",
        "plan.yaml: default.accumulate: unknown accumulate 'fp8'; allowed: fp32, bf16, fp16",
    ),
    (
        "default:\n  weight: {format: mxfp8_e4m3, scaling: tensor}\n",
        "plan.yaml: default.weight: scaling 'tensor' does not apply to the block format 'mxfp8_e4m3', which "
        "brings its own block scale; allowed: omit scaling, or kind 'block'",
    ),
    (
        "default:\n  weight: {format: nvfp4, scaling: {kind: block, block_shape: [1, 16]}}\n",
        "plan.yaml: default.weight: block format 'nvfp4' has a fixed block of 16 elements; drop block_shape",
    ),
    (
        "default:\n  weight: {format: fp8_e4m3, scaling: block}\n",
        "plan.yaml: default.weight: scaling 'block' of the element format 'fp8_e4m3' needs block_shape",
    ),
    (
        "default:\n  input: {format: mxfp4, overflow: propagate}\n",
        "plan.yaml: default.input: block format 'mxfp4_e2m1' always saturates its elements",
    ),
    (
        "default:\n  input: {format: high, scaling: tensor}\n",
        "plan.yaml: default.input: format 'high' leaves the operand unquantized; scaling does not apply",
    ),
    (
        "default:\n  input: {format: bf16, scaling: {kind: block, axis: 0, block_shape: [1, 32]}}\n",
        "plan.yaml: default.input.scaling.axis: axis is not a plan setting",
    ),
    (
        "rules:\n  - match: a\n    all: bf16\n    reasons: {fprop/grad_output: x}\n",
        "plan.yaml: rules[0].reasons: unknown operand 'grad_output'; allowed for fprop: input, weight",
    ),
    (
        "default:\n  fprop: {input: bf16}\n  fprop: {weight: bf16}\n",
        "plan.yaml: line 4: duplicate key 'fprop'",
    ),
    (
        "default:\n  fprop: [bf16]\n",
        "plan.yaml: default.fprop must be a mapping (operand -> spec, operands: input, weight), got list",
    ),
    (
        "defaults:\n  all: bf16\n",
        "plan.yaml: unknown top-level key 'defaults'; did you mean 'default'? allowed: numscope_plan, "
        "default, rules",
    ),
]


@pytest.mark.parametrize(("body", "expected"), BAD_PLANS, ids=[e[11:51] for _, e in BAD_PLANS])
def test_invalid_plan_messages(tmp_path, body, expected):
    path = tmp_path / "plan.yaml"
    path.write_text("numscope_plan: 1\n" + body)
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    message = str(info.value)
    assert message.startswith(str(path) + ": ")
    assert expected.replace("plan.yaml: ", "", 1) in message
    assert message.count("plan.yaml") == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "default:\n  all: bf16\n",
            "plan.yaml: missing version key 'numscope_plan' (this numscope reads plan version 1)",
        ),
        (
            "numscope_plan: 2\n",
            "plan.yaml: plan version 2 is newer than this numscope reads (1); upgrade numscope",
        ),
        ("numscope_plan: one\n", "plan.yaml: numscope_plan must be an int, got str"),
        ("", "plan.yaml: the plan is empty"),
        ("- a\n- b\n", "plan.yaml: the plan must be a mapping"),
        ("numscope_plan: 1\ndefault: {all: [\n", "plan.yaml: not valid YAML"),
    ],
)
def test_version_and_shape_messages(tmp_path, text, expected):
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    assert str(info.value).startswith(str(path).replace("plan.yaml", "") + expected)


def test_from_dict_without_a_file_names_the_key_path():
    with pytest.raises(PlanError) as info:
        Plan.from_dict({"numscope_plan": 1, "rules": [{"match": "a", "wgrad": {"weight": "bf16"}}]})
    expected = "rules[0].wgrad: unknown operand 'weight'; allowed for wgrad: grad_output, input"
    assert str(info.value) == expected


# -- check_sites ---------------------------------------------------------------------------------------------

SITES = [
    f"bert.encoder.layer.{i}.attention.self.{role}" for i in range(2) for role in ("query", "key", "scores")
]


def test_check_sites_names_every_unmatched_pattern():
    plan = Plan(
        SiteSpec(),
        (
            Rule("*.attention.self.scores", SiteSpec()),
            Rule("*.attn.c_attn", SiteSpec()),
            Rule("bert.encoder.layer.7.*", SiteSpec()),
        ),
    )
    with pytest.raises(PlanError) as info:
        plan.check_sites(SITES)
    message = str(info.value)
    assert "2 pattern(s) match no site" in message
    assert "rules[1].match '*.attn.c_attn'" in message
    assert "rules[2].match 'bert.encoder.layer.7.*'" in message
    assert "rules[0]" not in message
    assert "Sites (6): bert.encoder.layer.0.attention.self.query" in message
    assert "(1 more)" in message
    Plan(SiteSpec(), plan.rules[:1]).check_sites(SITES)


def test_load_with_site_names_checks_them_and_names_the_file(tmp_path):
    path = tmp_path / "plan.yaml"
    Plan(SiteSpec(), (Rule("*.nothing", SiteSpec()),)).save(path)
    expected = r"plan\.yaml: 1 pattern\(s\) match no site: rules\[0\]\.match '\*\.nothing'"
    with pytest.raises(PlanError, match=expected):
        Plan.load(path, site_names=SITES)
    assert Plan.load(path).rules[0].pattern == "*.nothing"


# -- describe and average_bits ----------------------------------------------------------------------------


def test_describe_lists_every_operand_with_its_reason():
    rows = rich_plan().describe()
    assert len(rows) == 6 * 3
    assert all(isinstance(row, PlanRow) for row in rows)
    assert rows[0] == PlanRow("(default)", "fprop", "input", "fp8_e4m3", "tensor", "", "nearest", "fp32")
    assert rows[2].reason == "TE hybrid"
    assert rows[6] == PlanRow(
        "*.attention.self.scores", "fprop", "input", "high", "-", "scores feed softmax", "-", "fp32"
    )
    dense = {(r.gemm, r.operand): r for r in rows[12:]}
    assert dense[("fprop", "input")].format == "mxfp8_e4m3@rceil"
    assert dense[("fprop", "input")].scaling == "block/32 e8m0"
    assert dense[("fprop", "input")].rounding == "stochastic"
    assert dense[("fprop", "weight")].scaling == "block(power_of_two=True, block_shape=[1, 128])"
    delayed = "delayed(margin=1, history_len=32, amax_compute=most_recent)"
    assert dense[("wgrad", "grad_output")].scaling == delayed
    assert dense[("wgrad", "input")].format == "high"
    assert {r.accumulate for r in dense.values()} == {"bf16"}


def test_average_bits_hand_computed():
    sizes = {
        "enc.0.dense": {("fprop", "input"): 4096, ("fprop", "weight"): 1024, ("wgrad", "grad_output"): 4096}
    }
    assert Plan.uniform("mxfp8").average_bits(sizes) == pytest.approx(8.25)  # 8 + 8/32
    assert Plan.uniform("mxfp4").average_bits(sizes) == pytest.approx(4.25)  # 4 + 8/32
    assert Plan.uniform("nvfp4").average_bits(sizes) == pytest.approx(4.5)  # 4 + 8/16
    assert Plan.uniform("fp8").average_bits(sizes) == 8.0
    assert Plan.uniform("fp32").average_bits(sizes) == 32.0
    assert Plan.uniform("fp32").average_bits(sizes, high_bits=16) == 16.0
    # fp8 default, the head kept high: (300·8 + 100·32) / 400 = 14
    plan = Plan.uniform("fp8").with_rule("head", SiteSpec())
    mixed = {"body": {("fprop", "input"): 200, ("dgrad", "grad_output"): 100}, "head": {"fprop/weight": 100}}
    assert plan.average_bits(mixed) == pytest.approx(14.0)
    # tile scaling adds one fp32 scale per 1×128 tile: 8 + 32/128
    tiled = SiteSpec.uniform(OperandSpec("fp8_e4m3", numscope.Scaling("block", block_shape=(1, 128))))
    assert Plan(tiled).average_bits(sizes) == pytest.approx(8.25)


def test_average_bits_rejects_bad_sizes():
    with pytest.raises(PlanError, match="site_sizes holds none"):
        Plan.uniform("fp8").average_bits({})
    with pytest.raises(PlanError, match="unknown operand 'grad_output'; allowed for fprop"):
        Plan.uniform("fp8").average_bits({"a": {("fprop", "grad_output"): 3}})
    with pytest.raises(PlanError, match=r"element count of a/fprop/input must be an int >= 0, got -1"):
        Plan.uniform("fp8").average_bits({"a": {("fprop", "input"): -1}})


# -- example plans -----------------------------------------------------------------------------------------


def bert_site_names() -> list[str]:
    """The Linear sites of a real tiny BertForMaskedLM, plus its attention matmul sites (contract names)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    model = tiny_bert(vocab_size=64, hidden=16, impl=None)
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    attention = [name for name, _ in model.named_modules() if name.endswith("attention.self")]
    return names + [f"{name}.{role}" for name in attention for role in ("scores", "context")]


def test_example_plans_load_and_match_a_tiny_bert():
    paths = sorted(EXAMPLES.glob("*.yaml"))
    assert len(paths) >= 2
    names = bert_site_names()
    for path in paths:
        plan = Plan.load(path, site_names=names)
        assert Plan.from_dict(plan.to_dict()) == plan
    hybrid = Plan.load(EXAMPLES / "bert_fp8_hybrid.yaml")
    assert hybrid.default == Plan.uniform("fp8").default
    assert hybrid.for_site("bert.encoder.layer.1.attention.self.scores").is_high
    dense = hybrid.for_site("bert.encoder.layer.0.output.dense")
    assert dense.operand("fprop", "weight").format == "mxfp8_e4m3"
    delayed = numscope.Scaling("delayed", history_len=16)
    assert dense.operand("wgrad", "grad_output").effective_scaling() == delayed
    nvfp4 = Plan.load(EXAMPLES / "nvfp4_stochastic_grads.yaml")
    late = nvfp4.for_site("bert.encoder.layer.1.output.dense")
    assert late.operand("dgrad", "grad_output").rounding == "stochastic"
    assert nvfp4.for_site("bert.encoder.layer.0.output.dense") == SiteSpec.uniform("mxfp8_e4m3")


def test_plans_survive_pickle_and_deepcopy():
    import copy
    import pickle

    plan = rich_plan()
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert copy.deepcopy(plan) == plan


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_ieee_presets_overflow_to_inf_so_the_loss_scaler_sees_it(name: str) -> None:
    spec = Plan.uniform(name).for_site("any.site")
    for key in OPERAND_KEYS:
        assert spec.operand(*key).overflow == "propagate"


def test_uses_block_formats_names_the_plans_worth_compiling() -> None:
    assert Plan.uniform("mxfp8").uses_block_formats() and Plan.uniform("nvfp4").uses_block_formats()
    assert not Plan.uniform("fp8").uses_block_formats() and not Plan.uniform("fp32").uses_block_formats()
    one_block_operand = Plan(SiteSpec(), (Rule("head", SiteSpec({"wgrad/input": "mxfp4_e2m1"})),))
    assert one_block_operand.uses_block_formats()


def test_resolve_reads_a_plan_by_the_one_rule_every_entry_point_uses(tmp_path: Path) -> None:
    assert Plan.resolve("fp8") == Plan.uniform("fp8")
    path = tmp_path / "mine.yaml"
    Plan.uniform("mxfp8").save(path)
    assert Plan.resolve(path) == Plan.resolve(str(path)) == Plan.uniform("mxfp8")
    with pytest.raises(PlanError, match=r"`plan` .*missing\.yaml: no such file \(or give a preset: fp32"):
        Plan.resolve(tmp_path / "missing.yaml")
    (tmp_path / "plan.txt").write_text("default: {}")
    with pytest.raises(PlanError, match=r"a plan file must be YAML \(\.yaml or \.yml\)"):
        Plan.resolve(tmp_path / "plan.txt")
    with pytest.raises(PlanError, match="unknown preset or recipe 'fp9'"):
        Plan.resolve("fp9")


def test_a_folder_named_like_a_preset_does_not_hide_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``numscope train --plan fp32 --out fp32`` run from the folder that holds its output: the run folder
    exists by the time the plan is read (found by running exactly that)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fp32").mkdir()
    (tmp_path / "te_current").mkdir()
    assert Plan.resolve("fp32") == Plan.uniform("fp32")
    assert Plan.resolve("te_current", ["layer.0", "head"]) == Plan.recipe("te_current", ["layer.0", "head"])
    (tmp_path / "mine").mkdir()
    with pytest.raises(PlanError, match="mine: no such file"):
        Plan.resolve("mine")


def test_accumulation_per_gemm_round_trips_and_runs_per_gemm(tmp_path) -> None:
    """A site may accumulate each GEMM in its own precision (TE's FP8 recipes: fprop fast, i.e. fp22);
    it survives YAML and the runtime applies it to that GEMM only."""
    import torch

    import numscope
    from numscope.sites import accumulate_matmul

    spec = SiteSpec.uniform("fp8_e4m3", accumulate={"fprop": "fp22"})
    assert [spec.accumulate_for(g) for g in ("fprop", "dgrad", "wgrad")] == ["fp22", "fp32", "fp32"]
    assert spec.describe_accumulate() == "fprop fp22, dgrad fp32, wgrad fp32"
    assert SiteSpec.uniform("fp8_e4m3", accumulate={"fprop": "fp22", "dgrad": "fp22", "wgrad": "fp22"}) == (
        SiteSpec.uniform("fp8_e4m3", accumulate="fp22")
    )  # stored as one name where all three agree
    plan = Plan(spec)
    path = tmp_path / "plan.yaml"
    plan.save(path)
    assert "fprop: fp22" in path.read_text()
    assert Plan.load(path) == plan
    with pytest.raises(PlanError, match="accumulate: unknown gemm 'forward'"):
        SiteSpec(accumulate={"forward": "fp22"})
    with pytest.raises(PlanError, match="accumulate for dgrad: unknown accumulate 'fp8'"):
        SiteSpec(accumulate={"dgrad": "fp8"})
    path.write_text("numscope_plan: 1\ndefault:\n  all: fp8_e4m3\n  accumulate: {wgrad: fp9}\n")
    with pytest.raises(PlanError, match=r"default.accumulate.wgrad: unknown accumulate 'fp9'"):
        Plan.load(path)

    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 8, bias=False)
    x = torch.randn(4, 256)
    q = numscope.convert(
        torch.nn.Linear(256, 8, bias=False), Plan(SiteSpec.uniform("bf16", accumulate={"fprop": "fp22"}))
    )
    q.load_state_dict(layer.state_dict())
    out = q(x)
    xb, wb = x.bfloat16().float(), layer.weight.detach().bfloat16().float()
    assert torch.equal(out.detach(), accumulate_matmul(xb, wb.t(), "fp22"))
    assert not torch.equal(out.detach(), xb @ wb.t())
    grad = torch.randn(4, 8)
    out.backward(grad)
    gb = grad.bfloat16().float()
    assert torch.equal(q.weight.grad, (gb.t() @ xb))  # wgrad in fp32, torch's own product


def test_what_a_plan_leaves_high_can_run_in_bf16_instead_as_the_stacks_run_it():
    from numscope.plan import OperandSpec

    sites = ["bert.encoder.layer.0.attention.self.scores", "bert.encoder.layer.0.output.dense"]
    plan = Plan.recipe("te_nvfp4", sites)
    bf16 = OperandSpec("bf16", overflow="propagate")
    around = plan.with_high_as(bf16)
    scores, dense = (around.for_site(name) for name in sites)
    assert all(spec == bf16 for spec in scores.operands.values()) and len(scores.operands) == 6
    quantized = plan.for_site(sites[1]).operands
    assert {k: v for k, v in dense.operands.items() if k in quantized} == dict(quantized)
    assert around.for_site(sites[1]).accumulate == plan.for_site(sites[1]).accumulate
    sizes = {name: {("fprop", "input"): 100, ("fprop", "weight"): 100} for name in sites}
    assert around.average_bits(sizes) == pytest.approx(plan.average_bits(sizes) - 8.0)  # half the elements
    assert Plan.from_dict(around.to_dict()) == around  # a file train takes
    assert plan.with_high_as("high") is plan


def test_one_cast_description_in_the_vocabularys_words(tmp_path: Path) -> None:
    """Rounding, overflow and scaling kind are words of numscope.vocab: a plan, its Cast and quantize take
    the word or its name alike, the plan file writes the name, and a misspelt name is a PlanError."""
    from numscope.vocab import Overflow, Rounding, ScalingKind

    by_word = OperandSpec(
        "fp8_e5m2", scaling=ScalingKind.ROW, rounding=Rounding.STOCHASTIC, overflow=Overflow.PROPAGATE
    )
    by_name = OperandSpec("fp8_e5m2", scaling="row", rounding="stochastic", overflow="propagate")
    assert by_word == by_name and hash(by_word) == hash(by_name)
    assert type(by_name.rounding) is Rounding and type(by_name.overflow) is Overflow
    assert type(by_name.scaling.kind) is ScalingKind
    cast = by_name.cast()
    words = (ScalingKind.ROW, Rounding.STOCHASTIC, Overflow.PROPAGATE)
    assert (cast.scaling, cast.rounding, cast.overflow) == words
    assert all(
        type(value) is type(word)
        for value, word in zip((cast.scaling, cast.rounding, cast.overflow), words, strict=True)
    )
    plan = Plan(SiteSpec.uniform("fp8_e4m3").with_operand("fprop", "input", by_word))
    plan.save(tmp_path / "plan.yaml")
    text = (tmp_path / "plan.yaml").read_text()
    assert "rounding: stochastic" in text and "overflow: propagate" in text and "Rounding" not in text
    assert Plan.load(tmp_path / "plan.yaml") == plan
    x = torch.randn(4, 64)
    same = [
        numscope.quantize(
            x, "fp8_e4m3", scaling=kind, rounding=rounding, generator=torch.Generator().manual_seed(3)
        )
        for kind, rounding in (("row", "stochastic"), (ScalingKind.ROW, Rounding.STOCHASTIC))
    ]
    assert torch.equal(*same)
    with pytest.raises(PlanError, match="unknown rounding 'nearst'; did you mean 'nearest'"):
        OperandSpec("fp8_e4m3", rounding="nearst")
    assert repr(Rounding.NEAREST) == "'nearest'"  # messages read the name, never the enum's repr
