"""The advisor on hand-built analyses whose best answers are known."""

from __future__ import annotations

import itertools
import math

import pytest

import numscope
from numscope import advisor
from numscope.advisor import AdvisorError, Limits, recommend_table
from numscope.analysis import Analysis, OperandRecord, Sensitivity
from numscope.plan import Plan
from numscope.vocab import OPERANDS

LIMITS = {"max_be_ratio": 40.0, "max_underflow_pct": 2.0, "max_overflow_pct": 0.1, "min_sqnr_db": 22.0}
"""The limits these hand-built analyses were designed around (the advisor's defaults before they were
calibrated on training outcomes); every call below uses them unless it sets its own."""


def advise(analysis, **kwargs):
    return advisor.advise(analysis, **{**LIMITS, **kwargs})


def recommend(analysis, **kwargs):
    return advisor.recommend(analysis, **{**LIMITS, **kwargs})


def test_default_limits_are_the_calibrated_ones():
    """The defaults come from the plan study's outcomes (advisor docstring): the loosest limits that accept
    the fp8 hybrid's measured worst case, which trained at FP32 parity."""
    assert Limits() == Limits(
        max_be_ratio=140.0, max_underflow_pct=54.0, max_overflow_pct=0.0, min_sqnr_db=24.0
    )
    fp8_worst = {
        "min_sqnr_db": 24.25,
        "max_underflow_pct": 53.69,
        "max_overflow_pct": 0.0,
        "max_be_ratio": 138.18,
    }
    defaults = Limits()
    assert fp8_worst["min_sqnr_db"] >= defaults.min_sqnr_db
    assert fp8_worst["max_underflow_pct"] <= defaults.max_underflow_pct
    assert fp8_worst["max_overflow_pct"] <= defaults.max_overflow_pct
    assert fp8_worst["max_be_ratio"] <= defaults.max_be_ratio


CANDIDATES = ("bf16", "fp8_e4m3", "fp8_e5m2", "int8", "mxfp4_e2m1")
GOOD = {"sqnr_db": 40.0, "underflow%": 0.0, "overflow%": 0.0}


def metrics(sqnr: float = 40.0, underflow: float = 0.0, overflow: float = 0.0) -> dict[str, float]:
    return {"sqnr_db": sqnr, "underflow%": underflow, "overflow%": overflow, "rel_error": 10 ** (-sqnr / 20)}


def build(
    table: dict[tuple[str, str, str], dict[str, dict[str, float] | list[dict[str, float]]]],
    elements: dict[tuple[str, str, str], int],
    be_ratio: dict[tuple[str, str, str, str], float] | None = None,
) -> Analysis:
    """An analysis with two steps; a metrics list gives per-step values, a dict the same on both steps.

    be_ratio: (site, gemm, operand, candidate) -> BE ratio to bf16 (default 10 for every candidate).
    """
    analysis = Analysis(candidates=CANDIDATES)
    for key, per_candidate in table.items():
        steps = {}
        for step in (0, 1):
            values = {label: (m[step] if isinstance(m, list) else m) for label, m in per_candidate.items()}
            steps[step] = OperandRecord({"amax": 1.0}, values, elements[key], elements[key])
        analysis.operands[key] = steps
        analysis.elements[key] = elements[key]
        site, gemm, operand = key
        left = OPERANDS[gemm][0] == operand
        pairs = analysis.backward_errors.setdefault((site, gemm), {})
        for label in CANDIDATES:
            ratio = 1.0 if label == "bf16" else (be_ratio or {}).get((*key, label), 10.0)
            pair = (label, "fp32") if left else ("fp32", label)
            pairs[pair] = {
                step: {"mean": 1e-4 * ratio, "p99": 3e-4 * ratio, "max": 1e-3 * ratio} for step in (0, 1)
            }
    return analysis


A = ("enc.q", "fprop", "input")
B = ("enc.q", "fprop", "weight")
C = ("enc.q", "dgrad", "grad_output")
D = ("enc.k", "wgrad", "input")


