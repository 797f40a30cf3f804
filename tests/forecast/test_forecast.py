"""The forecast: what a plan does to a trained model (measured), the gap predicted from it, every recipe of
a stack as plans, and ``numscope forecast`` end to end on a user's checkpoint folder, its numscope plan then
trained from the file the forecast wrote."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numscope
import tiny_models
from numscope.analysis import Analysis
from numscope.forecast import PlanEffect, adam_preconditioner, measure_plans, predict, stack_plans
from numscope.forecast.predict import agrees, effective_lr
from numscope.plan import Plan
from numscope.sites import attached

VOCAB, SEQ = 100, 16


def _batches(count: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(5, VOCAB, (4, SEQ), generator=generator)
        labels = torch.where(torch.rand(4, SEQ, generator=generator) < 0.3, ids, torch.full_like(ids, -100))
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.fixture(scope="module")
def trained() -> tuple[torch.nn.Module, dict]:
    """A tiny BERT after 5 AdamW steps, and the optimizer's state."""
    model = tiny_models.tiny_bert(vocab_size=VOCAB, max_position=SEQ, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in _batches(5, seed=2):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer.state_dict()


def test_a_plan_that_changes_no_bit_has_no_effect_and_the_model_is_left_as_it_was(trained) -> None:
    model, state = trained
    parameters = [p for p in model.parameters() if p.requires_grad]
    weights = adam_preconditioner(parameters, state)
    assert all(w.shape == p.shape and bool((w > 0).all()) for w, p in zip(weights, parameters, strict=True))
    data, validation = _batches(2), _batches(2, seed=3)

    def evaluate(m: torch.nn.Module) -> list[float]:
        with torch.no_grad():
            return [float(m(**batch).loss) for batch in validation]

    model.train()
    plans = {"fp32": Plan.uniform("fp32"), "bf16": Plan.uniform("bf16"), "mxfp4": Plan.uniform("mxfp4")}
    effects = measure_plans(model, plans, data, evaluate, weights, clip=1.0)
    assert model.training and not attached(model) and all(p.grad is None for p in parameters)
    assert effects["fp32"].loss_change == (0.0, 0.0) and effects["fp32"].update_noise == (0.0, 0.0)
    assert effects["fp32"].retained == 1.0
    noise = {name: sum(e.update_noise) for name, e in effects.items()}
    assert 0 < noise["bf16"] < noise["mxfp4"]
    assert effects["mxfp4"].retained < effects["bf16"].retained <= 1.0 + 1e-3
    again = PlanEffect.from_dict(json.loads(json.dumps(effects["mxfp4"].to_dict())))
    assert again == effects["mxfp4"]


def test_the_prediction_is_the_forward_loss_plus_the_weighted_update_noise() -> None:
    effect = PlanEffect(loss_change=(0.01, 0.03), update_noise=(100.0, 300.0))
    prediction = predict(effect, lr=1e-3)
    assert prediction.forward == pytest.approx(0.02) and prediction.update == pytest.approx(1e-3 / 4 * 200)
    assert prediction.gap == pytest.approx(0.07)
    assert prediction.low < prediction.gap / 2 and prediction.high > prediction.gap * 2  # and the spread
    assert (
        prediction.beyond(0.01) is True
        and prediction.beyond(0.05) is False
        and prediction.beyond(None) is None
    )
    failed = predict(effect, lr=1e-3, lost="head/dgrad/grad_output in int8: SQNR 0.0 dB at step 0")
    assert math.isinf(failed.gap) and failed.beyond(1.0) is True
    schedule = [1.0, 2.0, 3.0]
    assert (effective_lr(schedule), effective_lr(schedule, "final"), effective_lr(schedule, "peak")) == (
        2.0,
        3.0,
        3.0,
    )
    assert agrees(0.001, -0.002, noise=0.01) and agrees(0.05, 0.03, noise=0.01)
    assert not agrees(0.05, 0.01, noise=0.001) and not agrees(0.05, -0.03, noise=0.01)


def test_every_stack_offers_its_recipes_as_plans_for_the_model() -> None:
    model = tiny_models.tiny_bert(vocab_size=VOCAB, max_position=SEQ, layers=3)
    sites = [(site.name, site.kind) for site in numscope.sites(model, _batches(1)[0])]
    names = {target: [p.name for p in stack_plans(target, sites)] for target in ("te", "torchao", "megatron")}
    assert names["te"] == ["te_current", "te_delayed", "te_block", "te_mxfp8", "te_nvfp4"]
    assert names["torchao"] == [
        "torchao_tensorwise",
        "torchao_rowwise",
        "torchao_rowwise_with_gw_hp",
        "torchao_mxfp8",
    ]
    assert len(names["megatron"]) == 6
    ends = {p.name: p.plan for p in stack_plans("megatron", sites)}["megatron_mxfp8+ends"]
    layer = {name: ends.for_site(name).is_high for name, kind in sites if kind == "linear"}
    assert all(high for name, high in layer.items() if ".layer.0." in name or ".layer.2." in name)
    assert not any(high for name, high in layer.items() if ".layer.1." in name)
    assert all(high for name, high in layer.items() if name.startswith("cls."))  # outside the layers
    with pytest.raises(ValueError, match="unknown stack 'tpu'"):
        stack_plans("tpu", sites)


def test_a_module_the_stacks_kernels_cannot_take_at_its_shape_stays_high_in_its_recipes() -> None:
    model = tiny_models.tiny_bert(vocab_size=VOCAB, max_position=SEQ)
    sites = [(site.name, site.kind) for site in numscope.sites(model, _batches(1)[0])]
    shapes = {
        name: list(module.weight.shape) for name, module in model.named_modules() if hasattr(module, "weight")
    }
    assert shapes["cls.predictions.decoder"][0] == VOCAB  # 100 rows: not a multiple of 16 or 32
    for target in ("te", "torchao", "megatron"):
        for entry in stack_plans(target, sites, shapes):
            decoder = entry.plan.for_site("cls.predictions.decoder")
            assert decoder.is_high, (target, entry.name)
            rule = entry.plan.rule_for("cls.predictions.decoder")
            assert rule is None or "in multiples of" in rule.reasons.get("fprop/input", "")
            query = entry.plan.for_site("bert.encoder.layer.1.attention.self.query")  # 64 x 64: runs
            assert query.is_high == (target == "megatron" and "+ends" in entry.name), (target, entry.name)
    unshaped = {p.name: p.plan for p in stack_plans("te", sites)}["te_current"]
    assert not unshaped.for_site("cls.predictions.decoder").is_high


@pytest.mark.slow
def test_forecast_on_a_checkpoint_folder_then_its_plan_trains(tmp_path: Path) -> None:
    from checkpoints import bert_checkpoint, cli, write_text

    text = write_text(tmp_path / "text.txt", paragraphs=150)
    checkpoint = bert_checkpoint(tmp_path / "ckpt", text)
    run = ["--model", checkpoint, "--text", text, "--seq-len", 32, "--batch-size", 4, "--steps", 12]
    run += ["--eval-every", 6, "--val-blocks", 16, "--cache", tmp_path / "cache", "--no-progress"]
    code, out, err = cli("forecast", *run, "--every", 4, "--out", tmp_path / "fc")
    assert code == 0, err
    for stage in ("1/5", "2/5", "3/5", "4/5", "5/5"):
        assert f"[forecast] {stage}" in err
    for name in ("te_current", "te_delayed", "te_block", "te_mxfp8", "te_nvfp4", "numscope@"):
        assert f"| {name}" in out
    saved = json.loads((tmp_path / "fc" / "te" / "forecast.json").read_text())
    assert len(saved["rows"]) == 7 and len(saved["fp32_val_loss"]) == 2 and saved["fp32_seed_sd"] > 0
    assert saved["measured_blocks"] == 11  # every block of the split: fewer than 2,048 scored tokens
    # its FP32 runs are evaluated after the last step only, and end where a run evaluated every 6 steps does
    for folder in ("fp32", "fp32-seed1"):
        rows = list(csv.DictReader((tmp_path / "fc" / folder / "log.csv").open()))
        assert [row["step"] for row in rows if row["val_loss"]] == ["12"]
    code, _, err = cli("train", *run, "--seed", 1, "--plan", "fp32", "--out", tmp_path / "seed1")
    assert code == 0, err
    plain = list(csv.DictReader((tmp_path / "seed1" / "log.csv").open()))
    assert [row["step"] for row in plain if row["val_loss"]] == ["6", "12"]
    result = json.loads((tmp_path / "seed1" / "result.json").read_text())
    assert result["val_loss"] == saved["fp32_val_loss"][1]
    seconds = saved["seconds"]  # the sensitivity's part of the observed stage is said apart
    assert 0 < seconds["of which sensitivity"] < seconds["fp32 observed"]
    assert "of which sensitivity" in out
    assert (tmp_path / "fc" / "te" / "forecast.png").stat().st_size > 10_000
    # the sensitivity measures the sites a stack converts (its plans choose among them) at weight shapes
    # some stack's kernels take (both dimensions multiples of 16 at least), and only those
    analysis = Analysis.load(tmp_path / "fc" / "fp32" / "analysis")
    kinds = dict(analysis.meta["site_kinds"])
    shapes = analysis.weight_shapes()
    measured = {key[0] for key in analysis.sensitivity.results}
    linear = {name for name, kind in kinds.items() if kind == "linear"}
    assert measured == {name for name in linear if all(d % 16 == 0 for d in shapes[name])}
    (head,) = linear - measured  # the vocabulary head: its rows (the words) are no multiple of 16
    assert head.endswith("decoder") and shapes[head][0] % 16
    left = {kind for name, kind in kinds.items() if name not in linear}
    assert left and left.isdisjoint(measured)  # the attention products (sdpa here) are not measured
    ours = [row for row in saved["rows"] if row["numscope"]]
    assert [row["bits"] <= budget + 1e-6 for row, budget in zip(ours, saved["budgets"], strict=True)] == [
        True
    ] * 2
    for row in saved["rows"]:
        assert row["lost"] or row["low"] <= row["gap"] <= row["high"]
        Plan.load(row["plan"])  # every plan it names is a file train takes
    assert "Around the quantized GEMMs, and in the GEMMs kept high: BF16" in out
    inside = [row["name"] for row in saved["rows"] if not row["lost"] and not row["beyond_noise"]]
    # 12 steps of a tiny model: every predicted gap lies far inside the seed noise, and the output says
    # that their order is not a prediction, in the output and in forecast.md
    assert inside == [row["name"] for row in saved["rows"]]
    said = f"7 of 7 plans ({', '.join(inside[:4])} and 3 more) are predicted inside 2 sd of FP32's seed noise"
    assert said in out and said in (tmp_path / "fc" / "te" / "forecast.md").read_text()
    assert "their order in the table is not a prediction" in out
    te_current = Plan.load(next(r["plan"] for r in saved["rows"] if r["name"] == "te_current"))
    scores = te_current.for_site("bert.encoder.layer.0.attention.self.scores")
    assert {spec.format for spec in scores.operands.values()} == {"bf16"} and len(scores.operands) == 6
    code, again, _ = cli("forecast", *run, "--every", 4, "--out", tmp_path / "fc")  # reused, not retrained
    assert code == 0 and again.split("took")[0] == out.split("took")[0]
    written = {p: p.read_bytes() for p in (tmp_path / "fc" / "te").rglob("*") if p.is_file()}
    code, fp32, _ = cli("forecast", *run, "--every", 4, "--around", "fp32", "--out", tmp_path / "fc")
    assert code == 0 and "kept high: FP32" in fp32
    around = {
        r["name"]: r for r in json.loads((tmp_path / "fc" / "te-fp32" / "forecast.json").read_text())["rows"]
    }
    assert Plan.load(around["te_current"]["plan"]).for_site("bert.encoder.layer.0.attention.self.scores") == (
        Plan.recipe("te_current").for_site("bert.encoder.layer.0.attention.self.scores")
    )
    for row in saved["rows"]:
        if not row["numscope"]:  # the same recipe, its high parts counted at 32 bits instead of 16
            assert around[row["name"]]["bits"] > row["bits"] + 1
    ours = [
        row
        for row in json.loads((tmp_path / "fc" / "te-fp32" / "forecast.json").read_text())["rows"]
        if row["numscope"]
    ]
    # other stacks into the same folder: the FP32 runs are shared, no forecast's files are overwritten
    runs = {p: p.stat().st_mtime_ns for p in (tmp_path / "fc").glob("fp32*/*") if p.is_file()}
    code, stacks, err = cli(
        "forecast", *run, "--every", 4, "--stacks", "torchao,megatron", "--out", tmp_path / "fc"
    )
    assert code == 0, err
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "fc").glob("fp32*/*") if p.is_file()} == runs
    assert {p: p.read_bytes() for p in (tmp_path / "fc" / "te").rglob("*") if p.is_file()} == written
    assert "torchao: its recipes" in stacks and "megatron: its recipes" in stacks
    assert err.count("1/5 FP32, observed (seed 0, 12 steps): finished before, reused") == 2
    for stack, recipe in (("torchao", "torchao_rowwise"), ("megatron", "megatron_")):
        rows = json.loads((tmp_path / "fc" / stack / "forecast.json").read_text())["rows"]
        assert any(row["name"].startswith(recipe) for row in rows) and f"| {recipe}" in stacks
        assert all(Path(row["plan"]).parent == tmp_path / "fc" / stack / "plans" for row in rows)
        assert (
            json.loads((tmp_path / "fc" / stack / "forecast.json").read_text())["fp32_val_loss"]
            == saved["fp32_val_loss"]
        )
    code, out, err = cli("train", *run, "--plan", ours[0]["plan"], "--out", tmp_path / "planned")
    assert code == 0, err
    assert json.loads((tmp_path / "planned" / "result.json").read_text())["avg_bits"] == pytest.approx(
        ours[0]["bits"], rel=0.02
    )


