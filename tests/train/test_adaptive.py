"""Adaptive precision (:mod:`numscope.train.adaptive`): switching a converted model's plan, the guard (trip,
arming, return), the re-plan's hysteresis, and ``numscope train --adaptive`` end to end on tiny BERT and GQA
Llama: resumed bit for bit with the same plan history, the final plan exported. DDP: tests/distributed."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from tests.cli.test_cli import cli, flags, ws  # noqa: F401 (ws: the CLI tests' workspace fixture)
from tests.test_architectures import _llama
from tests.tiny_models import tiny_bert

import numscope
from numscope.convert import converted_plan, switch_plan
from numscope.plan import OperandSpec, Plan, SiteSpec
from numscope.train.adaptive import (
    Adapter,
    AdaptiveConfig,
    AdaptiveError,
    observer_for,
    read_history,
)

IDS = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(0))


def _grads(model: torch.nn.Module, factor: float = 1.0) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (model(input_ids=IDS, labels=IDS).loss * factor).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_switch_plan_computes_as_a_model_converted_with_that_plan() -> None:
    """A GQA Llama converted with fp8 (delayed scaling on attention's weights), run once, switched to mxfp8
    on some layers: its gradients equal those of the same weights converted with the new plan, bit for bit; a
    delayed scaler survives where its operand keeps its scaling and is dropped where it changes."""
    delayed = OperandSpec("fp8_e4m3", scaling="delayed")  # on weights: the same amax history in both
    fp8 = Plan.uniform("fp8").default.operands
    weights_delayed = SiteSpec({**fp8, ("fprop", "weight"): delayed, ("dgrad", "weight"): delayed})
    start = Plan.uniform("fp8").with_rule("*.self_attn.*", weights_delayed)
    switched = start.with_rule("*.self_attn.q_proj", SiteSpec.uniform("mxfp8")).with_rule(
        "*.mlp.*", SiteSpec.uniform("mxfp8")
    )
    model = _llama()
    fresh = copy.deepcopy(model)
    numscope.convert(model, start, compiled=False)
    _grads(model)
    scalers = set(numscope.convert._quantizer(model).scalers)
    assert any(".q_proj/" in key for key in scalers) and any(".k_proj/" in key for key in scalers)
    assert switch_plan(model, switched) == start and converted_plan(model) == switched
    kept = set(numscope.convert._quantizer(model).scalers)
    assert kept == {key for key in scalers if ".q_proj/" not in key}
    numscope.convert(fresh, switched, compiled=False)
    _grads(fresh)  # the same history of delayed scalers: one step before
    expected, got = _grads(fresh), _grads(model)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_switch_plan_reaches_a_compiled_model() -> None:
    """``torch.compile`` after ``convert``: a switched plan is what the compiled model computes next (not a
    plan baked into its graph): fp32 gives the unconverted model's logits, mxfp8 those of a model converted
    with mxfp8, bit for bit."""
    ids = IDS[:2]
    reference, model, other = (tiny_bert(dropout=0.0).eval() for _ in range(3))
    numscope.convert(model, Plan.uniform("fp8"))
    numscope.convert(other, Plan.uniform("mxfp8"))
    compiled = torch.compile(model)
    with torch.no_grad():
        fp8 = compiled(input_ids=ids).logits
        switch_plan(model, Plan.uniform("fp32"))
        fp32 = compiled(input_ids=ids).logits
        switch_plan(model, Plan.uniform("mxfp8"))
        mxfp8 = compiled(input_ids=ids).logits
        assert torch.equal(fp32, reference(input_ids=ids).logits) and not torch.equal(fp8, fp32)
        assert torch.equal(mxfp8, other(input_ids=ids).logits)


def test_switch_plan_refuses_what_is_not_a_plan_or_not_converted() -> None:
    model = tiny_bert()
    with pytest.raises(ValueError, match="not converted"):
        switch_plan(model, Plan.uniform("fp8"))
    numscope.convert(model, Plan.uniform("fp8"))
    with pytest.raises(TypeError, match=r"numscope\.Plan"):
        switch_plan(model, "fp8")  # type: ignore[arg-type]


def _adaptive_run(factors: list[float], **settings) -> tuple[Adapter, list[Plan], torch.nn.Module]:
    """The tiny BERT under unscaled E5M2 gradients (``e5m2_grads``), one SGD step per factor with the loss
    multiplied by it, a decision after each; returns the adapter and the plan each step ran under."""
    model = tiny_bert(dropout=0.0)
    plan = Plan.named("e5m2_grads")
    config = AdaptiveConfig(**{"every": 1, "replan_every": None, "clear_after": 2, **settings})
    observer = observer_for(model, plan, config).attach()
    numscope.convert(model, plan)
    adapter = Adapter(model, plan, config, observer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ran = []
    for step, factor in enumerate(factors):
        ran.append(converted_plan(model))
        _grads(model, factor)
        optimizer.step()
        observer.step()
        adapter.after_step(step)
    return adapter, ran, model


def test_the_guard_falls_back_when_gradients_underflow_and_returns_when_they_clear() -> None:
    """On this model unscaled E5M2 gradients lose at most 63% of their nonzeros to underflow at the loss's
    own scale (some 100% from the first step: those are never armed); a limit of 80% then trips only where
    the loss is scaled down."""
    quiet = 1e-6  # every unscaled E5M2 gradient (min subnormal 2^-16) underflows
    factors = [1, 1, quiet, quiet, 1, 1, 1, 1, 1]
    adapter, ran, _ = _adaptive_run(factors, candidates=("bf16",), max_underflow_pct=80)
    guards = {c.key: c for c in adapter.history if c.cause == "guard"}
    clears = {c.key: c for c in adapter.history if c.cause == "clear"}
    assert guards and guards.keys() == clears.keys() and len(adapter.history) == 2 * len(guards)
    for key, guard in guards.items():
        # decided after a quiet step (2 or 3: a gradient all zero at step 2 says nothing), effective from
        # the next step; back after 2 clean sampled steps (4 and 5 at the earliest)
        assert guard.step in (3, 4) and clears[key].step in (6, 7)
        assert guard.old == clears[key].new == "fp8_e5m2" and guard.new == clears[key].old == "bf16"
        assert "underflow% 100 > 80" in guard.measurement
        formats = [plan.for_site(key[0]).operand(key[1], key[2]).format for plan in ran]
        back = clears[key].step
        assert formats == ["fp8_e5m2"] * guard.step + ["bf16"] * (back - guard.step) + ["fp8_e5m2"] * (
            9 - back
        )
    # average bits: each plan weighted by the steps it ran
    sizes = numscope.convert.site_sizes(adapter.model)
    expected = sum(plan.average_bits(sizes) for plan in ran) / len(ran)
    assert adapter.average_bits(len(ran)) == pytest.approx(expected)
    assert ran[5].average_bits(sizes) > ran[0].average_bits(sizes)


def test_a_limit_the_format_never_met_is_not_armed() -> None:
    """Gradients that underflow from the first step on never crossed the limit: the plan chose the format
    knowingly; the guard watches for a tensor leaving its format's range."""
    adapter, ran, _ = _adaptive_run([1e-6] * 4, candidates=("bf16",))
    assert adapter.history == [] and all(plan == ran[0] for plan in ran)


def test_armed_always_guards_an_operand_out_of_range_from_the_start() -> None:
    adapter, ran, _ = _adaptive_run([1e-6] * 4, candidates=("bf16",), arm="always")
    guards = [c for c in adapter.history if c.cause == "guard"]
    assert guards and min(c.step for c in guards) == 1  # each at its first measurement with nonzeros
    key = guards[0].key
    assert ran[-1].for_site(key[0]).operand(key[1], key[2]).format == "bf16"


def test_a_replan_changes_an_operand_only_after_patience_and_keeps_high_operands_high() -> None:
    model = tiny_bert(dropout=0.0)
    plan = Plan.uniform("fp8").with_rule("cls.predictions.decoder", SiteSpec())
    config = AdaptiveConfig(every=1, replan_every=1, patience=3, candidates=("bf16", "fp8_e4m3", "int8"))
    observer = observer_for(model, plan, config).attach()
    numscope.convert(model, plan)
    adapter = Adapter(model, plan, config, observer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        _grads(model)
        optimizer.step()
        observer.step()
        changes = adapter.after_step(step)
        if step < 2:  # two re-plans: patience 3 not reached
            assert changes == []
    replans = [c for c in adapter.history if c.cause == "replan"]
    assert replans and all(c.step >= 3 for c in replans)
    assert all(c.site != "cls.predictions.decoder" for c in replans)
    assert converted_plan(model).for_site("cls.predictions.decoder").is_high
    budget = adapter.state_dict()["state"]["budget"]
    assert budget == pytest.approx(8.0)  # the starting plan's own bits over the quantized operands


def test_a_budget_the_limits_cannot_meet_is_raised_to_the_least_that_meets_them() -> None:
    """4 bits with 8- and 16-bit candidates: the re-plan takes the cheapest plan within the limits and
    says why, instead of stopping the training."""
    model = tiny_bert(dropout=0.0)
    plan = Plan.uniform("fp8")
    config = AdaptiveConfig(
        every=1, replan_every=1, patience=1, bit_budget=4, candidates=("bf16", "fp8_e4m3")
    )
    observer = observer_for(model, plan, config).attach()
    numscope.convert(model, plan)
    adapter = Adapter(model, plan, config, observer)
    _grads(model)
    observer.step()
    changes = adapter.after_step(0)
    assert changes and all("(the budget 4 cannot meet the limits)" in c.measurement for c in changes)


def test_a_decision_out_of_step_with_the_observer_is_refused() -> None:
    model = tiny_bert(dropout=0.0)
    plan = Plan.uniform("fp8")
    config = AdaptiveConfig(every=1)
    observer = observer_for(model, plan, config).attach()
    numscope.convert(model, plan)
    adapter = Adapter(model, plan, config, observer)
    _grads(model)
    with pytest.raises(AdaptiveError, match=r"call observer\.step\(\) first"):
        adapter.after_step(0)


def test_the_guard_alone_observes_only_what_it_reads() -> None:
    config = AdaptiveConfig(replan_every=None)
    observer = observer_for(tiny_bert(), Plan.uniform("fp8"), config)
    assert observer.config.candidates == ("bf16",) and not observer.config.backward_error
    assert observer_for(tiny_bert(), Plan.uniform("fp8"), AdaptiveConfig()).config.backward_error


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"every": 0}, "every must be a whole number ≥ 1"),
        ({"fallback": "fp7"}, "fp7"),
        ({"max_underflow_pct": 120}, "a share from 0 to 100"),
        ({"patience": 1.5}, "patience must be a whole number"),
        ({"bit_budget": 40}, r"bits in \(0, 32\]"),
        ({"candidates": ()}, "at least one"),
        ({"arm": "never"}, "arm must be 'met' or 'always'"),
        ({"sensitivity_from": "/no/such/run"}, "no such analysis folder"),
    ],
)
def test_bad_settings_are_refused_with_what_is_allowed(settings, message) -> None:
    with pytest.raises(AdaptiveError, match=message):
        AdaptiveConfig(**settings)