def reference_analysis() -> Analysis:
    """Known answers at the default limits (max_be_ratio 40, underflow 2%, overflow 0.1%, SQNR 22 dB):

    A: mxfp4 fails SQNR; int8 fails underflow; e4m3 (31 dB) beats e5m2 (25 dB) on the tie at 8 bits.
    B: mxfp4 passes everything: 4.25 bits.
    C: every 8-bit and 4-bit candidate fails (e4m3 overflow, e5m2 SQNR on step 1, int8 underflow) → bf16.
    D: every cheaper candidate fails the BE ratio → bf16; nothing else differs.
    """
    table = {
        A: {
            "bf16": GOOD,
            "fp8_e4m3": metrics(31),
            "fp8_e5m2": metrics(25),
            "int8": metrics(40, underflow=3.0),
            "mxfp4_e2m1": metrics(15),
        },
        B: {c: metrics(30) for c in CANDIDATES},
        C: {
            "bf16": GOOD,
            "fp8_e4m3": metrics(31, overflow=0.5),
            "fp8_e5m2": [metrics(25), metrics(20)],
            "int8": metrics(40, underflow=10.0),
            "mxfp4_e2m1": metrics(15),
        },
        D: {c: metrics(30) for c in CANDIDATES},
    }
    elements = {A: 1000, B: 100, C: 1000, D: 10}
    be = {(*D, c): 50.0 for c in CANDIDATES if c != "bf16"}
    return build(table, elements, be)


def chosen(recommendation) -> dict[tuple[str, str, str], str]:
    return {c.key: c.format for c in recommendation.choices}


def test_default_limits_pick_the_known_cheapest_formats():
    result = advise(reference_analysis())
    assert chosen(result) == {A: "fp8_e4m3", B: "mxfp4_e2m1", C: "bf16", D: "bf16"}
    plan = result.plan
    assert plan.for_site("enc.q").operand("fprop", "input").format == "fp8_e4m3"
    assert plan.for_site("enc.q").operand("fprop", "weight").format == "mxfp4_e2m1"
    assert plan.for_site("enc.k").operand("wgrad", "input").format == "bf16"
    assert plan.for_site("elsewhere").is_high


def test_each_limit_decides_when_it_is_the_binding_one():
    analysis = reference_analysis()
    # without the SQNR limit A drops to mxfp4 (4.25 bits)
    assert chosen(advise(analysis, min_sqnr_db=None))[A] == "mxfp4_e2m1"
    # a looser underflow limit lets int8 in for A; at the 8-bit tie int8's 40 dB beats e4m3's 31 dB
    assert chosen(advise(analysis, max_underflow_pct=5))[A] == "int8"
    # a looser overflow limit admits e4m3 for C
    assert chosen(advise(analysis, max_overflow_pct=1))[C] == "fp8_e4m3"
    # a looser BE limit admits mxfp4 for D
    assert chosen(advise(analysis, max_be_ratio=60))[D] == "mxfp4_e2m1"
    # a tight BE limit keeps everything at bf16
    assert set(chosen(advise(analysis, max_be_ratio=4)).values()) == {"bf16"}


def test_every_choice_meets_every_limit_on_every_step():
    analysis = reference_analysis()
    limits = {"max_be_ratio": 40, "max_underflow_pct": 2, "max_overflow_pct": 0.1, "min_sqnr_db": 22}
    for choice in advise(analysis, **limits).choices:
        for step in (0, 1):
            m = analysis.record(choice.key, step).metrics[choice.format]
            assert m["sqnr_db"] >= 22 and m["underflow%"] <= 2 and m["overflow%"] <= 0.1


def test_worst_step_decides():
    # C's e5m2 passes at step 0 (25 dB) but not at step 1 (20 dB): with SQNR ≥ 22 it is rejected ...
    assert chosen(advise(reference_analysis(), max_overflow_pct=None))[C] == "fp8_e4m3"
    # ... and with SQNR ≥ 19 both steps pass, e5m2 and e4m3 tie at 8 bits, the higher mean SQNR (e4m3) wins
    result = advise(reference_analysis(), max_overflow_pct=None, min_sqnr_db=19)
    assert chosen(result)[C] == "fp8_e4m3"


