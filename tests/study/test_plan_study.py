"""The plan study's parts: operand orders, budget filling, the gap model, the verdicts, seeded runs; and the
quick study end to end (slow)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy.optimize import nnls

import numscope
from numscope._names import layer_index
from numscope.plan import Plan
from numscope.study import (
    GapModel,
    Operands,
    PlanStudyConfig,
    StudyError,
    budget_plans,
    fill_order,
    paired_verdict,
    plan_of,
)
from numscope.study.plans import (
    order_first_last,
    order_gradients_high,
    order_inverse,
    order_last_layers,
    order_wgrad_high,
    shuffle_formats,
)
from numscope.vocab import GEMMS
from tiny_models import tiny_bert

LOW, HIGH = "mxfp4_e2m1", "mxfp8_e4m3"


@pytest.fixture(scope="module")
def observed():
    """A real analysis: a 3-layer tiny BERT observed on two training steps in the study's two formats."""
    model = tiny_bert(vocab_size=200, layers=3)
    ids = torch.randint(5, 200, (4, 16))
    order = [s.name for s in numscope.sites(model, {"input_ids": ids})]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with numscope.observe(model, candidates=[LOW, HIGH, "bf16"]) as observer:
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            observer.step()
    analysis = observer.analysis()
    return analysis, Operands.from_analysis(analysis, order)


def test_layer_index_is_read_from_the_usual_names():
    assert layer_index("bert.encoder.layer.11.attention.self.query") == 11
    assert layer_index("model.layers.3.mlp.up_proj") == 3
    assert layer_index("transformer.h.0.attn.c_attn") == 0
    assert layer_index("cls.predictions.decoder") is None
    assert layer_index("model.layers_norm.weight") is None


def test_operands_follow_the_models_call_order(observed):
    analysis, operands = observed
    sites = operands.sites()
    layers = [layer_index(s) for s in sites]
    assert layers[0] == 0 and None in layers
    assert sites[-1].startswith("cls."), sites[-1]  # the MLM head runs last
    assert [i for i in layers if i is not None] == sorted(i for i in layers if i is not None)
    assert set(operands.keys) == {k for k in analysis.elements if analysis.elements[k] > 0}


def test_heuristic_orders_put_their_operands_first(observed):
    _, operands = observed
    first_last = order_first_last(operands)
    ranks = [layer_index(k[0]) for k in first_last]
    head = sum(1 for r in ranks if r is None)
    assert all(r is None for r in ranks[:head])  # the head (outside the layers) first
    assert set(ranks[head:]) == {0, 1, 2} and ranks[-1] == 1  # then both ends, the middle layer last
    assert (
        first_last[head:].index(next(k for k in first_last if layer_index(k[0]) == 1))
        > sum(1 for r in ranks if r in (0, 2)) - 1
    )
    last = order_last_layers(operands)
    assert last[0][0] == operands.sites()[-1] and last[-1][0] == operands.sites()[0]
    wgrad = order_wgrad_high(operands)
    n_wgrad = sum(1 for k in operands.keys if k[1] == "wgrad")
    assert {k[1] for k in wgrad[:n_wgrad]} == {"wgrad"}
    gradients = order_gradients_high(operands)
    n_grad = sum(1 for k in operands.keys if k[2] == "grad_output")
    assert {k[2] for k in gradients[:n_grad]} == {"grad_output"}
    for order in (first_last, last, wgrad, gradients):
        assert sorted(order) == sorted(operands.keys)


@pytest.mark.parametrize("budget", [5.0, 6.0, 7.0])
def test_every_budget_plan_lands_within_a_tenth_of_a_bit(observed, budget):
    analysis, operands = observed
    config = PlanStudyConfig(budgets=(budget,), random_plans=5)
    gap_model = GapModel({"fprop": 1.0, "dgrad": 0.5, "wgrad": 0.1}, 0.0, 4)
    plans = budget_plans(analysis, operands, config, gap_model)
    families = [p.family for p in plans]
    assert families.count("numscope") == 2 and families.count("heuristic") == 4
    assert families.count("random") == 5 and families.count("inverse") == 1
    sizes = operands.sizes()
    for plan in plans:
        bits = plan.plan().average_bits(sizes)
        assert bits == pytest.approx(operands.average_bits(plan.formats))  # the plan is what was built
        assert budget - 0.1 <= bits <= budget + 1e-9, (plan.name, bits)
        assert set(plan.formats.values()) <= {LOW, HIGH}
    randoms = [tuple(sorted(p.formats.items())) for p in plans if p.family == "random"]
    assert len(set(randoms)) == 5  # five different allocations


