"""Sensitivity on a real tiny BERT: one site (or operand) quantized at a time, loss and gradient vs FP32."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import BertForMaskedLM

import numscope
import tiny_models
from numscope.analysis import ALL, Analysis, Sensitivity
from numscope.plan import Plan, Rule, SiteSpec
from numscope.sensitivity import sensitivity
from numscope.sites import attached
from numscope.vocab import OPERANDS

BATCH, SEQ, VOCAB = 4, 16, 100
CANDIDATES = ("fp32", "bf16", "mxfp4_e2m1")


def tiny_bert() -> BertForMaskedLM:
    return tiny_models.tiny_bert(vocab_size=VOCAB, max_position=SEQ)


def batches(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
        labels = torch.where(
            torch.rand(BATCH, SEQ, generator=generator) < 0.3, ids, torch.full_like(ids, -100)
        )
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.fixture(scope="module")
def measured() -> tuple[BertForMaskedLM, list[dict[str, torch.Tensor]], Sensitivity]:
    model, data = tiny_bert(), batches(2)
    return model, data, sensitivity(model, data, candidates=CANDIDATES)


def loss_and_grad(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return float(loss.detach()), grad.double()


def test_every_site_is_a_target_and_a_lossless_format_changes_nothing(measured):
    model, _, result = measured
    names = [site.name for site in numscope.sites(model, batches(1)[0])]
    assert {key[0] for key in result.results} == set(names) and len(names) == 18
    assert all(key[1:] == (ALL, ALL) for key in result.results)
    for per_candidate in result.results.values():
        lossless = per_candidate["fp32"]
        assert lossless["loss_change"] == 0.0 and lossless["grad_rel_error"] == 0.0
        assert lossless["grad_cosine_min"] == pytest.approx(1.0, abs=1e-12)


def test_numbers_equal_a_hand_run_of_the_converted_model(measured):
    model, data, result = measured
    site = "bert.encoder.layer.1.intermediate.dense"
    reference = [loss_and_grad(model.eval(), batch) for batch in data]
    numscope.convert(model, Plan(SiteSpec(), (Rule(site, SiteSpec.uniform("mxfp4_e2m1")),)))
    quantized = [loss_and_grad(model, batch) for batch in data]
    numscope.unconvert(model)
    model.train()
    found = result.results[(site, ALL, ALL)]["mxfp4_e2m1"]
    mean = sum(loss for loss, _ in quantized) / 2
    reference_mean = sum(loss for loss, _ in reference) / 2
    assert found["loss"] == mean and found["loss_change"] == mean - reference_mean
    assert found["loss_change%"] == pytest.approx(100 * (mean - reference_mean) / reference_mean, rel=1e-12)
    cosines = [
        float(g @ r / (g.norm() * r.norm())) for (_, g), (_, r) in zip(quantized, reference, strict=True)
    ]
    assert found["grad_cosine_min"] == pytest.approx(min(cosines), rel=1e-12)
    assert result.reference_loss == [loss for loss, _ in reference]


def test_fewer_bits_move_the_gradient_more(measured):
    _, _, result = measured
    away = {c: sum(1 - r[c]["grad_cosine"] for r in result.results.values()) for c in CANDIDATES}
    assert away["fp32"] < 1e-12 < away["bf16"] < away["mxfp4_e2m1"]
    assert result.table()[0]["candidate"] != "fp32"  # the most harmful target is a lossy one


def test_the_model_is_left_as_it_was():
    model, data = tiny_bert(), batches(1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    marker = torch.full_like(model.cls.predictions.transform.dense.weight, 7.0)
    model.cls.predictions.transform.dense.weight.grad = marker
    model.train()
    sensitivity(model, data, candidates=["bf16"], sites=["cls.*"])
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    assert model.cls.predictions.transform.dense.weight.grad is marker
    assert model.bert.embeddings.word_embeddings.weight.grad is None  # tied to the decoder's
    assert model.training and all(m.training for m in model.modules())
    assert numscope.sites.attached(model) == []


def test_operand_granularity_and_the_plan_label():
    model, data = tiny_bert(), batches(1)
    site = "bert.encoder.layer.0.attention.self.query"
    result = sensitivity(
        model,
        data,
        candidates=["fp8_e4m3", "fp8_e5m2"],
        plan=Plan.uniform("fp8"),
        sites=[site],
        granularity="operand",
    )
    expected = {(site, gemm, operand) for gemm, operands in OPERANDS.items() for operand in operands}
    assert set(result.results) == expected and result.granularity == "operand"
    # the fp8 plan is E4M3 for fprop and E5M2 for grad_output: its numbers are those of that candidate
    assert (
        result.results[(site, "fprop", "input")]["plan"]
        == result.results[(site, "fprop", "input")]["fp8_e4m3"]
    )
    dgrad = result.results[(site, "dgrad", "grad_output")]
    assert dgrad["plan"] == dgrad["fp8_e5m2"] != dgrad["fp8_e4m3"]
    assert (
        result.lookup((site, "wgrad", "input"), "fp8_e5m2")
        is result.results[(site, "wgrad", "input")]["fp8_e5m2"]
    )
    assert result.lookup(("elsewhere", "fprop", "input"), "fp8_e5m2") is None


def test_a_custom_loss_and_train_mode_give_repeatable_numbers():
    model, data = tiny_bert(), batches(1)

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        return model(input_ids=batch["input_ids"]).logits.float().square().mean()

    first = sensitivity(model, data, candidates=["fp32"], loss_fn=loss_fn, sites=["cls.*"], train_mode=True)
    # dropout is on, but every pass of a batch starts from the same random state: fp32 changes nothing
    for per_candidate in first.results.values():
        assert per_candidate["fp32"]["loss_change"] == 0.0


def test_saved_with_the_analysis_and_alone(measured, tmp_path):
    _, _, result = measured
    analysis = Analysis(candidates=("bf16",), sensitivity=result)
    analysis.save(tmp_path / "analysis")
    assert Analysis.load(tmp_path / "analysis").sensitivity == result
    path = result.save(tmp_path / "alone")
    assert path.name == "sensitivity.json" and Sensitivity.load(tmp_path / "alone") == result
    flat = result.flat()
    assert flat["cls.predictions.decoder/*/*/sensitivity/bf16/loss_change%"] == pytest.approx(
        result.results[("cls.predictions.decoder", ALL, ALL)]["bf16"]["loss_change%"]
    )


def test_bad_arguments_are_named():
    model, data = tiny_bert(), batches(1)
    with pytest.raises(ValueError, match="unknown format 'fp8_e4m4'"):
        sensitivity(model, data, candidates=["fp8_e4m4"])
    with pytest.raises(ValueError, match="at least one candidate format or a plan"):
        sensitivity(model, data)
    with pytest.raises(ValueError, match="at least one batch"):
        sensitivity(model, [], candidates=["bf16"])
    with pytest.raises(ValueError, match="unknown granularity 'gemm'; allowed: site, operand"):
        sensitivity(model, data, candidates=["bf16"], granularity="gemm")
    with pytest.raises(ValueError, match=r"sites pattern 'nope\.\*' matches no site; sites: bert\.encoder"):
        sensitivity(model, data, candidates=["bf16"], sites=["nope.*"])
    with pytest.raises(ValueError, match="has no scalar loss; pass loss_fn="):
        sensitivity(model, [{"input_ids": data[0]["input_ids"]}], candidates=["bf16"])
    numscope.convert(model, Plan.uniform("bf16"))
    with pytest.raises(ValueError, match=r"without numscope handlers attached.*numscope\.convert"):
        sensitivity(model, data, candidates=["bf16"])
    numscope.unconvert(model)
    assert math.isfinite(
        sensitivity(model, data, candidates=["bf16"], sites="cls.predictions.decoder").results[
            ("cls.predictions.decoder", ALL, ALL)
        ]["bf16"]["loss"]
    )


def test_the_callers_random_streams_are_left_as_they_were():
    # train mode reseeds torch (CPU and every CUDA device) for each batch; the caller's streams, on the CPU
    # and on the GPU, continue afterwards exactly where they were
    model, data = tiny_bert(), batches(2)
    torch.manual_seed(123)
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    sensitivity(model, data, candidates=["bf16"], sites=["cls.*"], train_mode=True)
    assert torch.equal(torch.get_rng_state(), cpu)
    if torch.cuda.is_available():
        after = torch.cuda.get_rng_state_all()
        assert len(after) == len(cuda) and all(torch.equal(a, b) for a, b in zip(after, cuda, strict=True))


def test_progress_is_reported_once_per_measurement_up_to_the_total() -> None:
    model, data = tiny_bert(), batches(1)
    calls: list[tuple[int, int]] = []
    result = sensitivity(
        model,
        data,
        candidates=("bf16", "fp8_e4m3"),
        sites=["*.query"],
        on_progress=lambda *a: calls.append(a),
    )
    total = len(result.results) * 2
    assert calls == [(done, total) for done in range(1, total + 1)] and total > 0


def test_checkpoints_combine_each_weighing_alike():
    """Two checkpoints of a real model (one trained a few steps further): each operand's squared gradient
    error divided by its checkpoint's total in the normalising format, summed; every other metric is the
    first checkpoint's; targets must match."""
    from numscope.sensitivity import combine_sensitivities

    model, data = tiny_bert(), batches(2)
    sites = ["bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0.output.dense"]
    first = sensitivity(model, data, candidates=("bf16", "mxfp4_e2m1"), granularity="operand", sites=sites)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in data * 3:
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
    later = sensitivity(model, data, candidates=("bf16", "mxfp4_e2m1"), granularity="operand", sites=sites)
    combined = combine_sensitivities([first, later], "mxfp4_e2m1")
    assert combined.meta["checkpoints"] == 2 and combined.meta["normalized_by"] == "mxfp4_e2m1"

    def total(result: Sensitivity) -> float:
        return sum(m["mxfp4_e2m1"]["grad_rel_error"] ** 2 for m in result.results.values())

    for key, by_label in combined.results.items():
        for label, metrics in by_label.items():
            a = first.results[key][label]["grad_rel_error"] ** 2 / total(first)
            b = later.results[key][label]["grad_rel_error"] ** 2 / total(later)
            assert metrics["grad_rel_error"] == pytest.approx(math.sqrt(a + b), rel=1e-12)
            assert metrics["loss_change"] == first.results[key][label]["loss_change"]
    assert total(combined) == pytest.approx(2.0)  # each checkpoint adds 1 in the normalising format
    with pytest.raises(ValueError, match="'fp8_e4m3' was not measured"):
        combine_sensitivities([first, later], "fp8_e4m3")
    fewer = sensitivity(model, data, candidates=("bf16",), granularity="operand", sites=sites[:1])
    with pytest.raises(ValueError, match="same targets"):
        combine_sensitivities([first, fewer], "bf16")