def test_nothing_passes_keeps_the_operand_high_and_says_why():
    table = {A: {c: metrics(10) for c in CANDIDATES}}
    result = advise(build(table, {A: 64}))
    (choice,) = result.choices
    assert choice.format == "high"
    assert "no candidate within limits" in choice.reason and "sqnr_db" in choice.reason


def test_reasons_name_the_deciding_metric_and_reach_the_plan():
    result = advise(reference_analysis())
    by_key = {c.key: c for c in result.choices}
    assert by_key[A].metric == "sqnr_db" and by_key[A].value == 15.0
    assert "rejected: int8 underflow% 3 > 2; mxfp4_e2m1 sqnr_db 15 < 22" in by_key[A].reason
    assert by_key[D].metric == "be_ratio" and by_key[D].value == 50.0
    rule = result.plan.rule_for("enc.q")
    assert rule is not None and rule.reasons["fprop/input"] == by_key[A].reason
    rows = recommend_table(result)
    assert {r["format"] for r in rows} == {"fp8_e4m3", "mxfp4_e2m1", "bf16"}
    plan_rows = recommend_table(result.plan)
    assert any(r["reason"] == by_key[A].reason and r["format"] == "fp8_e4m3" for r in plan_rows)


def test_plan_is_accepted_by_plan_files(tmp_path):
    plan = recommend(reference_analysis())
    path = tmp_path / "plan.yaml"
    plan.save(path)
    again = Plan.load(path)
    assert again.for_site("enc.q") == plan.for_site("enc.q")
    assert again.rule_for("enc.k").reasons == plan.rule_for("enc.k").reasons


def test_per_operand_overrides_and_candidate_restriction():
    analysis = reference_analysis()
    result = advise(analysis, per_operand={"enc.q/fprop/input": {"min_sqnr_db": 10}})
    assert chosen(result)[A] == "mxfp4_e2m1" and chosen(result)[C] == "bf16"
    result = advise(analysis, per_operand={"*/fprop/weight": {"candidates": ["fp8_e5m2", "bf16"]}})
    assert chosen(result)[B] == "fp8_e5m2"
    result = advise(analysis, candidates=["bf16", "fp8_e5m2"])
    assert chosen(result)[A] == "fp8_e5m2"


def brute_force(analysis: Analysis, budget: float) -> float:
    """The least total noise over every assignment within the budget of candidates that meet the default
    limits (SQNR ≥ 22 dB on both steps; the table's under/overflow are 0 and its BE ratios 10)."""
    passing = []
    keys = analysis.keys()
    for key in keys:
        options = []
        for label in CANDIDATES:
            sqnr = analysis.metric_values(key, label, "sqnr_db")
            if min(sqnr) >= 22:
                options.append(
                    (numscope.get_format(label).bits_per_element, 10 ** (-sum(sqnr) / len(sqnr) / 10))
                )
        passing.append(options)
    elements = [analysis.elements[k] for k in keys]
    best = math.inf
    for combo in itertools.product(*passing):
        bits = sum(b * n for (b, _), n in zip(combo, elements, strict=True)) / sum(elements)
        if bits <= budget + 1e-12:
            best = min(best, sum(noise for _, noise in combo))
    return best