def test_fill_order_upgrades_in_order_and_refuses_a_budget_below_all_low(observed):
    _, operands = observed
    order = list(operands.keys)
    formats = fill_order(order, operands, 6.0, LOW, HIGH)
    upgraded = [k for k in order if formats[k] == HIGH]
    first_skipped = next(k for k in order if formats[k] == LOW)
    assert upgraded[0] == order[0] and order.index(first_skipped) > 0
    with pytest.raises(StudyError, match="below all-mxfp4_e2m1"):
        fill_order(order, operands, 4.0, LOW, HIGH)


def test_a_shuffled_plan_keeps_its_formats_and_bits_in_other_places(observed):
    _, operands = observed
    formats = fill_order(list(operands.keys), operands, 6.0, LOW, HIGH)
    formats[operands.keys[-1]] = "bf16"
    shuffled = shuffle_formats(formats, operands, seed=3)
    assert shuffled.keys() == formats.keys() and shuffled != formats
    assert operands.average_bits(shuffled) == operands.average_bits(formats)
    for size in set(operands.elements.values()):  # each format dealt out among operands of one size
        same = [k for k in operands.keys if operands.elements[k] == size]
        assert sorted(shuffled[k] for k in same) == sorted(formats[k] for k in same)
    assert shuffle_formats(formats, operands, seed=3) == shuffled
    assert shuffle_formats(formats, operands, seed=4) != shuffled


def test_inverse_spends_bits_where_the_advisor_does_not(observed):
    analysis, operands = observed
    config = PlanStudyConfig(budgets=(5.5,), random_plans=0)
    plans = {p.family: p for p in budget_plans(analysis, operands, config)}
    ours = {k for k, f in plans["numscope"].formats.items() if f == HIGH}
    inverse = {k for k, f in plans["inverse"].formats.items() if f == HIGH}
    assert ours and inverse and not ours & inverse
    first = order_inverse(analysis, operands, LOW, HIGH)[0]
    assert plans["inverse"].formats[first] == HIGH or operands.elements[first] * 4 > 1.25 * sum(
        operands.elements.values()
    )


def test_gap_model_recovers_known_coefficients_and_predicts():
    rng = np.random.default_rng(0)
    truth = {"fprop": 0.02, "dgrad": 0.005, "wgrad": 0.0}
    features = [{g: float(rng.uniform(0, 1)) for g in truth} for _ in range(6)]
    gaps = [sum(truth[g] * f[g] for g in truth) for f in features]
    model = GapModel.fit(features, [[g, g, g] for g in gaps])  # exact points: the prior cannot move them
    for gemm, value in truth.items():
        assert model.coefficients[gemm] == pytest.approx(value, abs=1e-9)
    assert model.spread == pytest.approx(0.0, abs=1e-9)
    assert model.predict({"fprop": 1.0, "dgrad": 2.0, "wgrad": 5.0}) == pytest.approx(0.03)
    assert model.noise_weights() == pytest.approx(
        {"*/fprop/*": 1.0, "*/dgrad/*": 0.25, "*/wgrad/*": 0.0}, abs=1e-9
    )
    noisy = GapModel.fit(features, [[g + 0.001 * (-1) ** i] for i, g in enumerate(gaps)])
    assert noisy.spread > 0.0
    with pytest.raises(StudyError, match="matched calibration points"):
        GapModel.fit(features, [[g] for g in gaps[:-1]])
    with pytest.raises(StudyError, match="at least one finite gap"):
        GapModel.fit(features, [[], *([g] for g in gaps[1:])])


def _role_points(per_role: dict[str, list[float]], everywhere: list[float]) -> tuple[list, list]:
    """Calibration points as the study makes them: the low format in one role at a time (feature 1 in
    that role), then everywhere."""
    features = [{g: float(g == role) for g in GEMMS} for role in per_role]
    return [*features, dict.fromkeys(GEMMS, 1.0)], [*per_role.values(), everywhere]