def test_a_bad_forecast_setting_is_named_as_the_api_names_it_and_on_the_command_line_by_its_flag(
    tmp_path: Path,
) -> None:
    from checkpoints import cli, write_text
    from numscope.errors import SettingsError
    from numscope.forecast import ForecastSettings

    for given, setting in (
        ({"target": "jax"}, "ForecastSettings.target"),
        ({"seeds": 0}, "ForecastSettings.seeds"),
        ({"val_blocks": 0}, "ForecastSettings.val_blocks"),
        ({"around": "fp16"}, "ForecastSettings.around"),
    ):
        with pytest.raises(SettingsError) as raised:
            ForecastSettings(**given)
        assert raised.value.setting == setting and "--" not in str(raised.value)
    # more gradient batches than the training split holds: said before any run is trained
    text = write_text(tmp_path / "text.txt", paragraphs=30)
    run = ["--model", "tiny-bert", "--text", text, "--seq-len", 32, "--batch-size", 8, "--steps", 2]
    code, _, err = cli(
        "forecast", *run, "--batches", 999, "--cache", tmp_path / "cache", "--out", tmp_path / "fc"
    )
    assert code != 0 and "--batches: 999 training batches asked; the training split holds" in err
    assert "ForecastSettings" not in err and not (tmp_path / "fc" / "fp32").exists()
    code, _, err = cli("forecast", *run, "--stacks", "te,jax", "--out", tmp_path / "fc")
    assert code == 2 and "argument --stacks: 'te,jax': a training stack (te, torchao, megatron)" in err