@pytest.mark.parametrize("budget", [6.0, 9.0, 12.0, 20.0])
def test_bit_budget_is_met_and_optimal(budget):
    table = {
        A: {
            "bf16": metrics(55),
            "fp8_e4m3": metrics(31),
            "fp8_e5m2": metrics(25),
            "int8": metrics(38),
            "mxfp4_e2m1": metrics(23),
        },
        B: {
            "bf16": metrics(55),
            "fp8_e4m3": metrics(30),
            "fp8_e5m2": metrics(24),
            "int8": metrics(27),
            "mxfp4_e2m1": metrics(22.5),
        },
        C: {
            "bf16": metrics(55),
            "fp8_e4m3": metrics(29),
            "fp8_e5m2": metrics(26),
            "int8": metrics(20),
            "mxfp4_e2m1": metrics(23),
        },
        D: {
            "bf16": metrics(55),
            "fp8_e4m3": metrics(33),
            "fp8_e5m2": metrics(27),
            "int8": metrics(35),
            "mxfp4_e2m1": metrics(24),
        },
    }
    elements = {A: 4096, B: 1024, C: 4096, D: 512}
    analysis = build(table, elements)
    result = advise(analysis, bit_budget=budget)
    assert result.optimal
    assert result.average_bits <= budget + 1e-9
    noise = sum(10 ** (-c.value / 10) for c in result.choices)
    assert noise == pytest.approx(brute_force(analysis, budget), rel=1e-12)
    assert all(c.format != "int8" or c.key != C for c in result.choices)  # int8 fails C's SQNR limit


def test_budget_spends_bits_where_they_buy_most():
    table = {
        A: {"bf16": metrics(55), "fp8_e4m3": metrics(31), "mxfp4_e2m1": metrics(23)},
        B: {"bf16": metrics(55), "fp8_e4m3": metrics(31), "mxfp4_e2m1": metrics(30)},
    }
    analysis = build(
        {k: {**{c: metrics(10) for c in CANDIDATES}, **v} for k, v in table.items()}, {A: 1000, B: 1000}
    )
    result = advise(analysis, bit_budget=6.125)  # room for one 8-bit operand and one 4.25-bit operand
    assert chosen(result) == {A: "fp8_e4m3", B: "mxfp4_e2m1"}
    assert result.average_bits == pytest.approx(6.125)


def test_noise_weights_move_the_budget_to_the_operand_that_costs_loss():
    table = {
        A: {"bf16": metrics(55), "fp8_e4m3": metrics(31), "mxfp4_e2m1": metrics(23)},
        B: {"bf16": metrics(55), "fp8_e4m3": metrics(31), "mxfp4_e2m1": metrics(30)},
    }
    analysis = build(
        {k: {**{c: metrics(10) for c in CANDIDATES}, **v} for k, v in table.items()}, {A: 1000, B: 1000}
    )
    # A's noise counts for nothing: the one 8-bit slot goes to B although A is the noisier operand
    result = advise(analysis, bit_budget=6.125, noise_weights={"enc.q/fprop/input": 0.0})
    assert chosen(result) == {A: "mxfp4_e2m1", B: "fp8_e4m3"}
    # later patterns override earlier ones
    result = advise(analysis, bit_budget=6.125, noise_weights={"*": 0.0, "enc.q/fprop/input": 1.0})
    assert chosen(result) == {A: "fp8_e4m3", B: "mxfp4_e2m1"}
    with pytest.raises(AdvisorError, match="must be a finite number >= 0"):
        advise(analysis, bit_budget=6.125, noise_weights={"*": -1.0})


def test_an_objective_replaces_the_noise_in_the_budget():
    table = {
        A: {"bf16": metrics(55), "fp8_e4m3": metrics(31), "mxfp4_e2m1": metrics(23)},
        B: {"bf16": metrics(55), "fp8_e4m3": metrics(31), "mxfp4_e2m1": metrics(30)},
    }
    analysis = build(
        {k: {**{c: metrics(10) for c in CANDIDATES}, **v} for k, v in table.items()}, {A: 1000, B: 1000}
    )
    # by noise A gets the 8-bit slot; a loss impact that says B's low format costs more moves it to B
    impact = {A: {"fp8_e4m3": 0.0, "mxfp4_e2m1": 0.1}, B: {"fp8_e4m3": 0.0, "mxfp4_e2m1": 1.0}}
    result = advise(analysis, bit_budget=6.125, objective=lambda key, label: impact[key].get(label, 0.0))
    assert chosen(result) == {A: "mxfp4_e2m1", B: "fp8_e4m3"}


def test_impossible_budget_names_the_cheapest_assignment():
    with pytest.raises(AdvisorError, match=r"bit budget 4 bits/element is impossible.*at least 11\.65"):
        advise(reference_analysis(), bit_budget=4)