def test_gap_model_does_not_make_a_role_free_on_a_result_inside_its_noise():
    # the demo model's calibration (docs/results/plan-study.md): forward noise alone came out −0.007 ±
    # 0.026 nats
    per_role = {
        "fprop": [0.023, -0.025, -0.019],
        "dgrad": [0.030, 0.027, 0.000],
        "wgrad": [0.074, 0.032, -0.003],
    }
    features, gaps = _role_points(per_role, [0.102, 0.069, 0.037])
    model = GapModel.fit(features, gaps)
    plain, _ = nnls(np.array([[f[g] for g in GEMMS] for f in features]), np.array([np.mean(g) for g in gaps]))
    assert plain[GEMMS.index("fprop")] == 0.0  # what the plain fit did: forward noise free
    assert 0.0 < model.pooled < np.mean(gaps[-1])
    assert model.coefficients["fprop"] > 0.25 * model.pooled
    assert max(model.coefficients.values()) <= max(np.mean(v) for v in per_role.values())


def test_gap_model_keeps_a_role_its_precise_results_pin(tmp_path):
    # resolved points keep their coefficient; a role measured precisely at zero cost stays near zero
    per_role = {
        "fprop": [0.0149, 0.0150, 0.0151],
        "dgrad": [0.0269, 0.0270, 0.0271],
        "wgrad": [0.0001, -0.0001, 0.0],
    }
    features, gaps = _role_points(per_role, [0.0419, 0.0420, 0.0421])
    model = GapModel.fit(features, gaps)
    assert model.coefficients["fprop"] == pytest.approx(0.015, rel=0.02)
    assert model.coefficients["dgrad"] == pytest.approx(0.027, rel=0.02)
    assert model.coefficients["wgrad"] < 0.001
    (tmp_path / "gap_model.json").write_text(json.dumps(model.to_dict()))
    assert GapModel.load(tmp_path / "gap_model.json") == model


def test_gap_model_keeps_the_formats_it_was_calibrated_on(tmp_path):
    features, gaps = _role_points({g: [0.01, 0.011, 0.012] for g in GEMMS}, [0.03, 0.031, 0.032])
    model = GapModel.fit(features, gaps, formats=("mxfp4_e2m1", "fp8_e4m3"))
    (tmp_path / "gap_model.json").write_text(json.dumps(model.to_dict()))
    assert GapModel.load(tmp_path / "gap_model.json").formats == ("mxfp4_e2m1", "fp8_e4m3")
    # a gap_model.json written before the formats were stored: calibrate's "low" and "also" beside it
    older = {k: v for k, v in model.to_dict().items() if k != "formats"}
    (tmp_path / "old.json").write_text(json.dumps({**older, "low": "mxfp4_e2m1", "also": ["nvfp4"]}))
    assert GapModel.load(tmp_path / "old.json").formats == ("mxfp4_e2m1", "nvfp4")
    (tmp_path / "bare.json").write_text(json.dumps(older))
    assert GapModel.load(tmp_path / "bare.json").formats == ()  # unknown: nothing is called extrapolated


def test_gap_model_without_any_cost_has_no_prior():
    features, gaps = _role_points({g: [0.0, -0.001, 0.001] for g in GEMMS}, [-0.002, 0.0, -0.001])
    model = GapModel.fit(features, gaps)
    assert model.pooled == 0.0
    assert model.coefficients == pytest.approx(dict.fromkeys(GEMMS, 0.0), abs=1e-6)


def test_verdict_needs_three_seeds_and_two_standard_deviations():
    assert paired_verdict([0.1, 0.1]) == "n/a (<3 seeds)"
    assert paired_verdict([0.010, 0.011, 0.012]) == "worse"
    assert paired_verdict([-0.010, -0.011, -0.012]) == "better"
    assert paired_verdict([0.01, -0.01, 0.012]) == "tie"
    assert paired_verdict([0.0, 0.0, 0.0]) == "same"


def test_plan_of_gives_each_operand_its_format():
    formats = {
        ("a.q", "fprop", "input"): HIGH,
        ("a.q", "fprop", "weight"): LOW,
        ("a[0]", "wgrad", "grad_output"): LOW,
    }
    plan = plan_of(formats)
    assert plan.for_site("a.q").operand("fprop", "input").format == HIGH
    assert plan.for_site("a.q").operand("fprop", "weight").format == LOW
    assert plan.for_site("a[0]").operand("wgrad", "grad_output").format == LOW
    assert plan.for_site("a0").is_high  # the glob character is escaped: exact names only


def test_config_refuses_budgets_outside_the_two_formats():
    with pytest.raises(StudyError, match="between mxfp4_e2m1"):
        PlanStudyConfig(budgets=(9.0,)).check()
    with pytest.raises(StudyError, match="distinct"):
        PlanStudyConfig(seeds=(1, 1)).check()