# -- the local method ---------------------------------------------------------------------------------------


def test_the_local_method_reads_every_operand_from_a_few_passes_and_matches_one_at_a_time():
    """Weight-gradient operands exactly (their GEMM's output error is the gradient's error); the others
    through their group's measured gain, ranked as one at a time ranks them; the model left as it was."""
    from scipy.stats import spearmanr

    from numscope.sensitivity import local_sensitivity

    model, data = tiny_bert(), batches(2)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.train()
    local = local_sensitivity(model, data, candidates=["bf16", "mxfp4_e2m1"])
    assert model.training and not attached(model)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    alone = sensitivity(model, data, candidates=["bf16", "mxfp4_e2m1"], granularity="operand")
    assert set(local.results) == set(alone.results) and local.granularity == "operand"
    assert local.meta["method"] == "local" and local.meta["gain_format"] == "mxfp4_e2m1"
    kinds = {site.name: site.kind for site in numscope.sites(model, data[0])}
    pairs = []
    for key, per in alone.results.items():
        for label in ("bf16", "mxfp4_e2m1"):
            estimate, truth = local.results[key][label]["grad_rel_error"], per[label]["grad_rel_error"]
            pairs.append((truth, estimate))
            if key[1] == "wgrad" and kinds[key[0]] == "linear":  # exact but for the mean over batches:
                assert estimate == pytest.approx(truth, rel=0.05), key  # of ratios there, of powers here
    assert spearmanr(*zip(*pairs, strict=True)).statistic > 0.85