def test_unknown_criterion_lists_the_allowed_ones():
    with pytest.raises(
        AdvisorError,
        match=r"unknown criterion 'max_sqnr_db'; allowed: max_be_ratio, "
        r"max_underflow_pct, max_overflow_pct, min_sqnr_db",
    ):
        recommend(reference_analysis(), max_sqnr_db=3)
    with pytest.raises(AdvisorError, match=r"unknown criterion 'sqnr' \(per_operand '\*'\)"):
        recommend(reference_analysis(), per_operand={"*": {"sqnr": 3}})
    with pytest.raises(AdvisorError, match=r"per_operand pattern 'nope/\*' matches no operand"):
        recommend(reference_analysis(), per_operand={"nope/*": {"min_sqnr_db": 3}})
    with pytest.raises(AdvisorError, match=r"candidate 'nvfp4' was not measured"):
        recommend(reference_analysis(), candidates=["nvfp4"])
    with pytest.raises(AdvisorError, match=r"criterion min_sqnr_db must be a number or None, got 'x'"):
        recommend(reference_analysis(), min_sqnr_db="x")


def test_missing_reference_backward_error_is_explained():
    analysis = reference_analysis()
    for pairs in analysis.backward_errors.values():
        for pair in [p for p in pairs if "bf16" in p]:
            del pairs[pair]
    with pytest.raises(AdvisorError, match=r"with 'bf16' among the candidates, or pass max_be_ratio=None"):
        recommend(analysis)
    plan = recommend(analysis, max_be_ratio=None)
    assert plan.for_site("enc.q").operand("fprop", "weight").format == "mxfp4_e2m1"


def test_the_sensitivity_objective_spends_bits_where_the_gradient_error_is():
    from numscope.advisor import operand_impact, sensitivity_objective

    table = {
        A: {"bf16": metrics(55), "fp8_e4m3": metrics(31), "mxfp4_e2m1": metrics(23)},
        B: {"bf16": metrics(55), "fp8_e4m3": metrics(31), "mxfp4_e2m1": metrics(30)},
    }
    analysis = build(
        {k: {**{c: metrics(10) for c in CANDIDATES}, **v} for k, v in table.items()}, {A: 1000, B: 1000}
    )
    errors = {A: {"fp8_e4m3": 0.01, "mxfp4_e2m1": 0.1}, B: {"fp8_e4m3": 0.01, "mxfp4_e2m1": 0.3}}
    measured = Sensitivity(
        candidates=("fp8_e4m3", "mxfp4_e2m1"),
        granularity="operand",
        results={k: {c: {"grad_rel_error": e} for c, e in v.items()} for k, v in errors.items()},
    )
    assert operand_impact(measured, B, "mxfp4_e2m1") == pytest.approx(0.09)
    assert operand_impact(measured, B, "high") == 0.0
    budget = dict(bit_budget=6.125, candidates=["fp8_e4m3", "mxfp4_e2m1"])
    assert chosen(advise(analysis, **budget)) == {A: "fp8_e4m3", B: "mxfp4_e2m1"}  # A is the noisier
    by_gradient = advise(analysis, **budget, objective=sensitivity_objective(measured))
    assert chosen(by_gradient) == {A: "mxfp4_e2m1", B: "fp8_e4m3"}  # B's gradient error is the larger
    weighted = sensitivity_objective(measured, {"fprop": 2.0, "dgrad": 0.0})  # a role's weight multiplies
    assert weighted(B, "mxfp4_e2m1") == pytest.approx(0.18) and weighted(A, "high") == 0.0
    with pytest.raises(AdvisorError, match="no sensitivity in 'int8'"):
        advise(
            analysis,
            bit_budget=6.125,
            candidates=["int8", "mxfp4_e2m1"],
            objective=sensitivity_objective(measured),
        )
    per_site = Sensitivity(candidates=("mxfp4_e2m1",), results={("enc.q", "*", "*"): {"mxfp4_e2m1": {}}})
    with pytest.raises(AdvisorError, match="needs it per operand"):
        operand_impact(per_site, A, "mxfp4_e2m1")