def test_the_studys_model_does_not_follow_the_demos_defaults():
    """The study's default runs keep the settings its README tables were made with (256 validation blocks,
    15% masked) whatever the demo's defaults become; --demo-model trains exactly as the demo does, for the
    1,000 steps the study's tables on the demo's model were made with."""
    from dataclasses import replace

    from numscope.demo.main import DemoConfig
    from numscope.run.folders import setting_changes
    from numscope.study.config import DEMO_MODEL_STEPS

    study = PlanStudyConfig().experiment(0)
    assert study.val_blocks == 256 and study.train.mask_probability == 0.15
    assert study.train.steps == 300 and study.seq_len == 128 and study.vocab_size == 1000
    demo, learning = DemoConfig(), PlanStudyConfig.demo_model().experiment(0)
    shape = ("hidden", "layers", "heads", "intermediate", "seq_len", "vocab_size", "val_blocks", "dropout")
    for name in shape:
        assert getattr(learning, name) == getattr(demo, name), name
    assert learning.train.steps == DEMO_MODEL_STEPS == 1000
    assert replace(learning.train, checkpoint_every=0) == replace(
        demo.train, checkpoint_every=0, steps=DEMO_MODEL_STEPS
    )
    # a study folder recorded before these settings existed resumes (it was made with 256 and 15%)
    old = {k: v for k, v in PlanStudyConfig().__dict__.items() if k not in ("val_blocks", "mask_probability")}
    assert setting_changes({"config": old}, {"config": dict(PlanStudyConfig().__dict__)}) == []
    assert setting_changes({"config": old}, {"config": dict(PlanStudyConfig.demo_model().__dict__)})


def test_demo_model_and_quick_are_one_choice(capsys):
    from numscope.cli import main

    assert main(["study", "plans", "--quick", "--demo-model", "--out", "unused"]) == 2
    assert "choose one" in capsys.readouterr().err


def test_a_study_run_is_seeded(tmp_path):
    """The same (plan, seed) trains to the same loss in two folders; another seed differs."""
    from numscope.study.plan_study import _run_all

    config = PlanStudyConfig.quick()
    cfg = {**config.__dict__, "steps": 6}

    def task(folder: str, seed: int) -> dict:
        return dict(
            name="fp8",
            plan="fp8",
            seed=seed,
            folder=str(tmp_path / folder),
            observe=False,
            config=cfg,
            text=None,
        )

    first, again, other = (
        _run_all([task(f, seed)], 1, print)[0] for f, seed in (("a", 0), ("b", 0), ("c", 1))
    )
    assert first["val_loss"] == again["val_loss"]
    assert first["val_loss"] != other["val_loss"]