# ------------------------------------------------------------------------------------------------ the CLI
ADAPTIVE = ["--adaptive", "--adapt-every", "1", "--replan-every", "1", "--patience", "1"]
LLAMA_PY = """
from transformers import LlamaConfig, LlamaForCausalLM


def llama(vocab_size):
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)
"""


def test_train_adaptive_on_a_gqa_llama_writes_its_history_and_exports_its_final_plan(ws: Path) -> None:  # noqa: F811
    (ws / "adaptive_llama.py").write_text(LLAMA_PY)
    out = ws / "runs" / "adaptive-llama"
    llama = f"{ws / 'adaptive_llama.py'}:llama"
    run = cli("train", *flags(ws, llama), "--plan", "fp8", *ADAPTIVE, "--out", out)
    assert run.code == 0, run.err
    assert "average bits over training" in run.out
    history = read_history(out / "plan_history.csv")
    assert history and all(c.cause == "replan" for c in history)
    assert any(".self_attn." in c.site for c in history)
    summary = json.loads((out / "adaptive.json").read_text())
    result = json.loads((out / "result.json").read_text())
    assert result["avg_bits"] == summary["average_bits"] and math.isfinite(result["avg_bits"])
    final = Plan.load(out / "plan.final.yaml")
    last = {c.key: c.new for c in history}
    assert all(final.for_site(s).operand(g, o).format == new for (s, g, o), new in last.items())
    exported = cli(
        "export", out / "plan.final.yaml", "--to", "te", "--model", llama, "--out", ws / "te-final"
    )
    assert exported.code == 0, exported.err
    assert any((ws / "te-final").iterdir())
    report = cli("report", out, "-o", ws / "adaptive.html")
    assert report.code == 0, report.err
    assert "the adaptive plan over training" in (ws / "adaptive.html").read_text()