def test_a_plan_that_flushes_the_heads_gradient_is_said_to_fail() -> None:
    """Per-tensor INT8 on an MLM head's output gradient over a 2,000-token vocabulary: the target tokens'
    large entries set the scale, every other entry flushes to zero (the failure the noise model cannot
    describe); FP8 and MXFP4 keep it."""
    from numscope.forecast.predict import signal_lost

    model = tiny_models.tiny_bert(vocab_size=2000, max_position=SEQ, dropout=0.0)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 2000, (8, SEQ), generator=generator)
    labels = torch.where(torch.rand(8, SEQ, generator=generator) < 0.3, ids, torch.full_like(ids, -100))
    with numscope.observe(model, candidates=["int8", "fp8_e4m3", "mxfp4_e2m1"]) as observer:
        model(input_ids=ids, labels=labels).loss.backward()
        observer.step()
    analysis = observer.analysis()
    lost = signal_lost(analysis, Plan.named("int8"))
    assert lost.startswith("cls.predictions.decoder/") and "nonzeros flushed to zero at step 0" in lost
    assert signal_lost(analysis, Plan.named("fp8")) == "" and signal_lost(analysis, Plan.named("mxfp4")) == ""
    assert signal_lost(analysis, Plan.named("int8"), flushed=100.1) == ""  # its SQNR alone does not say


