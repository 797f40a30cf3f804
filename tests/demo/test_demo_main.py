"""The demo's orchestration: resuming after Ctrl-C, the observer schedule, fp16 underflow, the claims."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from numscope.analysis import Analysis
from numscope.demo import claims as demo_claims
from numscope.demo import main as demo_main
from numscope.demo.main import DemoConfig, fp16_underflow_by_site, run_demo, training_observer
from numscope.metrics.stats import Log2Histogram
from numscope.run import loop as run_loop
from numscope.run.config import TrainConfig
from numscope.run.model import make_bert_mlm

TINY = DemoConfig(
    train=TrainConfig(steps=4, batch_size=4, lr=2e-3, warmup_steps=2, eval_every=2, checkpoint_every=2),
    hidden=16,
    layers=1,
    heads=2,
    intermediate=32,
    seq_len=16,
    vocab_size=300,
    val_blocks=8,
    observe_every=2,
    candidates=("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "mxfp6_e3m2", "mxfp4_e2m1"),
    fast=False,
    jobs=1,
)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    path = tmp_path_factory.mktemp("text") / "wiki.txt"
    path.write_text("\n\n".join(corpus[:160]), encoding="utf-8")
    return path


def test_an_interrupted_demo_resumes_bit_exactly_and_keeps_finished_runs(
    tmp_path: Path, text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NUMSCOPE_CACHE", str(tmp_path / "cache"))
    real_train_run = run_loop.train_run

    def interrupted(spec, *args, on_step, **kwargs):  # Ctrl-C in a run, one step after its checkpoint
        def stop(step: int, loss: float) -> None:
            on_step(step, loss)
            if spec.name == "fp16+scaling" and step == 3:
                raise KeyboardInterrupt

        return real_train_run(spec, *args, on_step=stop, **kwargs)

    folder = tmp_path / "demo"
    monkeypatch.setattr(run_loop, "train_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_demo(folder, TINY, [text_file], log=lambda _: None, progress=False)
    finished = {p: p.stat().st_mtime_ns for p in folder.glob("runs/*/result.json")}
    assert {p.parent.name for p in finished} == {"fp32", "recommended", "bf16"}
    assert (folder / "runs" / "fp16+scaling" / "checkpoint.pt").is_file()
    assert not (folder / "runs" / "fp16+scaling" / "result.json").exists()

    monkeypatch.setattr(run_loop, "train_run", real_train_run)
    summary = run_demo(folder, TINY, [text_file], log=lambda _: None, progress=False)
    assert all(path.stat().st_mtime_ns == mtime for path, mtime in finished.items()), "finished runs rerun"
    assert [r["name"] for r in summary["runs"]] == RUN_NAMES
    assert (folder / "report.html").is_file() and len(summary["claims"]) == 7
    _assert_final_models(folder, summary, RUN_NAMES)

    # the resumed run equals one trained without interruption: every evaluation and every logged loss
    data = demo_main.prepare_demo_data(TINY, [text_file])
    spec = next(spec for spec in demo_main.BASELINES if spec.name == "fp16+scaling")
    whole = real_train_run(spec, demo_main.model_config(TINY, data), TINY.train, data, tmp_path / "whole")
    resumed = json.loads((folder / "runs" / "fp16+scaling" / "result.json").read_text())
    assert resumed["curve"] == whole.curve
    losses = [
        [row.split(",")[2] for row in (path / "log.csv").read_text().splitlines()[1:]]
        for path in (folder / "runs" / "fp16+scaling", tmp_path / "whole")
    ]
    assert losses[0] == losses[1] and len(losses[0]) == TINY.train.steps


RUN_NAMES = [
    "fp32",
    "recommended",
    "last-layers",  # the plan study's best heuristic at the plan's budget, for the same target
    "bf16",
    "fp16+scaling",
    "e5m2-grads",
    "e5m2-grads+scaling",
    "fp8",
    "mxfp8",
    "int8",
    "mxfp4",
    "fp32-seed1",
    "fp32-seed2",
    "recommended-seed1",
    "recommended-seed2",
    "last-layers-seed1",
    "last-layers-seed2",
]


def _assert_final_models(folder: Path, summary: dict, names: list[str]) -> None:
    """Every named run keeps its final model (a BertForMaskedLM state dict) and drops its checkpoint."""
    from numscope.train.checkpoint import load_checkpoint

    rows = {row["name"]: row for row in summary["runs"]}
    for name in names:
        run = folder / "runs" / name
        assert not (run / "checkpoint.pt").exists(), name
        assert rows[name]["model"] == str(run / demo_main.MODEL_FILE), name
        state = load_checkpoint(run / demo_main.MODEL_FILE)["model"]
        assert state["bert.embeddings.word_embeddings.weight"].shape[1] == TINY.hidden, name


def test_the_baselines_include_the_issues_uniform_formats_with_per_tensor_int8() -> None:
    from numscope.formats.scaling import default_scaling
    from numscope.formats.spec import get_format

    specs = {spec.name: spec for spec in demo_main.BASELINES}
    assert [spec.name for spec in demo_main.BASELINES] == RUN_NAMES[3:-6]
    assert all(spec.description for spec in (*demo_main.BASELINES, demo_main.REFERENCE))
    for name, fmt, scaling in (("mxfp8", "mxfp8_e4m3", "block"), ("int8", "int8", "tensor")):
        plan = specs[name].load_plan()
        assert not plan.rules
        for gemm in ("fprop", "dgrad", "wgrad"):
            for operand in {"fprop": ("input", "weight"), "dgrad": ("grad_output", "weight")}.get(
                gemm, ("grad_output", "input")
            ):
                spec = plan.default.operand(gemm, operand)
                effective = spec.scaling or default_scaling(get_format(spec.format))
                assert spec.format == fmt and effective.kind == scaling, (name, gemm, operand)


def test_a_demo_folder_of_an_earlier_demo_keeps_its_runs_and_adds_the_new_ones(
    tmp_path: Path, text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder made before the mxfp8/int8 baselines and model.pt existed: its finished runs are reused as
    they are (and said to lack a model), the new baselines run and keep theirs."""
    monkeypatch.setenv("NUMSCOPE_CACHE", str(tmp_path / "cache"))
    real_train_run = run_loop.train_run
    folder = tmp_path / "demo"
    # the demo of that time: the noise objective's plan, no heuristic beside it (its fp32 run kept no model
    # to measure a sensitivity on)
    config = replace(TINY, advisor=demo_main.AdvisorRequest(target=None, objective="noise"))
    names = [name for name in RUN_NAMES if not name.startswith("last-layers")]
    earlier = tuple(spec for spec in demo_main.BASELINES if spec.name not in ("mxfp8", "int8"))
    monkeypatch.setattr(demo_main, "BASELINES", earlier)
    monkeypatch.setattr(
        run_loop,
        "train_run",
        lambda *args, **kwargs: real_train_run(*args, **{**kwargs, "save_model": False}),
    )
    run_demo(folder, replace(config, noise_seeds=()), [text_file], log=lambda _: None, progress=False)
    finished = {p: p.stat().st_mtime_ns for p in folder.glob("runs/*/result.json")}
    assert len(finished) == 8 and not list(folder.glob("runs/*/model.pt"))

    monkeypatch.undo()
    monkeypatch.setenv("NUMSCOPE_CACHE", str(tmp_path / "cache"))
    lines: list[str] = []
    summary = run_demo(folder, config, [text_file], log=lines.append, progress=False)
    assert all(path.stat().st_mtime_ns == mtime for path, mtime in finished.items()), "finished runs rerun"
    assert [r["name"] for r in summary["runs"]] == names
    new = ["mxfp8", "int8", "fp32-seed1", "fp32-seed2", "recommended-seed1", "recommended-seed2"]
    _assert_final_models(folder, summary, new)
    old = [name for name in names if name not in new]
    assert all(row["model"] is None for row in summary["runs"] if row["name"] in old)
    assert sum("finished without model.pt" in line for line in lines) == len(old)
    report = (folder / "report.html").read_text(encoding="utf-8")
    assert "<b>mxfp8</b>" in report and "<b>int8</b>" in report