def test_adaptive_flags_without_adaptive_are_an_error(ws: Path) -> None:  # noqa: F811
    bad = cli("train", *flags(ws), "--plan", "fp8", "--replan-every", "2", "--out", ws / "runs" / "x")
    assert bad.code == 2 and "--replan-every set(s) adaptive training: add --adaptive" in bad.err
    fallback = cli("train", *flags(ws), "--plan", "fp8", "--adaptive", "--fallback", "fp7", "--out", ws / "y")
    assert fallback.code == 2 and "fp7" in fallback.err and "Traceback" not in fallback.err


def test_the_adaptive_flags_are_generated_from_the_settings_and_share_their_defaults(tmp_path: Path) -> None:
    """``train``'s adaptive flags come from :class:`AdaptiveConfig`'s fields: ``--adaptive`` alone gives its
    defaults, every described field has a flag that sets it, ``none`` switches a limit off, and
    ``--replan-every 0`` leaves the guard alone, as ``replan_every=0`` does from Python."""
    import dataclasses

    from numscope._settings import flag_of
    from numscope.cli import build_parser
    from numscope.cli.runs import _adaptive_config

    parser = build_parser()
    base = ["train", "--model", "tiny-bert", "--text", "t.txt", "--plan", "fp8", "--out", str(tmp_path)]
    assert _adaptive_config(parser.parse_args([*base, "--adaptive"])) == AdaptiveConfig()
    assert _adaptive_config(parser.parse_args(base)) is None
    described = [f for f in dataclasses.fields(AdaptiveConfig) if "help" in f.metadata]
    assert {f.name for f in described} >= {"every", "max_underflow_pct", "replan_every", "bit_budget"}
    analysis = tmp_path / "analysis"
    analysis.mkdir()
    given = {
        "every": ("3", 3),
        "fallback": ("fp16", "fp16"),
        "max_underflow_pct": ("none", None),
        "max_overflow_pct": ("0.5", 0.5),
        "min_sqnr_db": ("12", 12.0),
        "clear_after": ("5", 5),
        "arm": ("always", "always"),
        "replan_every": ("0", None),
        "patience": ("4", 4),
        "bit_budget": ("7.5", 7.5),
        "sensitivity_from": (str(analysis), str(analysis.resolve())),
    }
    assert {f.name for f in described} == set(given)
    for item in described:
        text, value = given[item.name]
        config = _adaptive_config(parser.parse_args([*base, "--adaptive", flag_of(item), text]))
        assert getattr(config, item.name) == value, item.name
        assert config == dataclasses.replace(AdaptiveConfig(), **{item.name: value})
    assert AdaptiveConfig(replan_every=0).replan_every is None