@pytest.mark.slow
def test_quick_plan_study_end_to_end(tmp_path, capsys):
    from numscope.advisor.target import recipe_bits
    from numscope.analysis import Analysis
    from numscope.cli import main
    from numscope.plan.export import export
    from numscope.plan.targets import get_target

    flags = ["study", "plans", "--quick", "--target", "te", "--out", str(tmp_path / "study")]
    assert main(flags) == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "study" / "plan_study.json").read_text())
    for name in ("plan_study.md", "pareto.png", "predicted_vs_measured.png"):
        assert (tmp_path / "study" / name).stat().st_size > 0
    rows = {r["name"]: r for r in data["rows"]}
    assert {"fp32", "mxfp8", "mxfp4", "numscope@6", "numscope calibrated@6", "inverse@6"} <= set(rows)
    assert "numscope sensitivity@6" in rows and (tmp_path / "study" / "sensitivity.json").is_file()
    target = "numscope te@6"  # the plan for Transformer Engine, trained beside the others
    assert all(math.isfinite(r["predicted_gap_sensitivity"]) for r in data["rows"] if r["name"] != target)
    for row in data["rows"]:
        assert len(row["gaps"]) == 2 and all(math.isfinite(g) for g in row["gaps"])
        if row["budget"] is not None and row["name"] != target:
            assert 5.9 <= row["bits"] <= 6.0 + 1e-9, row["name"]
    # budgeted within TE's own range (what it cannot convert, the attention products, at 32 bits): 6 bits
    # lie midway between MXFP4 and MXFP8, so the plan costs midway between TE's cheapest recipe and its FP8
    analysis = Analysis.load(tmp_path / "study" / "runs" / "fp32" / "seed0" / "analysis")
    bits = recipe_bits(analysis, get_target("te"), analysis.candidates)
    assert rows[target]["bits"] <= (min(bits.values()) + bits["fp8"]) / 2 + 0.01
    # the target's plan is what TE runs: it exports with nothing left out, and its formats are TE's
    made = Plan.load(tmp_path / "study" / "plans" / "numscope_te@6.yaml")
    sites = [(name, kind) for name, kind in analysis.meta["site_kinds"]]
    assert export(made, "te", sites, "study").unexpressed == []
    used = {made.for_site(n).operand(g, o).format for n, g, o in analysis.keys()}  # noqa: SIM118
    assert used - {"high"} and used <= {"high", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3@rceil", "nvfp4@nan"}, used
    assert rows["fp32"]["gaps"] == [0.0, 0.0]
    assert math.isfinite(data["fp32_seed_sd"]) and data["fp32_seed_sd"] > 0
    assert "Spearman" in printed and "numscope@6" in printed
    # rerun: every run is reused, nothing trains again
    before = {p: p.stat().st_mtime for p in (tmp_path / "study" / "runs").rglob("result.json")}
    assert main(flags) == 0
    assert before == {p: p.stat().st_mtime for p in (tmp_path / "study" / "runs").rglob("result.json")}


def test_plan_flags_are_refused_for_the_synthetic_study(capsys):
    from numscope.cli import main

    assert main(["study", "--quick", "--size", "8"]) == 2
    assert "only for 'numscope study plans'" in capsys.readouterr().err


def test_derived_limits_accept_every_format_at_parity_and_say_what_they_still_reject():
    from numscope.study import derive_limits

    fp8 = {"min_sqnr_db": 25.3, "max_underflow_pct": 54.0, "max_overflow_pct": 0.0, "max_be_ratio": 48.6}
    mxfp6 = {"min_sqnr_db": 24.2, "max_underflow_pct": 12.0, "max_overflow_pct": 10.34, "max_be_ratio": 130.0}
    mxfp4 = {"min_sqnr_db": 14.0, "max_underflow_pct": 40.0, "max_overflow_pct": 5.0, "max_be_ratio": 900.0}
    nvfp4 = {"min_sqnr_db": 24.5, "max_underflow_pct": 1.0, "max_overflow_pct": 0.0, "max_be_ratio": 100.0}
    derived = derive_limits(
        [("fp8", True, fp8), ("mxfp6", True, mxfp6), ("mxfp4", False, mxfp4), ("nvfp4", False, nvfp4)]
    )
    assert derived["limits"] == {
        "min_sqnr_db": 24.0,  # the worst parity SQNR, rounded down to 0.5 dB
        "max_underflow_pct": 54.0,
        "max_overflow_pct": 11.0,  # 10.34 rounded up to two significant digits
        "max_be_ratio": 130.0,
    }
    assert derived["parity"] == ["fp8", "mxfp6"]
    assert derived["behind"] == [
        {"plan": "mxfp4", "rejected_by": ["min_sqnr_db", "max_be_ratio"]},
        {"plan": "nvfp4", "rejected_by": []},  # behind, yet within every limit: said, not hidden
    ]
    assert derive_limits([("mxfp4", False, mxfp4)])["limits"] == {}


def test_sensitivity_model_scores_each_operand_by_its_gradient_error():
    from numscope.analysis import Sensitivity
    from numscope.study import SensitivityModel

    a, b = ("s", "fprop", "input"), ("s", "dgrad", "grad_output")
    measured = Sensitivity(
        candidates=(LOW, HIGH),
        granularity="operand",
        reference_loss=[1.0],
        results={
            a: {LOW: {"grad_rel_error": 0.1}, HIGH: {"grad_rel_error": 0.01}},
            b: {LOW: {"grad_rel_error": 0.3}, HIGH: {"grad_rel_error": 0.02}},
        },
    )
    model = SensitivityModel.from_sensitivity(measured)
    assert model.score(a, LOW) == pytest.approx(0.01) and model.score(b, HIGH) == pytest.approx(4e-4)
    assert model.score(a, "high") == 0.0
    operands = Operands((a, b), {a: 10, b: 10})
    assert model.features(operands, {a: LOW, b: HIGH}) == pytest.approx(
        {"fprop": 0.01, "dgrad": 4e-4, "wgrad": 0.0}
    )
    with pytest.raises(StudyError, match="no sensitivity of s/wgrad/input"):
        model.score(("s", "wgrad", "input"), LOW)