def test_the_observer_measures_training_steps_only() -> None:
    model = make_bert_mlm(120, hidden=16, layers=1, heads=2, intermediate=32, max_position=16)
    config = replace(TINY, observe_every=2, candidates=("bf16", "fp8_e4m3"))
    observer = training_observer(model, config)
    ids = torch.randint(5, 120, (4, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    for step in range(1, 5):
        model(input_ids=ids, labels=labels).loss.backward()
        observer.step()
        if step % 2 == 0:  # as train_run evaluates: right after the step, in eval mode, without gradients
            model.eval()
            with torch.no_grad():
                model(input_ids=torch.cat([ids, ids]))
            model.train()
    analysis = observer.analysis()
    observer.__exit__(None, None, None)
    assert analysis.steps == [0, 2]  # step 4 saw only an evaluation
    query = "bert.encoder.layer.0.attention.self.query"
    assert analysis.elements[(query, "fprop", "input")] == ids.numel() * 16  # one training batch, no eval


def _analysis_with_gradients(binades: dict[int, int]) -> Analysis:
    analysis = Analysis(candidates=("fp16",))
    counts = [binades.get(exponent, 0) for exponent in range(-40, 0)]
    key = ("layer", "wgrad", "grad_output")
    analysis.histograms[key] = Log2Histogram(-40, tuple(counts), zeros=7)
    analysis.elements[key] = sum(counts) + 7
    from numscope.analysis import OperandRecord

    analysis.operands[key] = {0: OperandRecord(stats={}, metrics={}, sampled=1, elements=sum(counts) + 7)}
    return analysis


def test_fp16_underflow_counts_the_binades_below_its_flush_threshold() -> None:
    # fp16 flushes |x| < 2^-25 to zero: binades -30 and -26 are lost, -25 and above kept; exact zeros ignored
    analysis = _analysis_with_gradients({-30: 10, -26: 30, -25: 20, -10: 40})
    (row,) = fp16_underflow_by_site(analysis, loss_scale=1.0)
    assert (
        row["site"] == "layer"
        and row["before%"] == pytest.approx(40.0)
        and row["after%"] == pytest.approx(40.0)
    )
    (row,) = fp16_underflow_by_site(analysis, loss_scale=2.0**4)  # ×16 lifts binade -26 to -22
    assert row["before%"] == pytest.approx(40.0) and row["after%"] == pytest.approx(10.0)


def _row(name: str, loss: float, bits: float, skipped: int = 0, scale: float = 1.0) -> dict:
    return {"name": name, "val_loss": loss, "avg_bits": bits, "skipped_steps": skipped, "final_scale": scale}


def test_claims_are_stated_as_held_or_not_with_their_numbers() -> None:
    rows = [
        _row("fp32", 6.00, 32),
        _row("recommended", 6.03, 7.1),
        _row("bf16", 6.00, 16),
        _row("fp16+scaling", 6.01, 16, skipped=3, scale=2.0**15),
        _row("e5m2-grads", 13.4, 24.0),
        _row("e5m2-grads+scaling", 6.02, 24.0, skipped=5, scale=2.0**14),
        _row("fp8", 6.02, 8),
        _row("mxfp8", 6.04, 8.25),
        _row("int8", 6.3, 8),
        _row("mxfp4", 6.6, 4.25),
    ]
    underflow = [{"site": "a", "before%": 3.0, "after%": 0.0}, {"site": "b", "before%": 1.0, "after%": 0.5}]
    e5m2 = [{"site": "a", "before%": 40.0, "after%": 1.0}, {"site": "b", "before%": 20.0, "after%": 0.0}]
    claims = demo_claims._claims(rows, underflow, unigram=6.6, e5m2_underflow=e5m2)
    assert len(claims) == 6 and all(isinstance(verdict, bool) for _, verdict in claims)
    for start in (
        "FP32 learned from context",
        "Recommended plan",
        "Uniform MXFP4",
        "FP16 with dynamic loss",
        "FP16 without loss scaling flushes to zero 2.00% of the gradient values",
        "Loss scaling where gradients underflow",
    ):
        assert _verdict(claims, start) is True, start
    text = " ".join(text for text, _ in claims)
    assert "+0.50%" in text and "7.10 average bits" in text and "8.00 bits" in text and "2^15" in text
    plan = next(text for text, _ in claims if text.startswith("Recommended plan"))
    assert "the other uniform 8-bit runs: MXFP8 +0.67% at 8.25 bits, INT8 +5.00% at 8.00 bits" in plan
    scaling = next(text for text, _ in claims if text.startswith("Loss scaling where"))
    assert "without loss scaling gap to FP32 +123.33%" in scaling and "(5 skipped steps)" in scaling
    assert "flushes to zero 30.00% of the gradient values" in scaling and "2^14 0.50%" in scaling
    rows[1] = _row("recommended", 6.09, 7.1)  # 1.5% behind: the plan claim fails, and says so
    rows[9] = _row("mxfp4", 6.05, 4.25)
    rows[4] = _row("e5m2-grads", 6.03, 24.0)  # unscaled within 1% of FP32: no evidence loss scaling matters
    claims = demo_claims._claims(rows, underflow, unigram=6.6)
    assert _verdict(claims, "Recommended plan") is False and _verdict(claims, "Uniform MXFP4") is False
    assert _verdict(claims, "Loss scaling where") is False
    assert "does NOT hold" in next(text for text, _ in claims if text.startswith("Recommended plan"))


def test_claims_measure_differences_against_the_fp32_seed_noise() -> None:
    rows = [
        _row("fp32", 6.00, 32),
        _row("recommended", 6.03, 7.1),
        _row("bf16", 6.00, 16),
        _row("fp16+scaling", 6.01, 16, scale=2.0**15),
        _row("e5m2-grads", 6.20, 24.0),
        _row("e5m2-grads+scaling", 6.05, 24.0, scale=2.0**15),
        _row("fp8", 6.02, 8),
        _row("mxfp4", 6.12, 4.25),
        _row("fp32-seed1", 6.02, 32),
        _row("fp32-seed2", 6.04, 32),
    ]
    noise = demo_main.fp32_seed_noise(rows)
    assert noise == pytest.approx(0.02)  # sd of 6.00, 6.02, 6.04
    claims = demo_claims._claims(rows, [], unigram=6.6, noise=noise)
    plan = next(text for text, _ in claims if text.startswith("Recommended plan"))
    assert "seed noise is 0.0200 nats (sd over 3 seeds)" in plan
    assert "recommended − fp32 +0.0300 nats = 1.5 sd, within the seed noise" in plan
    # mxfp4 is 0.09 nats (4.5 sd) behind the plan: beyond 2 sd, the claim holds
    assert _verdict(claims, "Uniform MXFP4") is True
    # unscaled E5M2 gradients 10 sd behind, scaled 2.5 sd behind: loss scaling did not recover FP32
    scaling = next(text for text, _ in claims if text.startswith("Loss scaling where"))
    assert "e5m2-grads − fp32 +0.2000 nats = 10.0 sd, beyond the seed noise" in scaling
    assert "e5m2-grads+scaling − fp32 +0.0500 nats = 2.5 sd, beyond" in scaling
    assert _verdict(claims, "Loss scaling where") is False
    rows[7] = _row("mxfp4", 6.06, 4.25)  # 1% behind FP32 and behind the plan, but only 1.5 sd: a tie
    rows[5] = _row("e5m2-grads+scaling", 6.03, 24.0, scale=2.0**15)  # 1.5 sd: within the noise
    claims = demo_claims._claims(rows, [], unigram=6.6, noise=noise)
    mxfp4 = next(text for text, _ in claims if text.startswith("Uniform MXFP4"))
    assert _verdict(claims, "Uniform MXFP4") is False and "1.5 sd, within the seed noise" in mxfp4
    assert _verdict(claims, "Loss scaling where") is True
    scaled = next(text for text, _ in claims if text.startswith("FP16 with dynamic"))
    assert "fp16+scaling − fp32 +0.0100 nats = 0.5 sd, within the seed noise" in scaled
    assert _verdict(claims, "FP16 with dynamic") is True
    assert demo_main.fp32_seed_noise(rows[:1]) is None


def test_the_plan_claim_pairs_the_recommended_runs_with_fp32_seed_by_seed() -> None:
    rows = [
        _row("fp32", 6.00, 32),
        _row("recommended", 6.01, 7.1),
        _row("fp16+scaling", 6.00, 16, scale=2.0**15),
        _row("fp8", 6.02, 8),
        _row("mxfp4", 6.12, 4.25),
        _row("fp32-seed1", 6.10, 32),
        _row("fp32-seed2", 5.90, 32),
        _row("recommended-seed1", 6.115, 7.1),
        _row("recommended-seed2", 5.905, 7.1),
    ]
    noise = demo_main.fp32_seed_noise(rows)
    assert noise == pytest.approx(0.1)  # the fp32 runs only: 6.00, 6.10, 5.90
    assert demo_claims.recommended_pairs(rows) == [
        ("main", pytest.approx(0.01)),
        ("seed1", pytest.approx(0.015)),
        ("seed2", pytest.approx(0.005)),
    ]
    claims = demo_claims._claims(rows, [], unigram=6.6, noise=noise)
    plan = next(text for text, _ in claims if text.startswith("Recommended plan"))
    # 0.010 ± 0.005 nats: 2 sd of the paired differences is 0.010, the mean is not beyond it
    assert "recommended − fp32 = +0.0100 ± 0.0050 nats (main +0.0100, seed1 +0.0150, seed2 +0.0050)" in plan
    assert _verdict(claims, "Recommended plan") is True
    rows[7] = _row("recommended-seed1", 6.20, 7.1)  # 0.01, 0.10, 0.005: one seed 0.10 behind, within
    claims = demo_claims._claims(rows, [], unigram=6.6, noise=noise)  # both bars (2 x 0.053; 2 x 0.1): a tie
    assert _verdict(claims, "Recommended plan") is True
    rows[7] = _row("recommended-seed1", 6.40, 7.1)  # 0.30 nats behind on one seed (stuck): beyond 2 x 0.1
    claims = demo_claims._claims(rows, [], unigram=6.6, noise=noise)
    assert _verdict(claims, "Recommended plan") is False
    rows[7], rows[8] = _row("recommended-seed1", 6.13, 7.1), _row("recommended-seed2", 5.95, 7.1)
    claims = demo_claims._claims(rows, [], unigram=6.6, noise=noise)  # 0.01, 0.03, 0.05: 0.03 <= 2 x 0.02
    assert _verdict(claims, "Recommended plan") is True
    rows[1] = _row("recommended", 6.03, 7.1)  # 0.03, 0.03, 0.05: 0.037 > 2 x 0.012, consistently behind
    claims = demo_claims._claims(rows, [], unigram=6.6, noise=noise)
    assert _verdict(claims, "Recommended plan") is False


def test_claims_state_their_thresholds_and_the_scale_they_saw() -> None:
    rows = [
        _row("fp32", 6.00, 32),
        _row("recommended", 6.03, 7.1),
        _row("fp16+scaling", 6.01, 16, scale=3000.0),  # a static scale need not be a power of two
        _row("fp8", 6.02, 8),
        _row("mxfp4", 6.6, 4.25),
    ]
    one_value = [
        {"site": "a", "before%": 0.01, "after%": 0.0}
    ]  # one flushed value is not a loss of information
    claims = demo_claims._claims(rows, one_value, unigram=6.03)
    flush = next(text for text, _ in claims if text.startswith("FP16 without loss scaling"))
    assert _verdict(claims, "FP16 without loss scaling") is False
    assert "at least 1% flushed at some site" in flush and "loss scale 3000 " in flush
    learned = next(text for text, _ in claims if text.startswith("FP32 learned"))
    assert _verdict(claims, "FP32 learned") is False and "at least 0.05 nats below" in learned


def _verdict(claims: list[tuple[str, bool]], start: str) -> bool:
    (verdict,) = [held for text, held in claims if text.startswith(start)]
    return verdict


def _flush_analysis(cases: tuple[tuple[str, float, float], ...]) -> Analysis:
    """wgrad grad_output operands: (site, fp16 underflow%, fp16's backward error over bf16's)."""
    from numscope.analysis import OperandRecord

    analysis = Analysis(candidates=("bf16", "fp16"))
    for site, share, ratio in cases:
        metrics = {
            "fp16": {"underflow%": share, "overflow%": 0.0, "sqnr_db": 60.0},
            "bf16": {"underflow%": 0.0, "overflow%": 0.0, "sqnr_db": 50.0},
        }
        analysis.operands[(site, "wgrad", "grad_output")] = {4: OperandRecord({}, metrics, 10, 10)}
        analysis.elements[(site, "wgrad", "grad_output")] = 10
        analysis.backward_errors[(site, "wgrad")] = {
            ("fp16", "fp32"): {4: {"mean": ratio * 1e-4}},
            ("bf16", "fp32"): {4: {"mean": 1e-4}},
        }
    return analysis


def test_the_plan_rationale_cites_a_measured_flush_that_the_backward_error_rejects() -> None:
    from numscope.advisor import advise
    from numscope.demo.main import AdvisorRequest, _flush_example

    request = AdvisorRequest(target=None, objective="noise")  # the limits' request
    analysis = _flush_analysis((("a", 99.0, 3.0), ("b", 90.0, 500.0)))
    recommendation = advise(analysis, **request.kwargs())
    example = _flush_example(recommendation, analysis)
    assert example == (
        "fp16 flushes up to 90.0% of the wgrad grad_output of b, and its backward error there reaches 500× "
        "bf16's, over the limit of 140×: rejected"
    )
    text = request.rationale(example, default_bits=9.17)
    assert example in text and "at most 140× bf16's" in text and "at least 24 dB" in text
    assert "limited to 54%, the default" in text and "limited to 0%, the default" in text
    assert text.endswith("would average 9.17 bits.")
    # a flush the backward-error limit let through is cited as such, never as "rejected"
    analysis = _flush_analysis((("a", 99.0, 3.0),))
    example = _flush_example(advise(analysis, **request.kwargs()), analysis)
    assert example is not None and example.endswith("reaches 3× bf16's, within the limit of 140×")


def test_the_plan_rationale_follows_the_request() -> None:
    from numscope.demo.main import AdvisorRequest

    request = AdvisorRequest(
        target=None,
        objective="noise",
        bit_budget=9.0,
        criteria=(("max_be_ratio", 40.0), ("max_underflow_pct", 5.0), ("max_overflow_pct", None)),
    )
    text = request.rationale("an example")
    assert "least total quantization noise within 9 average bits per element" in text
    assert "may reach 5% instead of 54%" in text and "an example" not in text
    assert "overflow share (values that saturate) is not limited" in text
    # the advisor's own default applies where the request sets nothing, and the text says so
    assert "an SQNR of at least 24 dB" in text and "at most 40× bf16's" in text
    assert "min_sqnr_db 24" in request.describe()
    assert "OCP" not in text and "cheapest" not in text


def test_an_interrupted_observed_run_resumes_its_analysis_exactly(tmp_path: Path, text_file: Path) -> None:
    """Ctrl-C during the observed fp32 run: the resumed run's analysis equals an uninterrupted one's."""
    config = replace(TINY, observe_every=1)
    data = demo_main.prepare_demo_data(config, [text_file], cache_dir=tmp_path / "cache")
    model_config = demo_main.model_config(config, data)

    def observed(folder: Path, on_step=None):
        return run_loop.train_run(
            demo_main.REFERENCE,
            model_config,
            config.train,
            data,
            folder,
            on_step,
            lambda model: training_observer(model, config),
        )

    def stop(step: int, loss: float) -> None:  # one step after the step-2 checkpoint
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        observed(tmp_path / "resumed", stop)
    observed(tmp_path / "resumed")
    observed(tmp_path / "whole")
    resumed, whole = (Analysis.load(tmp_path / name / "analysis") for name in ("resumed", "whole"))
    assert resumed.steps == list(range(config.train.steps))
    assert json.dumps(resumed.to_dict()) == json.dumps(whole.to_dict())


def test_a_folder_of_runs_made_with_other_settings_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    folder.mkdir()
    demo_main._check_settings(folder, TINY, None)
    demo_main._check_settings(folder, replace(TINY, threads=2), None)  # same results: accepted
    longer = replace(TINY, train=replace(TINY.train, steps=5))
    with pytest.raises(demo_main.DemoError, match=r"other settings \(train\.steps: 4 → 5\)"):
        demo_main._check_settings(folder, longer, None)
    (folder / demo_main.SETTINGS_FILE).unlink()
    (folder / "runs" / "fp32").mkdir(parents=True)
    (folder / "runs" / "fp32" / "result.json").write_text("{}")
    with pytest.raises(demo_main.DemoError, match=r"no demo\.json"):
        demo_main._check_settings(folder, TINY, None)


def test_runs_trained_in_worker_processes_equal_runs_trained_in_this_one(
    tmp_path: Path, text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``jobs=2`` trains the runs in two spawned processes: every run's losses, evaluations, final model and
    the fp32 run's analysis are the same bits as ``jobs=1`` gives, and the table keeps its order."""
    monkeypatch.setenv("NUMSCOPE_CACHE", str(tmp_path / "cache"))
    config = replace(TINY, noise_seeds=(1,))
    folders = {jobs: tmp_path / f"jobs{jobs}" for jobs in (1, 2)}
    summaries = {
        jobs: run_demo(folder, replace(config, jobs=jobs), [text_file], log=lambda _: None, progress=False)
        for jobs, folder in folders.items()
    }
    names = [row["name"] for row in summaries[1]["runs"]]
    assert names == [name for name in RUN_NAMES if not name.endswith("seed2")]
    assert [row["name"] for row in summaries[2]["runs"]] == names
    from numscope.train.checkpoint import load_checkpoint

    for one, two in zip(summaries[1]["runs"], summaries[2]["runs"], strict=True):
        assert one["curve"] == two["curve"], one["name"]
        assert [r["loss"] for r in one["train_log"]] == [r["loss"] for r in two["train_log"]], one["name"]
        models = [load_checkpoint(Path(row["model"]))["model"] for row in (one, two)]
        assert all(torch.equal(models[0][key], models[1][key]) for key in models[0]), one["name"]
    analyses = [Analysis.load(folder / "runs" / "fp32" / "analysis") for folder in folders.values()]
    assert json.dumps(analyses[0].to_dict()) == json.dumps(analyses[1].to_dict())
    assert (folders[1] / "plan.yaml").read_text() == (folders[2] / "plan.yaml").read_text()


def test_a_run_that_fails_in_a_worker_raises_its_error_here(tmp_path: Path, text_file: Path) -> None:
    from numscope.run.pool import RunPool

    data = demo_main.prepare_demo_data(TINY, [text_file], cache_dir=tmp_path / "cache")
    bad = demo_main.RunSpec("bad", str(tmp_path / "no-such-plan.yaml"))
    with RunPool(data, jobs=2, threads=1) as pool:
        pool.add(
            "bad",
            spec=bad,
            model_config=demo_main.model_config(TINY, data),
            cfg=TINY.train,
            out_dir=tmp_path / "bad",
        )
        with pytest.raises(Exception, match="no-such-plan"):
            pool.next_finished()
        assert not pool
    with pytest.raises(ValueError, match="jobs must be a positive integer"):
        RunPool(data, jobs=0)


def test_a_worker_that_dies_raises_instead_of_leaving_the_pool_waiting(
    tmp_path: Path, text_file: Path
) -> None:
    import functools
    import os
    from concurrent.futures.process import BrokenProcessPool

    from numscope.run.pool import RunPool

    data = demo_main.prepare_demo_data(TINY, [text_file], cache_dir=tmp_path / "cache")
    with RunPool(data, jobs=2, threads=1) as pool:  # the model factory ends its process at once
        pool.add(
            "dies",
            spec=demo_main.REFERENCE,
            model_config=functools.partial(os._exit, 3),
            cfg=TINY.train,
            out_dir=tmp_path / "dies",
        )
        with pytest.raises(BrokenProcessPool):
            pool.next_finished()


def test_the_heuristic_claim_calls_a_tie_a_tie_and_a_loss_a_loss() -> None:
    from numscope.demo.claims import HEURISTIC, RECOMMENDED, _heuristic_claim

    def rows(differences: list[float]) -> list[dict]:
        out = []
        for index, difference in enumerate(differences):
            suffix = "" if index == 0 else f"-seed{index}"
            out.append({"name": RECOMMENDED + suffix, "val_loss": 5.0 + difference, "avg_bits": 12.5})
            out.append({"name": HEURISTIC + suffix, "val_loss": 5.0, "avg_bits": 12.52})
        return out

    text, held = _heuristic_claim(rows([0.01, -0.01, 0.005]))
    assert held and "ties it (within the noise)" in text and "12.50 and 12.52 bits" in text
    text, held = _heuristic_claim(rows([-0.03, -0.031, -0.029]))
    assert held and "beats it beyond the noise" in text
    text, held = _heuristic_claim(rows([0.03, 0.031, 0.029]))
    assert not held and "is behind it beyond the noise" in text and "does NOT hold" in text
    text, held = _heuristic_claim(rows([0.0]))
    assert not held and "not tested" in text


def test_the_requests_budget_sits_midway_between_the_targets_cheapest_recipe_and_its_fp8() -> None:
    from numscope.demo.main import AdvisorRequest

    with pytest.raises(ValueError, match="allowed: sensitivity, noise"):
        AdvisorRequest(objective="loss")
    with pytest.raises(ValueError, match="within a bit budget"):
        AdvisorRequest(target=None)
    request = AdvisorRequest()
    assert request.target == "te" and request.measured
    assert AdvisorRequest(bit_budget=9.0).budget(None) == 9.0  # given: used as is