def test_operands_the_sensitivity_did_not_measure_stay_high_and_the_default_budget_fits(tmp_path):
    """A forecast's sensitivity measures only the sites its stacks convert: the sensitivity objective keeps
    the other operands high (saying why), and recommend's default budget (FP8 on the measured operands,
    the rest high) is one the advisor can meet."""
    from numscope.advisor import sensitivity_objective
    from numscope.workflow import default_budget, unmeasured_operands

    analysis = build({A: {c: metrics(30) for c in CANDIDATES}, B: {c: metrics(30) for c in CANDIDATES}},
                     {A: 1000, B: 3000})  # fmt: skip
    analysis.sensitivity = Sensitivity(
        candidates=("mxfp4_e2m1",),
        granularity="operand",
        results={A: {"mxfp4_e2m1": {"grad_rel_error": 0.1}}},  # B not measured
    )
    assert unmeasured_operands(analysis) == {B}
    budget = default_budget(analysis)
    assert budget == pytest.approx((1000 * 8 + 3000 * 32) / 4000)
    result = advise(
        analysis, bit_budget=budget, objective=sensitivity_objective(analysis.sensitivity, None, analysis)
    )
    choices = {c.key: c for c in result.choices}
    assert choices[B].format == "high" and "did not measure this operand" in choices[B].reason
    assert choices[A].format != "high"


def sensitivity_of(changes: dict[str, float], cosines: dict[str, float] | None = None) -> Sensitivity:
    """Site-level sensitivity of enc.q only: loss_change% and grad_cosine_min per candidate."""
    cosines = cosines or {}
    results = {
        ("enc.q", "*", "*"): {
            c: {"loss_change%": changes[c], "grad_cosine_min": cosines.get(c, 1.0)} for c in CANDIDATES
        }
    }
    return Sensitivity(candidates=CANDIDATES, results=results)


SITE_CHANGES = {"bf16": 0.0, "fp8_e4m3": 2.0, "fp8_e5m2": 0.1, "int8": 0.0, "mxfp4_e2m1": 5.0}


def test_loss_increase_limit_rejects_what_hurts_the_loss():
    analysis = reference_analysis()
    only_q = {"enc.k/*": {"max_loss_increase_pct": None}}  # enc.k was not measured
    result = advise(
        analysis, sensitivity=sensitivity_of(SITE_CHANGES), max_loss_increase_pct=1.0, per_operand=only_q
    )
    # A: e4m3 (2%) now fails; e5m2 (0.1%, 25 dB) is the cheapest left. B: mxfp4 (5%) and e4m3 fail
    assert chosen(result)[A] == "fp8_e5m2" and chosen(result)[B] == "fp8_e5m2"
    by_key = {c.key: c for c in result.choices}
    assert "fp8_e4m3 loss_change% 2 > 1" in by_key[A].reason
    assert chosen(result)[D] == "bf16"  # unaffected: the criterion is off for enc.k
    # without the criterion the choices are the reference ones
    assert chosen(advise(analysis, sensitivity=sensitivity_of(SITE_CHANGES)))[A] == "fp8_e4m3"


def test_gradient_cosine_limit_and_operand_measurements_take_precedence():
    sensitivity = sensitivity_of(SITE_CHANGES, cosines={"fp8_e4m3": 0.99, "fp8_e5m2": 0.9999})
    sensitivity.results[("enc.q", "fprop", "weight")] = {
        c: {"loss_change%": 0.0, "grad_cosine_min": 0.99999} for c in CANDIDATES
    }
    result = advise(
        reference_analysis(),
        sensitivity=sensitivity,
        min_grad_cosine=0.999,
        per_operand={"enc.k/*": {"min_grad_cosine": None}},
    )
    assert chosen(result)[A] == "fp8_e5m2"  # e4m3's site cosine 0.99 < 0.999
    assert chosen(result)[B] == "mxfp4_e2m1"  # B measured alone: every candidate passes