def test_the_local_methods_passes_do_not_grow_with_the_operands():
    """Twice the layers, twice the operands: the same passes (a gain per role in the layers and depth bin)."""
    from numscope.sensitivity import local_sensitivity

    counts = {}
    for layers in (2, 4):
        model = tiny_models.tiny_bert(vocab_size=VOCAB, max_position=SEQ, layers=layers)
        forwards: list[int] = []
        hook = model.register_forward_hook(lambda *_, seen=forwards: seen.append(1))
        result = local_sensitivity(model, batches(2), candidates=["mxfp4_e2m1"], depth_bins=2)
        hook.remove()
        counts[layers] = (len(result.results), len(forwards), result.meta["gain_passes"])
    assert counts[4][0] > 1.7 * counts[2][0]
    assert counts[4][1] == counts[2][1] and counts[4][2] == counts[2][2]
    # 2 passes per batch, one per group with a gain to measure (on one batch), one discovery forward
    assert counts[2][1] == 2 * 2 + counts[2][2] + 1


def test_the_local_method_measures_convolutions_one_at_a_time():
    from numscope.sensitivity import local_sensitivity

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    data = [(torch.randn(2, 3, 8, 8), torch.tensor([1, 3]))]

    def loss_fn(m: nn.Module, batch) -> torch.Tensor:
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    result = local_sensitivity(model, data, candidates=["fp8_e4m3"], loss_fn=loss_fn)
    assert result.meta["one_at_a_time_sites"] == ["0"]
    assert {key[0] for key in result.results} == {"0", "2"} and len(result.results) == 12
    with pytest.raises(ValueError, match="gain_format 'nvfp4' is not among the candidates"):
        local_sensitivity(model, data, candidates=["fp8_e4m3"], loss_fn=loss_fn, gain_format="nvfp4")