def test_a_crashed_adaptive_run_resumes_with_the_same_plan_history(
    ws: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The demo's model kind (tiny BERT, masked LM) crashes at its 3rd step after a checkpoint at step 2;
    resumed, it ends with the parameters, history and final plan of the run that never stopped."""
    model = f"{ws / 'cli_models.py'}:stopping"
    whole_dir, folder = ws / "runs" / "adaptive-whole", ws / "runs" / "adaptive-resumed"
    whole = cli("train", *flags(ws, model), "--plan", "fp8", *ADAPTIVE, "--out", whole_dir)
    assert whole.code == 0, whole.err
    monkeypatch.setenv("NUMSCOPE_TEST_STOP", "1")
    with pytest.raises(RuntimeError, match="the machine went away"):
        cli("train", *flags(ws, model), "--plan", "fp8", *ADAPTIVE, "--out", folder)
    monkeypatch.delenv("NUMSCOPE_TEST_STOP")
    assert (folder / "checkpoint.pt").is_file()
    assert read_history(folder / "plan_history.csv") == [
        c for c in read_history(whole_dir / "plan_history.csv") if c.step <= 2
    ]  # written with the checkpoint
    resumed = cli("train", *flags(ws, model), "--plan", "fp8", *ADAPTIVE, "--out", folder)
    assert resumed.code == 0, resumed.err
    history = read_history(whole_dir / "plan_history.csv")
    steps = {c.step for c in history}
    assert min(steps) <= 2 < max(steps)  # decisions before the checkpoint and after the crash
    assert read_history(folder / "plan_history.csv") == history
    assert (folder / "plan.final.yaml").read_text() == (whole_dir / "plan.final.yaml").read_text()
    assert json.loads((folder / "adaptive.json").read_text()) == json.loads(
        (whole_dir / "adaptive.json").read_text()
    )
    first = numscope.load_checkpoint(whole_dir / "model.pt")["model"]
    second = numscope.load_checkpoint(folder / "model.pt")["model"]
    assert all(torch.equal(first[name], second[name]) for name in first)
    changed = cli("train", *flags(ws, model), "--plan", "fp8", "--adaptive", "--out", folder)
    assert changed.code == 2 and "adaptive" in changed.err  # other adaptive settings: not reused


def test_replans_score_by_the_analysis_the_plan_was_recommended_from(ws: Path) -> None:  # noqa: F811
    """analyze → recommend --bit-budget (the sensitivity objective, limits off) → train --adaptive
    --adapt-from the same analysis: the re-plans re-solve that objective within the plan's own bits, instead
    of the noise objective within limits the plan was not made under."""
    run = ws / "runs" / "adapt-analyze"
    analyzed = cli("analyze", *flags(ws), "--every", "1", "--out", run)
    assert analyzed.code == 0, analyzed.err
    plan = ws / "adapt-plan.yaml"
    recommended = cli("recommend", run, "--bit-budget", "6", "-o", plan)
    assert recommended.code == 0, recommended.err
    out = ws / "runs" / "adapt-from"
    trained = cli("train", *flags(ws), "--plan", plan, *ADAPTIVE, "--adapt-from", run, "--out", out)
    assert trained.code == 0, trained.err
    replans = [c for c in read_history(out / "plan_history.csv") if c.cause == "replan"]
    # the sensitivity objective with limits off: each choice is the least total sensitivity within the
    # budget or, kept at its cheapest format, judged by no limit (the noise objective's would be)
    assert replans and all(
        "least total sensitivity" in c.measurement or "no limits set" in c.measurement for c in replans
    )
    assert all("cannot meet the limits" not in c.measurement for c in replans)
    bare = ws / "runs" / "adapt-bare"
    assert cli("analyze", *flags(ws), "--sensitivity", "0", "--out", bare).code == 0
    refused = cli("train", *flags(ws), "--plan", plan, "--adaptive", "--adapt-from", bare, "--out", ws / "z")
    assert refused.code == 2 and "holds no operand sensitivity" in refused.err