def test_unmeasured_sites_fail_a_sensitivity_criterion_and_say_so():
    analysis = reference_analysis()
    result = advise(analysis, sensitivity=sensitivity_of(SITE_CHANGES), max_loss_increase_pct=1.0)
    choice = next(c for c in result.choices if c.key == D)
    assert choice.format == "high" and "loss_change% not measured" in choice.reason


def test_sensitivity_travels_with_the_analysis(tmp_path):
    analysis = reference_analysis()
    analysis.sensitivity = sensitivity_of(SITE_CHANGES)
    analysis.save(tmp_path / "analysis")
    again = Analysis.load(tmp_path / "analysis")
    limits = {"max_loss_increase_pct": 1.0, "per_operand": {"enc.k/*": {"max_loss_increase_pct": None}}}
    assert recommend(again, **limits) == recommend(analysis, **limits)
    assert chosen(advise(again, **limits))[A] == "fp8_e5m2"


def test_sensitivity_criteria_need_a_measurement_of_every_candidate():
    with pytest.raises(
        AdvisorError,
        match=r"criterion min_grad_cosine needs a sensitivity measurement, which this analysis lacks: "
        r"analyze again with it \(numscope analyze `SensitivitySettings.batches` N",
    ):
        advise(reference_analysis(), min_grad_cosine=0.99)
    partial = sensitivity_of(SITE_CHANGES)
    partial.candidates = ("fp8_e4m3", "fp8_e5m2")
    with pytest.raises(
        AdvisorError,
        match=r"did not measure 'bf16', 'int8', 'mxfp4_e2m1'; measured: "
        r"fp8_e4m3, fp8_e5m2; measure them \(numscope analyze `SensitivitySettings.formats` all\) or "
        r"restrict the candidates to those measured",
    ):
        advise(reference_analysis(), sensitivity=partial, max_loss_increase_pct=1.0)
    with pytest.raises(AdvisorError, match=r"criterion max_loss_increase_pct must be a number or None"):
        advise(reference_analysis(), sensitivity=partial, max_loss_increase_pct="1%")
    with pytest.raises(TypeError, match=r"sensitivity must be a numscope\.Sensitivity, got dict"):
        advise(reference_analysis(), sensitivity={}, max_loss_increase_pct=1.0)


def test_a_product_without_measurable_entries_does_not_fail_the_backward_error_limit():
    """An all-zero product (every entry's |L|·|R| is 0: its BE mean is NaN in every format) is exact in
    every format; the ratio limit then passes instead of reading NaN / NaN as infinitely worse."""
    analysis = build({C: {label: GOOD for label in CANDIDATES}}, {C: 1000})
    for per_step in analysis.backward_errors[("enc.q", "dgrad")].values():
        for stats in per_step.values():
            stats.update(mean=math.nan, p99=math.nan, max=math.nan, count=0.0, excluded=64.0)
    assert numscope.advisor.be_ratio(analysis, C, "mxfp4_e2m1") == 0.0
    assert advise(analysis).choices[0].format == "mxfp4_e2m1"


def test_a_step_without_signal_does_not_make_an_operand_free():
    """A block format samples whole rows; on a sparse gradient one step's rows can all be zero (SQNR +inf,
    seen on MiniLM's masked-LM gradients): the mean over the other steps counts, not 0 noise."""
    from numscope.advisor import operand_noise

    table = {A: {"bf16": GOOD, "mxfp4_e2m1": [metrics(18), metrics(math.inf)]}}  # two steps
    analysis = build(table, {A: 1000}, {})
    assert operand_noise(analysis, A, "mxfp4_e2m1") == pytest.approx(10 ** (-1.8))
    from numscope.advisor.limits import Limits, _option

    option = _option(analysis, A, "mxfp4_e2m1", Limits(max_be_ratio=None), "bf16")  # the noise objective's
    assert option.mean_sqnr == pytest.approx(18.0) and option.noise == pytest.approx(10 ** (-1.8))
    exact = build({A: {"bf16": GOOD, "mxfp4_e2m1": [metrics(math.inf), metrics(math.inf)]}}, {A: 10}, {})
    assert operand_noise(exact, A, "mxfp4_e2m1") == 0.0  # exact at every step
