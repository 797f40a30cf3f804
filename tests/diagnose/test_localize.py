"""Localizing a plan's loss gap to its sites: the attribution's statistics, and the whole verb on a planted
fault and an FP32 control."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from numscope.diagnose import Attribution, LocalizeError, LocalizeSettings
from numscope.diagnose.localize import _judge

FAULT = """numscope_plan: 1
default:
  all: fp8_e4m3
rules:
- match: cls.predictions.decoder
  fprop: {input: fp8_e4m3, weight: fp8_e4m3}
  dgrad: {grad_output: {format: int8, scaling: none}, weight: fp8_e4m3}
  wgrad: {grad_output: {format: int8, scaling: none}, input: fp8_e4m3}
"""
"""FP8 everywhere, and the MLM decoder's output gradient in INT8 without a scale: every entry (all far below
0.5) rounds to zero, so no gradient leaves the head."""


def test_an_effect_is_named_when_its_interval_clears_zero_and_it_exceeds_fp32s_seed_noise() -> None:
    clear = Attribution("a", [0.10, 0.12, 0.11], local_error=0.5)
    small = Attribution("b", [0.010, 0.012, 0.011], local_error=0.5)  # real, but within FP32's noise
    straddles = Attribution("c", [0.30, -0.10, 0.20], local_error=0.5)
    alone = Attribution("d", [0.5], local_error=0.5)
    _judge([clear, small, straddles, alone], noise=0.02)
    assert [a.named for a in (clear, small, straddles, alone)] == [True, False, False, False]
    assert [a.measurable for a in (clear, small, straddles, alone)] == [True, True, False, False]
    assert clear.mean == pytest.approx(0.11) and clear.sd == pytest.approx(0.01)
    low, high = clear.interval
    assert (low, high) == pytest.approx((0.11 - 4.303 * 0.01 / 3**0.5, 0.11 + 4.303 * 0.01 / 3**0.5))
    assert alone.interval is None and alone.sd is None
    _judge([clear], noise=None)  # one FP32 seed: no noise to judge against
    assert not clear.named
    with pytest.raises(LocalizeError, match="candidates must be an integer >= 0"):
        LocalizeSettings(candidates=-1)


def _text(tmp_path: Path) -> Path:
    from numscope.run.corpus import load_corpus

    path = tmp_path / "text.txt"
    path.write_text("\n\n".join(load_corpus()[:1500]), encoding="utf-8")
    return path


@pytest.mark.slow
def test_a_planted_fault_is_named_and_an_fp32_control_names_nothing(tmp_path: Path) -> None:
    from checkpoints import cli

    text = _text(tmp_path)
    (tmp_path / "fault.yaml").write_text(FAULT)
    run = ["--model", "tiny-bert", "--text", text, "--seq-len", 32, "--batch-size", 8, "--steps", 120]
    run += ["--warmup-steps", 5, "--eval-every", 120, "--val-blocks", 16, "--vocab-size", 1000]
    run += ["--cache", tmp_path / "cache", "--no-progress", "--top-sites", 2, "--drift-every", 10]
    code, out, err = cli("localize", *run, "--plan", tmp_path / "fault.yaml", "--out", tmp_path / "fault")
    assert code == 0, err
    assert "[localize] 1/2" in err and "run 12/12" in err
    saved = json.loads((tmp_path / "fault" / "localize.json").read_text())
    assert saved["named"] == ["cls.predictions.decoder"]
    first = saved["attributions"][0]
    assert first["site"] == "cls.predictions.decoder" and first["interval"][0] > saved["fp32_seed_sd"]
    assert saved["drift"]["steps"][:2] == [10, 20] and saved["drift"]["steps"][-1] == 120
    ranked = saved["drift"]["operand_local"]["cls.predictions.decoder"]
    assert ranked["grad_output"] == pytest.approx(1.0)  # every entry flushed
    assert saved["cost_fp32_runs"] > 12  # 12 runs and the lockstep, each about one FP32 run or more
    assert "Beyond the noise: cls.predictions.decoder." in out
    assert (tmp_path / "fault" / "localize.png").stat().st_size > 20_000
    code, again, _ = cli("localize", *run, "--plan", tmp_path / "fault.yaml", "--out", tmp_path / "fault")
    assert code == 0 and again == out  # every run and the lockstep reused, the cost as first measured

    code, out, err = cli("localize", *run, "--plan", "fp32", "--out", tmp_path / "control")
    assert code == 0, err
    control = json.loads((tmp_path / "control" / "localize.json").read_text())
    assert control["named"] == [] and control["gaps"] == [0.0, 0.0, 0.0]
    drift = control["drift"]["figures"]
    assert all(
        v == 0.0 for figure in ("input", "grad_output", "weight") for row in drift[figure] for v in row
    )
    assert "The plan quantizes no site" in out


@pytest.mark.slow
def test_both_verbs_start_from_a_checkpoint_folders_weights(tmp_path: Path) -> None:
    """The model a user brings: the lockstep's two models and every run start from the folder's weights
    (the first step's weight drift is zero and its losses equal a plain forward of the checkpoint)."""
    import torch
    from transformers import BertForMaskedLM

    from checkpoints import bert_checkpoint, cli, write_text
    from numscope.run import DataSettings, TrainConfig, runner
    from numscope.run.loop import _Batches
    from numscope.run.objectives import get_objective

    text = write_text(tmp_path / "text.txt", paragraphs=150)
    checkpoint = bert_checkpoint(tmp_path / "ckpt", text)
    run = ["--model", checkpoint, "--text", text, "--seq-len", 32, "--batch-size", 4, "--steps", 6]
    run += ["--eval-every", 6, "--val-blocks", 8, "--cache", tmp_path / "cache", "--no-progress"]
    code, out, err = cli(
        "localize", *run, "--plan", "fp8", "--seeds", 2, "--top-sites", 1, "--out", tmp_path / "l"
    )
    assert code == 0, err
    saved = json.loads((tmp_path / "l" / "localize.json").read_text())
    first = dict(zip(saved["drift"]["sites"], saved["drift"]["figures"]["weight"][0], strict=True))
    linear = [
        site for site in first if not site.endswith((".scores", ".context"))
    ]  # weights, not activations
    assert len(linear) == 8 and all(first[site] == 0.0 for site in linear)
    data = DataSettings(text=(str(text),), seq_len=32, val_blocks=8, cache_dir=str(tmp_path / "cache"))
    config = TrainConfig(steps=6, batch_size=4, eval_every=6)
    prepared, factory, objective = runner.prepare(str(checkpoint), data, config)
    batch = _Batches(prepared, config, get_objective(objective).for_training(config.mask_probability)).at(0)
    torch.manual_seed(0)
    model = factory()  # as the lockstep builds its models: the seed, then the factory (dropout drawn after)
    pretrained = BertForMaskedLM.from_pretrained(checkpoint).state_dict()
    assert all(torch.equal(value, pretrained[name]) for name, value in model.state_dict().items())
    assert saved["drift"]["loss_reference"][0] == float(model.train()(**batch).loss.detach())
    code, out, err = cli("band", *run, "--plan", "fp8", "--seeds", 2, "--out", tmp_path / "b")
    assert code == 0, err
    assert "fp8 against FP32 over 2 seeds" in out


FAULTS = Path(__file__).resolve().parents[2] / "examples" / "plans" / "faults"
#: each planted fault of docs/results/diagnose.md: the one site it plants at
PLANTED = {
    "delayed_amax_too_small.yaml": "bert.encoder.layer.1.output.dense",
    "e5m2_unscaled_gradient.yaml": "bert.encoder.layer.1.intermediate.dense",
    "e5m2_unscaled_decoder_gradient.yaml": "cls.predictions.decoder",
    "nvfp4_decoder_no_transform.yaml": "cls.predictions.decoder",
    "nvfp4_head_transform_no_rht.yaml": "cls.predictions.transform.dense",
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_each_documented_fault_plan_departs_from_its_base_at_its_site_alone(name: str) -> None:
    """The fault files the docs localize load as plans, and each differs from its default at the one site
    its docs name (so what the docs call the planted site is the only place the plan departs)."""
    from numscope.plan import Plan

    assert sorted(p.name for p in FAULTS.glob("*.yaml")) == sorted(PLANTED)
    plan = Plan.load(FAULTS / name)
    sites = ["bert.encoder.layer.0.output.dense", *set(PLANTED.values())]
    departs = [site for site in sites if plan.for_site(site) != plan.for_site("elsewhere")]
    assert departs == [PLANTED[name]]