def test_the_forward_effect_is_measured_on_about_2048_scored_tokens_unless_asked() -> None:
    from numscope.forecast.run import MEASURED_TOKENS, measured_blocks

    assert MEASURED_TOKENS == 2048
    assert measured_blocks(None, 128, "mlm", 500) == 107  # 15% of 128 tokens are scored: 19.2 a block
    assert measured_blocks(None, 128, "clm", 500) == 16
    assert measured_blocks(None, 32, "mlm", 100) == 100  # the split holds fewer
    assert measured_blocks(5, 128, "mlm", 500) == 5
    assert measured_blocks(50, 128, "mlm", 20) == 20


def test_the_update_noise_is_summed_a_parameter_at_a_time_as_over_the_flat_gradient() -> None:
    """_error_powers keeps one parameter's temporaries at a time; its sums are the flat float64 ones, and a
    non-finite error makes the plan's noise infinite (its finite errors still summed)."""
    from numscope.forecast.measure import _error_powers, _powers

    generator = torch.Generator().manual_seed(0)
    sizes = [7, 300, 1, 64]
    bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    reference = torch.randn(sum(sizes), generator=generator)
    grad = reference + 1e-3 * torch.randn(sum(sizes), generator=generator)
    weight = [torch.rand(n, generator=generator) * 100 for n in sizes]
    flat = torch.cat(weight).double()
    error = (grad - reference).double()
    power, error_power, finite = _error_powers(grad, reference, weight, bounds)
    assert finite
    assert power == pytest.approx(float((flat * error.square()).sum()), rel=1e-12)
    assert error_power == pytest.approx(float(error.square().sum()), rel=1e-12)
    # the clipping norm measure_plans takes from the per-tensor powers
    assert math.sqrt(sum(_powers(reference, bounds))) == pytest.approx(
        float(reference.double().norm()), rel=1e-12
    )
    grad[10] = math.inf
    power_inf, _, finite = _error_powers(grad, reference, weight, bounds)
    assert not finite
    kept = error.clone()
    kept[10] = 0.0
    assert power_inf == pytest.approx(float((flat * kept.square()).sum()), rel=1e-12)
