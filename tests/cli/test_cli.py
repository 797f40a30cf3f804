"""The command line: formats, the user's own work (analyze → recommend → train → compare → report), the
synthetic study, every user error, and ``numscope train`` under a real 2-process ``torchrun``.

Most commands run in process through :func:`numscope.cli.main` (the same code the entry point runs, without
paying the interpreter's start-up per call); where the process boundary itself is tested (exit status, no
traceback, torchrun, the example script) they run as real subprocesses. Models are tiny ``transformers``
configs, text is written by the tests.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import random
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import numscope
from numscope import workflow
from numscope.analysis import Analysis
from numscope.cli import build_parser, formats_table, main
from numscope.plan import HIGH, Plan
from numscope.workflow import analysis_average_bits

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "numscope.cli", *args], capture_output=True, text=True, timeout=300, env=ENV
    )


@dataclass
class Result:
    code: int
    out: str
    err: str


def cli(*args: object) -> Result:
    """``numscope ARGS`` in this process: exit status, stdout, stderr (argparse's exits included)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return Result(code, out.getvalue(), err.getvalue())


def write_text(path: Path, paragraphs: int = 120, seed: int = 0) -> Path:
    """Toy English: short sentences over a small vocabulary, blank lines between paragraphs."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "the bird", "my friend", "the teacher", "a farmer", "the king"]
    verbs = ["sees", "likes", "finds", "carries", "paints", "follows", "watches", "helps"]
    objects = ["the ball", "a red apple", "the old house", "a small boat", "the river", "the book"]
    text = "\n\n".join(
        " ".join(
            f"{rng.choice(subjects).capitalize()} {rng.choice(verbs)} {rng.choice(objects)}."
            for _ in range(6)
        )
        for _ in range(paragraphs)
    )
    path.write_text(text, encoding="utf-8")
    return path


TINY_BERT = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    attn_implementation="eager",
)

MODELS_PY = textwrap.dedent(
    f"""
    import atexit
    import os

    import torch
    from transformers import BertConfig, BertForMaskedLM, GPT2Config

    TINY_BERT = {TINY_BERT!r}
    built = []


    def gpt2_config():
        return GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=64, attn_implementation="eager")


    def bert(vocab_size):
        model = BertForMaskedLM(BertConfig(vocab_size=vocab_size, **TINY_BERT))
        built.append(model)
        return model


    class StoppingBert(BertForMaskedLM):
        # crashes (as a lost machine would) on its 3rd training forward when NUMSCOPE_TEST_STOP is set
        def forward(self, *args, **kwargs):
            if self.training and torch.is_grad_enabled() and os.environ.get("NUMSCOPE_TEST_STOP"):
                self.training_forwards = getattr(self, "training_forwards", 0) + 1
                if self.training_forwards == 3:
                    raise RuntimeError("the machine went away")
            return super().forward(*args, **kwargs)


    def stopping(vocab_size):
        return StoppingBert(BertConfig(vocab_size=vocab_size, **TINY_BERT))


    def broken():
        raise RuntimeError("no weights here")


    def number():
        return 42


    def small():
        return BertForMaskedLM(BertConfig(vocab_size=10, **TINY_BERT))


    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x)


    def plain():
        return Plain()


    def _save_parameters():
        # the parameters of the last model built (the trained one), for the torchrun test: one file per rank
        folder = os.environ.get("NUMSCOPE_TEST_PARAMETERS")
        if folder and built:
            state = {{k: v.detach().clone() for k, v in built[-1].state_dict().items()}}
            torch.save(state, os.path.join(folder, "rank" + os.environ.get("RANK", "0") + ".pt"))


    atexit.register(_save_parameters)
    """
)


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace: text, a tiny BERT config .json, a models module, a tokenizer cache."""
    from transformers import BertConfig

    root = tmp_path_factory.mktemp("cli")
    write_text(root / "text.txt")
    BertConfig(**TINY_BERT).to_json_file(root / "bert.json")
    (root / "cli_models.py").write_text(MODELS_PY)
    return root


def flags(ws: Path, model: str | None = None, **overrides: object) -> list[str]:
    """Model, data and training flags of a 4-step run on the workspace's text."""
    values = {
        "model": model or ws / "bert.json",
        "text": ws / "text.txt",
        "vocab-size": 200,
        "seq-len": 32,
        "val-blocks": 16,
        "cache": ws / "cache",
        "steps": 4,
        "batch-size": 8,
        "warmup-steps": 1,
        "eval-every": 2,
        "checkpoint-every": 2,
        **{k.replace("_", "-"): v for k, v in overrides.items()},
    }
    return [item for key, value in values.items() for item in (f"--{key}", str(value))] + ["--no-progress"]


# ------------------------------------------------------------------------------------------------ formats
def test_formats_table_lists_every_format_with_its_facts() -> None:
    rows = {row["format"]: row for row in formats_table()}
    assert set(rows) == {f.name for f in numscope.formats()}
    assert rows["fp8_e4m3"]["max"] == "448" and rows["fp8_e4m3"]["inf"] == "no"
    assert rows["fp8_e5m2"]["max"] == "57344" and rows["fp8_e5m2"]["inf"] == "yes"
    assert rows["mxfp8_e4m3"]["bits"] == "8.25"
    assert rows["nvfp4"]["bits"] == "4.5"


def test_formats_command_prints_the_table() -> None:
    result = run_cli("formats")
    assert result.returncode == 0, result.stderr
    assert "| fp8_e4m3 " in result.stdout and "| nvfp4 " in result.stdout


def test_the_formats_table_never_prints_a_rounded_range() -> None:
    """Every printed range figure reads back as the format's exact value (2^-9 is not 0.00195312)."""
    for row, fmt in zip(formats_table(), numscope.formats(), strict=True):
        for column, value in (("min normal", fmt.min_normal), ("min subnormal", fmt.min_subnormal)):
            text = row[column]
            exact = 2.0 ** int(text[2:]) if text.startswith("2^") else float(text)
            assert exact == value, (fmt.name, column, text)


def test_unknown_command_fails_with_usage(capsys) -> None:
    try:
        main(["no-such-command"])
    except SystemExit as exit_:
        assert exit_.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_every_flag_of_every_command_is_explained() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert {"formats", "demo", "analyze", "recommend", "train", "compare", "report", "study"} <= set(commands)
    for name, command in commands.items():
        for action in command._actions:
            assert action.help and action.help.strip(), f"numscope {name} {action.option_strings} has no help"
        assert cli(name, "--help").code == 0


# ------------------------------------------------------------------ analyze → recommend → train → compare
@pytest.fixture(scope="module")
def flow(ws: Path) -> dict[str, Result]:
    runs = ws / "runs"
    steps = {}
    steps["analyze"] = cli(
        "analyze",
        *flags(ws),
        "--candidates",
        "fp8_e4m3",
        "mxfp4_e2m1",
        "--every",
        "4",
        "--out",
        runs / "fp32",
    )
    steps["recommend"] = cli("recommend", runs / "fp32", "-o", ws / "plan.yaml")
    steps["planned"] = cli("train", *flags(ws), "--plan", ws / "plan.yaml", "--out", runs / "planned")
    steps["fp16"] = cli(
        "train", *flags(ws), "--plan", "fp16", "--loss-scaling", "dynamic", "--out", runs / "fp16-scaled"
    )
    folders = [runs / "fp32", runs / "planned", runs / "fp16-scaled"]
    steps["compare"] = cli("compare", *folders)
    steps["compare_planned"] = cli("compare", *folders, "--baseline", "planned")
    steps["report"] = cli("report", *folders, "-o", ws / "report.html")
    for name, result in steps.items():
        assert result.code == 0, f"{name}: {result.err[-2000:]}"
    return steps


def test_analyze_writes_an_observed_fp32_run(ws: Path, flow: dict[str, Result]) -> None:
    run = ws / "runs" / "fp32"
    analysis = Analysis.load(run / "analysis")
    assert {"bf16", "fp8_e4m3", "mxfp4_e2m1"} <= set(analysis.candidates)  # bf16, the reference, added
    assert 0 in analysis.steps and not {1, 2, 3} & set(analysis.steps)  # --every 4: steps 0, 4, …
    result = json.loads((run / "result.json").read_text())
    assert result["name"] == "fp32" and result["steps"] == 4 and math.isfinite(result["val_loss"])
    with (run / "log.csv").open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3, 4]
    settings = json.loads((run / "run.json").read_text())
    assert settings["objective_resolved"] == "mlm" and settings["kind"] == "analyze"
    assert f"val loss {result['val_loss']:.4f}" in flow["analyze"].out


def test_recommend_prints_its_choices_and_writes_the_plan(ws: Path, flow: dict[str, Result]) -> None:
    plan = Plan.load(ws / "plan.yaml")
    analysis = Analysis.load(ws / "runs" / "fp32" / "analysis")
    chosen = {row.format for row in plan.describe()}
    assert chosen <= {HIGH, *analysis.candidates} and chosen - {HIGH}
    out = flow["recommend"].out
    assert out.startswith("| site ") and "| reason" in out
    for row in plan.describe():
        if row.reason:
            assert row.reason in out
    assert f"(weighted by operand size): {analysis_average_bits(plan, analysis):.2f}" in out
    # analyze measured every operand's sensitivity: no flag needed for the measured objective, at FP8's bits
    assert "objective: sensitivity" in out and "bit budget: 8 bits per operand element (the default" in out
    assert analysis_average_bits(plan, analysis) <= 8.0 + 1e-9


def test_recommend_passes_its_criteria_to_the_advisor(ws: Path, flow: dict[str, Result]) -> None:
    analysis = Analysis.load(ws / "runs" / "fp32" / "analysis")
    cheapest = min(analysis.candidates, key=lambda name: numscope.get_format(name).bits_per_element)
    no_limits = [
        *("--criterion", "max_be_ratio=none", "--criterion", "max_underflow_pct=off"),
        *("--criterion", "max_overflow_pct=none", "--criterion", "min_sqnr_db=none"),
    ]
    result = cli(
        "recommend",
        ws / "runs" / "fp32",
        "-o",
        ws / "open.yaml",
        *no_limits,
        "--per-operand",
        "*/wgrad/*:candidates=bf16",
    )
    assert result.code == 0, result.err
    rows = Plan.load(ws / "open.yaml").describe()
    assert {r.format for r in rows if r.gemm == "wgrad" and r.reason} == {"bf16"}
    assert {r.format for r in rows if r.gemm != "wgrad" and r.reason} == {cheapest}
    budget = cli("recommend", ws / "runs" / "fp32", "-o", ws / "budget.yaml", *no_limits, "--bit-budget", "9")
    assert budget.code == 0, budget.err
    assert analysis_average_bits(Plan.load(ws / "budget.yaml"), analysis) <= 9


def test_recommend_with_a_gap_model_weights_roles_and_predicts_the_gap(
    ws: Path, flow: dict[str, Result]
) -> None:
    from numscope.study import GapModel

    analysis = Analysis.load(ws / "runs" / "fp32" / "analysis")
    model = GapModel({"fprop": 0.5, "dgrad": 0.0, "wgrad": 0.0}, 0.002, 4)
    (ws / "gap_model.json").write_text(json.dumps(model.to_dict()))
    args = ["--criterion", "max_be_ratio=none", "--criterion", "max_underflow_pct=none"]
    args += ["--criterion", "max_overflow_pct=none", "--criterion", "min_sqnr_db=none"]
    args += ["--candidates", "mxfp4_e2m1", "bf16", "--bit-budget", "10"]
    result = cli(
        "recommend", ws / "runs" / "fp32", "-o", ws / "gm.yaml", *args, "--gap-model", ws / "gap_model.json"
    )
    assert result.code == 0, result.err
    # the analysis measured sensitivities (analyze's default), the gap model did not: noise weighs, said so
    assert "objective: noise (the gap model was fitted without sensitivities" in result.out
    plan = Plan.load(ws / "gm.yaml")
    predicted = model.predict_plan(analysis, plan)
    assert f"predicted validation-loss gap to FP32: {predicted:+.4f} ± 0.0020 nats" in result.out
    # only fprop noise counts: every bf16 (bought) operand is an fprop operand
    bought = {(r.gemm, r.operand) for r in plan.describe() if r.format == "bf16"}
    assert bought and {gemm for gemm, _ in bought} == {"fprop"}
    bad = cli("recommend", ws / "runs" / "fp32", "-o", ws / "x.yaml", "--gap-model", ws / "plan.yaml")
    assert bad.code == 2 and "--gap-model" in bad.err and "not a gap model" in bad.err
    # --max-gap: the cheapest plan predicted within the gap (here half of the all-MXFP4 plan's)
    lowest = [*args[:-2], "--bit-budget", "4.3"]
    low = cli("recommend", ws / "runs" / "fp32", "-o", ws / "low.yaml", *lowest)
    assert low.code == 0, low.err
    gap = model.predict_plan(analysis, Plan.load(ws / "low.yaml")) / 2
    within = [*args[:-2], "--max-gap", f"{gap:.6g}", "--gap-model", ws / "gap_model.json"]
    result = cli("recommend", ws / "runs" / "fp32", "-o", ws / "within.yaml", *within)
    assert result.code == 0, result.err
    plan = Plan.load(ws / "within.yaml")
    assert model.predict_plan(analysis, plan) <= float(f"{gap:.6g}")
    assert f"cheapest plan predicted within {float(f'{gap:.6g}'):g}" in result.out
    cheaper = numscope.advisor.advise(
        analysis, candidates=["mxfp4_e2m1", "bf16"], bit_budget=analysis_average_bits(plan, analysis) - 0.1,
        noise_weights=model.noise_weights(), max_be_ratio=None, max_underflow_pct=None, max_overflow_pct=None,
        min_sqnr_db=None,
    )  # fmt: skip
    assert model.predict_plan(analysis, cheaper.plan) > float(f"{gap:.6g}")  # no cheaper plan is within it
    impossible = cli("recommend", ws / "runs" / "fp32", "-o", ws / "x.yaml", *within[:-3], "-1", *within[-2:])
    assert impossible.code == 2 and "no plan is predicted within a gap of -1 nats" in impossible.err
    unmodelled = cli("recommend", ws / "runs" / "fp32", "-o", ws / "x.yaml", *within[:-2])
    assert unmodelled.code == 2 and "--max-gap needs --gap-model" in unmodelled.err
    plain = cli("recommend", ws / "runs" / "fp32", "-o", ws / "x.yaml")
    assert "predicted gap to FP32: none (no gap model" in plain.out


def test_calibrate_fits_a_gap_model_that_recommend_uses(ws: Path, flow: dict[str, Result]) -> None:
    out = ws / "calibration"
    result = cli("calibrate", *flags(ws), "--seed-list", "0", "1", "--sensitivity", "1", "--out", out)
    assert result.code == 0, result.err
    data = json.loads((out / "gap_model.json").read_text())
    assert data["seeds"] == [0, 1] and data["low"] == "mxfp4_e2m1"
    assert [r["name"] for r in data["runs"]] == [
        "mxfp4 fprop only",
        "mxfp4 dgrad only",
        "mxfp4 wgrad only",
        "mxfp4_e2m1 everywhere",
    ]
    for row in data["runs"]:  # each gap is its run's loss minus fp32's on the same seed
        for seed, gap in zip((0, 1), row["gaps"], strict=True):
            run = json.loads(
                (out / row["name"].replace(" ", "_") / f"seed{seed}" / "result.json").read_text()
            )
            fp32 = json.loads((out / "fp32" / f"seed{seed}" / "result.json").read_text())
            assert gap == pytest.approx(run["val_loss"] - fp32["val_loss"])
    assert all(v >= 0 for v in data["coefficients"].values())
    assert "gap ≈" in result.out and "--gap-model" in result.out
    again = cli(
        "calibrate", *flags(ws), "--seed-list", "0", "1", "--sensitivity", "1", "--out", out
    )  # reused
    assert again.code == 0 and again.out == result.out
    recommended = cli(
        "recommend", out / "fp32" / "seed0", "-o", ws / "cal.yaml", "--gap-model", out / "gap_model.json"
    )
    assert recommended.code == 0, recommended.err
    assert "predicted validation-loss gap to FP32" in recommended.out
    # no flags but the gap model: the measured objective at its default budget (FP8 everywhere's bits)
    assert "objective: sensitivity" in recommended.out and "(the default; --bit-budget" in recommended.out
    budgeted = cli(
        "recommend", out / "fp32" / "seed0", "-o", ws / "cal6.yaml", "--gap-model", out / "gap_model.json",
        "--bit-budget", "8",
    )  # fmt: skip
    assert budgeted.code == 0, budgeted.err
    # numscope's own sensitivity plan: its predicted gap read as a lower bound (plan-study.md's measurements)
    assert "objective: sensitivity" in budgeted.out and "read it as a lower bound" in budgeted.out
    assert cli("calibrate", *flags(ws), "--seed", "3", "--out", out).code == 2
    # the sensitivity model: fitted on each operand's measured gradient error (S), as the noise model is
    analysis = Analysis.load(out / "fp32" / "seed0" / "analysis")
    assert analysis.sensitivity.granularity == "operand"
    assert analysis.sensitivity.candidates == ("mxfp4_e2m1",)  # the cheapest; the others estimated from it
    from numscope.advisor import operand_impact, operand_noise

    for row in data["runs"]:  # its features: per role, the sum of the operands' S under the run's plan
        plan = numscope.Plan.load(out / "plans" / f"{row['name'].replace(' ', '_')}.yaml")
        expected = dict.fromkeys(("fprop", "dgrad", "wgrad"), 0.0)
        for key in sorted(analysis.keys()):
            label = plan.for_site(key[0]).operand(key[1], key[2]).format
            expected[key[1]] += operand_impact(
                analysis.sensitivity, key, "high" if label == "high" else label, analysis
            )
        assert row["sensitivity_by_role"] == pytest.approx(expected)
    assert data["sensitivity"]["features"] == "sensitivity" and data["sensitivity"]["points"] == 4
    assert "·S(fprop)" in result.out and "--minimize sensitivity" in result.out
    # an unmeasured format's impact: the measured MXFP4 one scaled by the observer's noise ratio
    for key in sorted(analysis.sensitivity.results):
        measured = analysis.sensitivity.results[key]["mxfp4_e2m1"]["grad_rel_error"] ** 2
        ratio = operand_noise(analysis, key, "fp8_e4m3") / operand_noise(analysis, key, "mxfp4_e2m1")
        assert operand_impact(analysis.sensitivity, key, "fp8_e4m3", analysis) == pytest.approx(
            measured * ratio
        )
    with pytest.raises(numscope.advisor.AdvisorError, match="pass the analysis to estimate it"):
        operand_impact(analysis.sensitivity, key, "fp8_e4m3")
    # a plan in a format no calibration run used: its prediction says it extrapolates, and which formats
    mixed = ["--candidates", "mxfp4_e2m1", "fp8_e4m3", "--bit-budget", "6", "-o", ws / "mixed.yaml"]
    guessed = cli("recommend", out / "fp32" / "seed0", "--gap-model", out / "gap_model.json", *mixed)
    assert guessed.code == 0, guessed.err
    rules = numscope.Plan.load(ws / "mixed.yaml").rules
    assert "fp8_e4m3" in {spec.format for rule in rules for spec in rule.spec.operands.values()}
    assert (
        "an extrapolation: calibrated on mxfp4_e2m1 only, the plan also uses fp8_e4m3 "
        "('numscope calibrate --also fp8_e4m3' calibrates them)" in guessed.out
    )
    # --also calibrates it: one more run per seed (the others reused), and no extrapolation left
    also = ("--also", "fp8_e4m3")
    more = cli(
        "calibrate",
        *flags(ws),
        "--seed-list",
        "0",
        "1",
        "--sensitivity",
        "1",
        *also,
        "--jobs",
        "2",
        "--out",
        out,
    )
    assert more.code == 0, more.err
    data = json.loads((out / "gap_model.json").read_text())
    assert [r["name"] for r in data["runs"]][-1] == "fp8_e4m3 everywhere" and data["points"] == 5
    assert data["formats"] == ["mxfp4_e2m1", "fp8_e4m3"] == data["sensitivity"]["formats"]
    for seed, gap in zip((0, 1), data["runs"][-1]["gaps"], strict=True):
        run = json.loads((out / "fp8_e4m3_everywhere" / f"seed{seed}" / "result.json").read_text())
        fp32 = json.loads((out / "fp32" / f"seed{seed}" / "result.json").read_text())
        assert gap == pytest.approx(run["val_loss"] - fp32["val_loss"])
    calibrated = cli("recommend", out / "fp32" / "seed0", "--gap-model", out / "gap_model.json", *mixed)
    assert calibrated.code == 0 and "predicted validation-loss gap" in calibrated.out
    assert "extrapolation" not in calibrated.out
    bad = cli("calibrate", *flags(ws), "--seed-list", "0", "1", "--also", "fp7", "--out", out)
    assert bad.code == 2 and "--also" in bad.err and "fp7" in bad.err
    off = [f"--{name}" for name in ("max-be-ratio", "max-underflow-pct", "max-overflow-pct", "min-sqnr-db")]
    budget = [
        "--bit-budget",
        "6",
        "--candidates",
        "mxfp4_e2m1",
        "mxfp8_e4m3",
        *(x for f in off for x in (f, "none")),
    ]
    by_sensitivity = cli(
        "recommend", out / "fp32" / "seed0", "-o", ws / "sens.yaml", "--minimize", "sensitivity", *budget,
        "--gap-model", out / "gap_model.json",
    )  # fmt: skip
    assert by_sensitivity.code == 0, by_sensitivity.err
    assert "sensitivity features" in by_sensitivity.out
    chosen = numscope.Plan.load(ws / "sens.yaml")
    assert chosen.average_bits(analysis_sizes(analysis)) <= 6.0
    no_budget = cli("recommend", out / "fp32" / "seed0", "-o", ws / "x.yaml", "--minimize", "sensitivity")
    default = workflow.default_budget(analysis)  # FP8 everywhere's bits: the stated default
    assert (
        no_budget.code == 0
        and f"bit budget: {default:g} bits per operand element (the default" in no_budget.out
    )
    assert numscope.Plan.load(ws / "x.yaml").average_bits(analysis_sizes(analysis)) <= default + 1e-9
    unmeasured_run = ws / "runs" / "no-sensitivity"
    plain = ("--candidates", "mxfp4_e2m1", "mxfp8_e4m3", "--every", "4", "--sensitivity", "0")
    assert cli("analyze", *flags(ws), *plain, "--out", unmeasured_run).code == 0
    assert Analysis.load(unmeasured_run / "analysis").sensitivity is None  # --sensitivity 0 skips it
    unmeasured = cli("recommend", unmeasured_run, "-o", ws / "x.yaml", "--minimize", "sensitivity", *budget)
    assert unmeasured.code == 2 and "--sensitivity-granularity operand" in unmeasured.err


def analysis_sizes(analysis: Analysis) -> dict[str, dict[tuple[str, str], int]]:
    sizes: dict[str, dict[tuple[str, str], int]] = {}
    for (site, gemm, operand), count in analysis.elements.items():
        sizes.setdefault(site, {})[(gemm, operand)] = int(count)
    return sizes


def test_train_runs_under_the_plan_and_under_a_preset(ws: Path, flow: dict[str, Result]) -> None:
    planned = json.loads((ws / "runs" / "planned" / "result.json").read_text())
    fp16 = json.loads((ws / "runs" / "fp16-scaled" / "result.json").read_text())
    assert planned["plan"] == str((ws / "plan.yaml").resolve()) and planned["loss_scaling"] == "none"
    plan_bits = [
        numscope.get_format(r.format).bits_per_element
        for r in Plan.load(ws / "plan.yaml").describe()
        if r.format != HIGH
    ]
    assert min(plan_bits) <= planned["avg_bits"] < 32
    assert fp16["avg_bits"] == numscope.get_format("fp16").bits_per_element
    assert fp16["loss_scaling"] == "dynamic" and fp16["final_scale"] > 1
    for name in ("planned", "fp16-scaled"):
        folder = ws / "runs" / name
        assert not (folder / "checkpoint.pt").exists()  # removed once the run finished
        trained = numscope.load_checkpoint(folder / "model.pt")["model"]
        from transformers import BertConfig, BertForMaskedLM

        torch.manual_seed(0)
        fresh = BertForMaskedLM(
            BertConfig(vocab_size=trained["bert.embeddings.word_embeddings.weight"].shape[0], **TINY_BERT)
        ).state_dict()
        assert trained.keys() == fresh.keys()
        assert not torch.equal(
            trained["bert.encoder.layer.0.output.dense.weight"],
            fresh["bert.encoder.layer.0.output.dense.weight"],
        )


def test_compare_tabulates_the_runs_against_a_baseline(ws: Path, flow: dict[str, Result]) -> None:
    results = {
        n: json.loads((ws / "runs" / n / "result.json").read_text())
        for n in ("fp32", "planned", "fp16-scaled")
    }
    for output, baseline in ((flow["compare"].out, "fp32"), (flow["compare_planned"].out, "planned")):
        lines = [line for line in output.splitlines() if line.startswith("| ")]
        header = [cell.strip() for cell in lines[0].strip("|").split("|")]
        assert header[5] == f"gap to {baseline}"
        rows = {
            cells[0]: cells
            for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])
        }
        assert set(rows) == set(results)
        base = results[baseline]["val_loss"]
        for name, result in results.items():
            gap = "baseline" if name == baseline else f"{100 * (result['val_loss'] - base) / base:+.2f}%"
            assert rows[name][3] == f"{result['val_loss']:.4f}" and rows[name][5] == gap
            assert rows[name][6] == f"{result['avg_bits']:.2f}" and rows[name][7] == str(
                result["skipped_steps"]
            )


def test_report_is_one_html_file_with_every_run(ws: Path, flow: dict[str, Result]) -> None:
    html = (ws / "report.html").read_text()
    assert "data:image/png;base64," in html
    for name in ("fp32", "planned", "fp16-scaled"):
        assert name in html
    assert "bert.encoder.layer.0.attention.self.query" in html  # the plan and the analysis, per site
    assert "val MLM loss (nats)" in html


def test_a_rerun_reuses_the_finished_run_and_refuses_other_settings(
    ws: Path, flow: dict[str, Result]
) -> None:
    again = cli("train", *flags(ws), "--plan", ws / "plan.yaml", "--out", ws / "runs" / "planned")
    assert again.code == 0 and again.out == flow["planned"].out  # the stored result, wall time included
    changed = cli("train", *flags(ws, steps=5), "--plan", ws / "plan.yaml", "--out", ws / "runs" / "planned")
    assert changed.code == 2
    assert "already holds a run with other settings (train.steps: 4 → 5)" in changed.err


# ------------------------------------------------------------------------------------- models and resume
def test_builtin_gpt2_trains_as_a_causal_lm(ws: Path) -> None:
    out = ws / "runs" / "gpt2"
    result = cli("train", *flags(ws, "tiny-gpt2"), "--plan", "bf16", "--out", out)
    assert result.code == 0, result.err
    assert json.loads((out / "run.json").read_text())["objective_resolved"] == "clm"
    loss = json.loads((out / "result.json").read_text())["val_loss"]
    assert math.isfinite(loss) and loss < math.log(200) + 1  # per next token, over at most 200 tokens
    assert cli("report", out, "-o", ws / "gpt2.html").code == 0
    html = (ws / "gpt2.html").read_text()
    assert "val causal LM loss" in html and "MLM" not in html


def test_a_grouped_query_attention_llama_config_is_analyzed_and_trained(ws: Path) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config.to_json_file(ws / "llama_gqa.json")
    out = ws / "runs" / "llama_gqa"
    result = cli("analyze", *flags(ws, ws / "llama_gqa.json"), "--out", out)
    assert result.code == 0, result.err
    assert "model.layers.0.self_attn.scores" in (out / "analysis" / "analysis.json").read_text()
    result = cli(
        "train", *flags(ws, ws / "llama_gqa.json"), "--plan", "fp8", "--out", ws / "runs" / "llama_fp8"
    )
    assert result.code == 0, result.err
    assert math.isfinite(json.loads((ws / "runs" / "llama_fp8" / "result.json").read_text())["val_loss"])


@pytest.mark.parametrize("model", ["bert", "llama_gqa"])
def test_every_recommended_plan_exports_and_a_target_plan_exports_whole(
    ws: Path, model: str, tmp_path: Path
) -> None:
    """analyze → recommend → export on the tool's own outputs: the default plan exports to every stack
    (what a stack cannot run is listed, exit 0); a plan made with --target exports with nothing listed."""
    from transformers import LlamaConfig

    if model == "llama_gqa":
        config = LlamaConfig(
            vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        config.to_json_file(ws / "llama_gqa_targets.json")
        spec = ws / "llama_gqa_targets.json"
    else:
        spec = ws / "bert.json"
    out = ws / "runs" / f"targets_{model}"
    formats = ["bf16", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3@rceil", "nvfp4", "int8", "mxfp6_e3m2"]
    # a vocabulary TE's GEMMs take (a multiple of 16) where the config's own (30522, 200) is not: the plan
    # quantizes the output layer, so only the model the run trained exports it whole (--model RUN)
    result = cli(
        "analyze",
        *flags(ws, spec, vocab_size=112, cache=tmp_path),
        "--candidates",
        *formats,
        "--every",
        "2",
        "--out",
        out,
    )
    assert result.code == 0, result.err
    settings = json.loads((out / "run.json").read_text())
    assert settings["vocab_size_built"] == 112 and settings["model_path"] == str(spec.resolve())
    plain = cli("recommend", out, "-o", ws / f"{model}_plain.yaml")
    assert plain.code == 0, plain.err
    # no flag: the measured sensitivity within FP8 everywhere's bits, said so
    assert "objective: sensitivity" in plain.out and "(the default; --bit-budget" in plain.out
    no_limits = ["--criterion", "min_sqnr_db=none", "--criterion", "max_underflow_pct=none"]
    no_limits += ["--criterion", "max_overflow_pct=none", "--criterion", "max_be_ratio=none"]
    for target in ("torchao", "te", "megatron"):
        exported = cli("export", ws / f"{model}_plain.yaml", "--to", target, "--model", spec, "--out",
                       ws / f"{model}_plain_{target}")  # fmt: skip
        assert exported.code == 0, exported.err
        budget = "14" if model == "bert" else "16"  # the least a te plan needs here, the output layer low
        tight = [[*no_limits, "--bit-budget", budget]] if target == "te" else []
        for extra in ([], [*no_limits, "--bit-budget", "31"], *tight):
            plan_path = ws / f"{model}_{target}_{'_'.join(extra[-1:])}.yaml"
            made = cli("recommend", out, "-o", plan_path, "--target", target, *extra)
            assert made.code == 0, made.err
            assert f"export: numscope export {plan_path} --to {target} --model {out} --out DIR" in made.out
            exported = cli("export", plan_path, "--to", target, "--model", out, "--out", ws / f"x_{target}")
            assert exported.code == 0, exported.err
            assert "cannot express" not in exported.out, exported.out
            plan = Plan.load(plan_path)
            scores = [name for name in Analysis.load(out / "analysis").sites() if name.endswith(".scores")]
            assert scores and all(plan.for_site(name).is_high for name in scores)  # no stack converts them
        head = "cls.predictions.decoder" if model == "bert" else "lm_head"
        if target == "te":  # at that budget the output layer is low (and exported whole above); the config
            assert not plan.for_site(head).is_high  # alone builds a vocabulary TE's GEMMs do not take
            exported = cli("export", plan_path, "--to", target, "--model", spec, "--out", ws / "x_spec")
            assert exported.code == 0 and f"{head}" in exported.out, exported.out


def test_export_from_a_run_folder_whose_model_is_gone_says_so(ws: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"model": "moved/config.json", "data": {"vocab_size": 112}}))
    result = cli("export", "fp8", "--to", "te", "--model", run, "--out", tmp_path / "x")
    assert result.code == 2
    assert "the model its run.json records, 'moved/config.json', is not found from here" in result.err
    (run / "run.json").write_text(json.dumps({"kind": "train"}))
    result = cli("export", "fp8", "--to", "te", "--model", run, "--out", tmp_path / "x")
    assert result.code == 2 and "records no model and vocabulary size" in result.err


def test_analyze_measures_the_sensitivity_on_an_early_checkpoint_too(ws: Path, tmp_path: Path) -> None:
    out = tmp_path / "early"
    args = ["analyze", *flags(ws), "--candidates", "mxfp4_e2m1", "--every", "2", "--sensitivity", "1"]
    result = cli(*args, "--sensitivity-early", "2", "--out", out)
    assert result.code == 0, result.err
    early = numscope.load_checkpoint(out / "model_early.pt")
    assert early["step"] == 2 and json.loads((out / "run.json").read_text())["sensitivity_early"] == 2
    trained = numscope.load_checkpoint(out / "model.pt")["model"]
    assert any(not torch.equal(early["model"][k], trained[k]) for k in trained)  # two other models
    measured = Analysis.load(out / "analysis").sensitivity
    assert measured.meta["checkpoints"] == 2 and measured.meta["normalized_by"] == "mxfp4_e2m1"
    power = sum(m["mxfp4_e2m1"]["grad_rel_error"] ** 2 for m in measured.results.values())
    assert power == pytest.approx(2.0)  # each checkpoint weighs 1 in the format it is normalised by
    # calibrate fits its sensitivity gap model on the combined sensitivity
    calibrated = cli(
        "calibrate", *flags(ws), "--seed-list", "0", "1", "--sensitivity", "1", "--sensitivity-early", "2",
        "--out", tmp_path / "calibration",
    )  # fmt: skip
    assert calibrated.code == 0, calibrated.err
    first = Analysis.load(tmp_path / "calibration" / "fp32" / "seed0" / "analysis").sensitivity
    assert first.meta["checkpoints"] == 2 and "S(fprop)" in calibrated.out
    refusals = [
        (["--steps", "4", "--sensitivity-early", "4"], "a step from 1 to 3 (--steps 4)"),
        (
            ["--sensitivity", "0", "--sensitivity-early", "2"],
            "--sensitivity-early: it measures the sensitivity: it needs --sensitivity >= 1",
        ),
    ]
    for bad, why in refusals:
        refused = cli(*args, *bad, "--out", tmp_path / "bad")
        assert refused.code == 2 and why in refused.err, refused.err
    for bad in ("0", "never", "-3"):
        refused = cli(*args, "--sensitivity-early", bad, "--out", tmp_path / "bad")
        assert refused.code == 2 and "expected a step (an integer >= 1), auto or off" in refused.err


def test_analyze_measures_an_early_model_on_auto_where_the_run_is_long_enough(
    ws: Path, tmp_path: Path
) -> None:
    from numscope.run.runner import AUTO_EARLY_MIN_STEPS, AUTO_SENSITIVITY_EARLY

    base = ["analyze", "--candidates", "mxfp4_e2m1", "--sensitivity", "1", "--sensitivity-early", "auto"]
    long = flags(ws, steps=AUTO_EARLY_MIN_STEPS, batch_size=2, eval_every=50, checkpoint_every=50)
    assert cli(*base, *long, "--every", "50", "--out", tmp_path / "long").code == 0
    settings = json.loads((tmp_path / "long" / "run.json").read_text())
    assert settings["sensitivity_early"] == AUTO_SENSITIVITY_EARLY
    assert Analysis.load(tmp_path / "long" / "analysis").sensitivity.meta["checkpoints"] == 2
    short = flags(ws, steps=AUTO_EARLY_MIN_STEPS - 1, batch_size=2, eval_every=50, checkpoint_every=50)
    assert cli(*base, *short, "--every", "50", "--out", tmp_path / "short").code == 0
    assert "sensitivity_early" not in json.loads((tmp_path / "short" / "run.json").read_text())
    assert not (tmp_path / "short" / "model_early.pt").exists()
    off = cli(*base, *long, "--every", "50", "--sensitivity-early", "off", "--out", tmp_path / "off")
    assert off.code == 0 and not (tmp_path / "off" / "model_early.pt").exists()  # the last flag wins
    unasked = cli(*base[:-2], *long, "--every", "50", "--out", tmp_path / "unasked")  # off by default
    assert unasked.code == 0 and not (tmp_path / "unasked" / "model_early.pt").exists()


def test_train_under_a_named_recipe_gives_it_the_models_sites(ws: Path) -> None:
    out = ws / "runs" / "te_nvfp4"
    result = cli("train", *flags(ws), "--plan", "te_nvfp4", "--out", out)
    assert result.code == 0, result.err
    plan = Plan.load(out / "plan.yaml")
    assert plan.for_site("cls.predictions.decoder").operand("fprop", "input").format == "bf16"
    assert (
        plan.for_site("bert.encoder.layer.0.attention.self.query").operand("fprop", "weight").format
        == "nvfp4@2d@nan"
    )
    assert math.isfinite(json.loads((out / "result.json").read_text())["val_loss"])
    # resolved once: run.json records the very plan that trained (the BF16 head included), and a rerun
    # with the same flags finds the same settings (the finished run is returned, not refused)
    assert json.loads((out / "run.json").read_text())["plan"] == plan.to_dict()
    again = cli("train", *flags(ws), "--plan", "te_nvfp4", "--out", out)
    assert again.code == 0, again.err
    bad = cli("train", *flags(ws), "--plan", "te_fp8", "--out", ws / "runs" / "bad")
    assert bad.code == 2 and "unknown preset or recipe 'te_fp8'" in bad.err


def test_factories_from_a_file_and_from_a_module(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from_file = cli(
        "train",
        *flags(ws, f"{ws / 'cli_models.py'}:gpt2_config"),
        "--plan",
        "fp32",
        "--out",
        ws / "runs" / "factory-config",
    )
    assert from_file.code == 0, from_file.err
    assert (
        json.loads((ws / "runs" / "factory-config" / "run.json").read_text())["objective_resolved"] == "clm"
    )
    monkeypatch.chdir(ws)  # a module next to the user imports, as with `python -m`
    from_module = cli(
        "train", *flags(ws, "cli_models:bert"), "--plan", "fp32", "--out", ws / "runs" / "factory-module"
    )
    assert from_module.code == 0, from_module.err
    assert (
        json.loads((ws / "runs" / "factory-module" / "run.json").read_text())["objective_resolved"] == "mlm"
    )


def test_a_crashed_run_resumes_to_the_same_parameters(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = f"{ws / 'cli_models.py'}:stopping"
    whole = cli("train", *flags(ws, model), "--plan", "fp8", "--out", ws / "runs" / "whole")
    assert whole.code == 0, whole.err
    folder = ws / "runs" / "resumed"
    monkeypatch.setenv("NUMSCOPE_TEST_STOP", "1")
    with pytest.raises(RuntimeError, match="the machine went away"):  # not a user error: it propagates
        cli("train", *flags(ws, model), "--plan", "fp8", "--out", folder)
    monkeypatch.delenv("NUMSCOPE_TEST_STOP")
    assert (folder / "checkpoint.pt").is_file() and not (folder / "result.json").exists()
    unfinished = cli("compare", folder)
    assert unfinished.code == 2 and "has not finished" in unfinished.err
    resumed = cli("train", *flags(ws, model), "--plan", "fp8", "--out", folder)
    assert resumed.code == 0, resumed.err
    first = numscope.load_checkpoint(ws / "runs" / "whole" / "model.pt")["model"]
    second = numscope.load_checkpoint(folder / "model.pt")["model"]
    assert all(torch.equal(first[name], second[name]) for name in first)
    with (folder / "log.csv").open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------- the study
def test_study_prints_the_table_and_writes_png_and_csv(tmp_path: Path) -> None:
    from numscope.study import read_csv

    result = cli(
        "study",
        "--out",
        tmp_path,
        "--dofs",
        "3",
        "inf",
        "--formats",
        "int8",
        "fp8_e4m3",
        "--size",
        "32",
        "--trials",
        "1",
    )
    assert result.code == 0, result.err
    assert "int8 per tensor" in result.out and "fp8_e4m3" in result.out
    rows = read_csv(tmp_path / "backward_error_study.csv")
    assert {(r.dof, r.format) for r in rows} == {
        (d, f) for d in (3.0, math.inf) for f in ("int8 per tensor", "fp8_e4m3")
    }
    for row in rows:
        assert f"{row.mean:.3e}" in result.out
    assert (tmp_path / "backward_error_study.png").read_bytes().startswith(b"\x89PNG")


# ------------------------------------------------------------------------------------------------ errors
def _plan_file(ws: Path, name: str, text: str) -> Path:
    path = ws / name
    path.write_text(text)
    return path


ERRORS = {
    **(
        {}
        if torch.cuda.is_available()
        else {
            "a gpu asked for where there is none": (
                lambda ws: ["forecast", *flags(ws), "--device", "cuda", "--out", ws / "e"],
                "--device: 'cuda' asks for a GPU, but torch",
            )
        }
    ),
    "missing text": (
        lambda ws: ["train", *flags(ws, text=ws / "nope.txt"), "--plan", "fp8", "--out", ws / "e"],
        "--text {ws}/nope.txt: no such file",
    ),
    "text is a folder": (
        lambda ws: ["train", *flags(ws, text=ws), "--plan", "fp8", "--out", ws / "e"],
        "is a directory, not a file",
    ),
    "missing model path": (
        lambda ws: ["train", *flags(ws, ws / "nowhere/"), "--plan", "fp8", "--out", ws / "e"],
        "no such file or directory; use a checkpoint folder",
    ),
    "hub name offline": (
        lambda ws: ["train", *flags(ws, "bert-base-uncased"), "--plan", "fp8", "--out", ws / "e"],
        "cannot be fetched with HF_HUB_OFFLINE=1; use a checkpoint folder",
    ),
    "folder without config.json": (
        lambda ws: ["train", *flags(ws, ws / "cache"), "--plan", "fp8", "--out", ws / "e"],
        "the directory holds no config.json",
    ),
    "json that is no config": (
        lambda ws: [
            "train",
            *flags(ws, _plan_file(ws, "x.json", '{"a": 1}')),
            "--plan",
            "fp8",
            "--out",
            ws / "e",
        ],
        "not a usable transformers config",
    ),
    "missing module": (
        lambda ws: ["train", *flags(ws, "no_such_module_xyz:make"), "--plan", "fp8", "--out", ws / "e"],
        "cannot import 'no_such_module_xyz': ModuleNotFoundError",
    ),
    "missing factory": (
        lambda ws: ["train", *flags(ws, f"{ws}/cli_models.py:nothing"), "--plan", "fp8", "--out", ws / "e"],
        "has no attribute 'nothing'; its callables: ",
    ),
    "factory raises": (
        lambda ws: ["train", *flags(ws, f"{ws}/cli_models.py:broken"), "--plan", "fp8", "--out", ws / "e"],
        "the factory raised RuntimeError: no weights here",
    ),
    "factory returns no model": (
        lambda ws: ["train", *flags(ws, f"{ws}/cli_models.py:number"), "--plan", "fp8", "--out", ws / "e"],
        "the factory returned a int; it must return",
    ),
    "vocabulary too small": (
        lambda ws: ["train", *flags(ws, f"{ws}/cli_models.py:small"), "--plan", "fp8", "--out", ws / "e"],
        "the model embeds 10 token ids but the tokenizer",
    ),
    "objective unknown": (
        lambda ws: ["train", *flags(ws, f"{ws}/cli_models.py:plain"), "--plan", "fp8", "--out", ws / "e"],
        "cannot tell whether a Plain is a masked or a causal LM",
    ),
    "not a language model": (
        lambda ws: [
            "train",
            *flags(ws, f"{ws}/cli_models.py:plain"),
            "--task",
            "mlm",
            "--plan",
            "fp8",
            "--out",
            ws / "e",
        ],
        "failed with TypeError",
    ),
    "objective without head": (
        lambda ws: [
            "train",
            *flags(ws, "tiny-gpt2"),
            "--task",
            "mlm",
            "--plan",
            "fp8",
            "--out",
            ws / "e",
        ],
        "no mlm head for model type 'gpt2'",
    ),
    "mask probability for a causal LM": (
        lambda ws: [
            "train",
            *flags(ws, "tiny-gpt2"),
            "--task",
            "clm",
            "--mask-probability",
            "0.3",
            "--plan",
            "fp8",
            "--out",
            ws / "e",
        ],
        "--mask-probability: mask_probability 0.3 applies to the masked LM only",
    ),
    "mask probability above 1": (
        lambda ws: ["train", *flags(ws), "--mask-probability", "1.5", "--plan", "fp8", "--out", ws / "e"],
        "--mask-probability: must be in (0, 1]; got 1.5",
    ),
    "sequence too long": (
        lambda ws: ["train", *flags(ws, seq_len=128), "--plan", "fp8", "--out", ws / "e"],
        "max_position_embeddings=64 is shorter than --seq-len 128",
    ),
    "batch too large": (
        lambda ws: ["train", *flags(ws, batch_size=100000), "--plan", "fp8", "--out", ws / "e"],
        "--batch-size: 100000 exceeds the",
    ),
    "missing plan file": (
        lambda ws: ["train", *flags(ws), "--plan", ws / "nope.yaml", "--out", ws / "e"],
        "nope.yaml: no such file (or give a preset: fp32, bf16",
    ),
    "unknown preset": (
        lambda ws: ["train", *flags(ws), "--plan", "fp9", "--out", ws / "e"],
        "unknown preset or recipe 'fp9'; did you mean 'fp8'?",
    ),
    "plan with a bad format": (
        lambda ws: [
            "train",
            *flags(ws),
            "--plan",
            _plan_file(ws, "bad.yaml", "numscope_plan: 1\ndefault: {all: fp8_e4m4}\n"),
            "--out",
            ws / "e",
        ],
        "did you mean 'fp8_e4m3'",
    ),
    "plan matching no site": (
        lambda ws: [
            "train",
            *flags(ws),
            "--plan",
            _plan_file(ws, "nosite.yaml", "numscope_plan: 1\nrules:\n- match: decoder.*\n  all: fp8_e4m3\n"),
            "--out",
            ws / "e",
        ],
        "match no site",
    ),
    "unknown candidate": (
        lambda ws: ["analyze", *flags(ws), "--candidates", "fp8_e4m4", "--out", ws / "e"],
        "--candidates: unknown format 'fp8_e4m4'; did you mean 'fp8_e4m3'",
    ),
    "missing analysis": (lambda ws: ["recommend", ws / "nowhere"], "cannot load an analysis from"),
    "unknown criterion": (
        lambda ws: ["recommend", ws / "runs" / "fp32", "-o", ws / "p.yaml", "--criterion", "max_fun=1"],
        "unknown criterion 'max_fun'; allowed: max_be_ratio",
    ),
    "recommend an unknown candidate": (
        lambda ws: ["recommend", ws / "runs" / "fp32", "-o", ws / "p.yaml", "--candidates", "fp8_e4m4"],
        "candidates: unknown format 'fp8_e4m4'; did you mean 'fp8_e4m3'",
    ),
    "recommend against an unknown reference": (
        lambda ws: ["recommend", ws / "runs" / "fp32", "-o", ws / "p.yaml", "--reference", "bogus"],
        "reference: unknown format 'bogus'; known: bf16",
    ),
    "per-operand unknown candidate": (
        lambda ws: [
            "recommend",
            ws / "runs" / "fp32",
            "-o",
            ws / "p.yaml",
            "--per-operand",
            "*/wgrad/*:candidates=fp8_e4m4",
        ],
        "per_operand '*/wgrad/*' candidates: unknown format 'fp8_e4m4'",
    ),
    "plan into a missing folder": (
        lambda ws: ["recommend", ws / "runs" / "fp32", "-o", ws / "nodir" / "plan.yaml"],
        "--output {ws}/nodir/plan.yaml: no such folder",
    ),
    "criterion that is an argument": (
        lambda ws: ["recommend", ws / "runs" / "fp32", "-o", ws / "p.yaml", "--criterion", "sensitivity=1"],
        "unknown criterion 'sensitivity'; allowed: max_be_ratio",
    ),
    "criterion per_operand": (
        lambda ws: ["recommend", ws / "runs" / "fp32", "-o", ws / "p.yaml", "--criterion", "per_operand=1"],
        "unknown criterion 'per_operand'; allowed: max_be_ratio",
    ),
    "impossible bit budget": (
        lambda ws: ["recommend", ws / "runs" / "fp32", "-o", ws / "p.yaml", "--bit-budget", "1"],
        "bit budget 1 bits/element is impossible",
    ),
    "bad per-operand": (
        lambda ws: ["recommend", ws / "runs" / "fp32", "--per-operand", "*/wgrad/*"],
        "expected GLOB:KEY=VALUE",
    ),
    "compare a missing folder": (lambda ws: ["compare", ws / "nowhere"], "nowhere: no such run folder"),
    "compare a non-run": (lambda ws: ["compare", ws / "cache"], "not a numscope run folder (no result.json)"),
    "unknown baseline": (
        lambda ws: ["compare", ws / "runs" / "fp32", "--baseline", "bf99"],
        "--baseline bf99: no such run; runs: fp32",
    ),
    "report a missing folder": (
        lambda ws: ["report", ws / "nowhere", "-o", ws / "r.html"],
        "no such run folder",
    ),
    "study format": (
        lambda ws: ["study", "--out", ws / "s", "--formats", "int9", "--size", "8"],
        "--formats: unknown format 'int9'",
    ),
    "train --out is a file": (
        lambda ws: ["train", *flags(ws), "--plan", "fp8", "--out", ws / "text.txt"],
        "--out {ws}/text.txt: it is a file, not a folder; choose another --out",
    ),
    "analyze --out under a file": (
        lambda ws: ["analyze", *flags(ws), "--out", ws / "text.txt" / "run"],
        "--out {ws}/text.txt/run: {ws}/text.txt is a file, not a folder",
    ),
    "demo --out is a file": (
        lambda ws: ["demo", "--quick", "--out", ws / "text.txt"],
        "--out {ws}/text.txt: it is a file, not a folder",
    ),
    "study --out under a file": (
        lambda ws: ["study", "--out", ws / "text.txt" / "s", "--size", "8"],
        "{ws}/text.txt is a file, not a folder",
    ),
    "report into a missing folder": (
        lambda ws: ["report", ws / "runs" / "fp32", "-o", ws / "nowhere" / "r.html"],
        "--output {ws}/nowhere/r.html: no such folder '{ws}/nowhere'; create it first",
    ),
    "recommend into a missing folder": (
        lambda ws: ["recommend", ws / "runs" / "fp32", "-o", ws / "nowhere" / "p.yaml"],
        "--output {ws}/nowhere/p.yaml: no such folder '{ws}/nowhere'; create it first",
    ),
    "report onto a folder": (
        lambda ws: ["report", ws / "runs" / "fp32", "-o", ws / "runs"],
        "--output {ws}/runs: it is a folder; give a file name",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_user_errors_are_one_clear_line_and_exit_2(
    case: str, ws: Path, flow: dict[str, Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_args, message = ERRORS[case]
    result = cli(*make_args(ws))
    assert result.code == 2, result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("numscope "), result.err
    assert message.format(ws=ws) in lines[0]
    assert not (ws / "e").exists() and not (ws / "nowhere").exists()  # nothing written elsewhere


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_folder_is_one_clear_line(ws: Path, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    result = cli("train", *flags(ws), "--plan", "fp8", "--out", locked / "run")
    assert result.code == 2 and f"--out {locked}/run: {locked} is not writable" in result.err


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux's sysfs")
@pytest.mark.parametrize("command", ["train", "demo"])
def test_an_out_folder_nothing_can_be_written_to_is_one_clear_line(ws: Path, command: str) -> None:
    """/sys takes no new folder even from root, whose permission checks pass: the folder is tried, not
    its permissions read (before, a traceback from mkdir)."""
    args = [*flags(ws), "--plan", "fp8"] if command == "train" else ["--quick"]
    result = cli(command, *args, "--out", "/sys/numscope-run")
    assert result.code == 2, result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and "--out /sys/numscope-run: cannot write there" in lines[0]


def test_evaluate_rescores_trained_models_on_more_validation_blocks(
    ws: Path, flow: dict[str, Result]
) -> None:
    runs = [ws / "runs" / "planned", ws / "runs" / "fp16-scaled"]
    own = cli("evaluate", *runs, "--val-blocks", 16)  # the runs' own --val-blocks: their own loss, exactly
    assert own.code == 0, own.err
    for run in runs:
        trained = json.loads((run / "result.json").read_text())["val_loss"]
        assert json.loads((run / "evaluations.json").read_text())["16"]["val_loss"] == trained
        assert f"| {trained:.4f} " in own.out
    fewer = cli("evaluate", *runs, "--val-blocks", 3)  # (this small text's split holds 8 blocks)
    assert fewer.code == 0, fewer.err
    for run in runs:
        scored = json.loads((run / "evaluations.json").read_text())
        assert scored["16"]["blocks"] == 8 and scored["3"]["blocks"] == 3
        assert scored["3"]["val_loss"] != scored["16"]["val_loss"]
    assert "val loss (3 blocks)" in fewer.out
    first = json.loads((runs[0] / "evaluations.json").read_text())["3"]
    (runs[0] / "evaluations.json").write_text("{torn")  # an unreadable store is scored again, not a traceback
    again = cli("evaluate", runs[0], "--val-blocks", 3)
    assert again.code == 0 and json.loads((runs[0] / "evaluations.json").read_text())["3"] == first
    not_run = cli("evaluate", ws, "--val-blocks", 16)
    assert not_run.code == 2 and "not a finished run with its trained model (missing" in not_run.err
    foreign = cli("evaluate", runs[0], "--val-blocks", 8, "--tokenizer", ws / "bert.json")
    assert foreign.code == 2 and "not the tokenizer" in foreign.err


def test_compare_says_where_runs_differ_from_the_baseline(ws: Path, flow: dict[str, Result]) -> None:
    longer = ws / "runs" / "fp8-longer"
    assert cli("train", *flags(ws, steps=6), "--plan", "fp8", "--out", longer).code == 0
    result = cli("compare", ws / "runs" / "fp32", longer)
    assert result.code == 0
    assert "warning: fp8-longer differs from the baseline fp32 in steps 6 vs 4" in result.err
    assert "its gap mixes that difference with the numerics" in result.err
    quiet = cli("compare", ws / "runs" / "fp32", ws / "runs" / "planned")
    assert quiet.code == 0 and "warning" not in quiet.err
    with pytest.warns(UserWarning, match="differs from the baseline fp32 in steps 6 vs 4"):
        workflow.compare([ws / "runs" / "fp32", longer])


def test_compare_refuses_a_gap_between_two_models(ws: Path, flow: dict[str, Result]) -> None:
    other = ws / "runs" / "gpt2-compared"
    assert cli("train", *flags(ws, "tiny-gpt2"), "--plan", "bf16", "--out", other).code == 0
    result = cli("compare", ws / "runs" / "fp32", other)
    assert result.code == 2
    assert "gpt2-compared trained the model 'tiny-gpt2', the baseline fp32" in result.err
    assert "a loss gap between different models means nothing" in result.err


def test_a_copied_run_folder_resumes_as_itself(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = f"{ws / 'cli_models.py'}:stopping"
    original = ws / "runs" / "to-copy"
    monkeypatch.setenv("NUMSCOPE_TEST_STOP", "1")
    with pytest.raises(RuntimeError, match="the machine went away"):
        cli("train", *flags(ws, model), "--plan", "fp8", "--out", original)
    monkeypatch.delenv("NUMSCOPE_TEST_STOP")
    copy = ws / "elsewhere" / "moved-run"
    shutil.copytree(original, copy)
    resumed = cli("train", *flags(ws, model), "--plan", "fp8", "--out", copy)
    assert resumed.code == 0, resumed.err
    assert json.loads((copy / "result.json").read_text())["name"] == "to-copy"
    with (copy / "log.csv").open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3, 4]


def test_public_subpackages_work_after_import_numscope() -> None:
    code = (
        "import torch, numscope; x = torch.rand(8, 32)\n"
        "print(numscope.metrics.backward_error(x, x.t(), 'fp8_e4m3', 'fp8_e4m3').mean)\n"
        "print(numscope.plan.recipes.recipes()[0].name, numscope.report.__name__, "
        "numscope.train.LossScaler)\n"
        "assert numscope.recipes is numscope.plan.recipes and numscope.export is numscope.plan.export"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    mean, names = done.stdout.strip().splitlines()
    assert 0 < float(mean) < 0.1 and names.startswith("te_delayed numscope.report")


def test_a_corrupt_result_json_is_one_clear_line(ws: Path, flow: dict[str, Result], tmp_path: Path) -> None:
    copy = tmp_path / "fp32"
    shutil.copytree(ws / "runs" / "fp32", copy)
    (copy / "result.json").write_text('{"name": "fp32", "val_lo')
    for args in (
        ["analyze", *flags(ws), "--candidates", "fp8_e4m3", "mxfp4_e2m1", "--every", "4", "--out", copy],
        ["compare", copy],
    ):
        result = cli(*args)
        assert result.code == 2, result.err
        lines = result.err.strip().splitlines()
        assert len(lines) == 1 and "result.json: not a readable run result" in lines[0], result.err


def _demo_error(out: Path, *args: object) -> str:
    result = cli("demo", "--quick", "--out", out, *args)
    assert result.code == 2, result.err
    lines = [line for line in result.err.splitlines() if line.startswith("numscope ")]
    assert len(lines) == 1 and "Traceback" not in result.err, result.err
    return lines[0]


def test_demo_on_too_little_text_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMSCOPE_CACHE", str(tmp_path / "cache"))
    one = tmp_path / "one.txt"
    one.write_text("A single paragraph of text,\nwrapped over two lines.\n")
    assert "holds 1 document(s)" in _demo_error(tmp_path / "d1", "--text", one)
    few = write_text(tmp_path / "few.txt", paragraphs=3)
    assert "fewer than one batch of 64: give more text" in _demo_error(tmp_path / "d2", "--text", few)


def test_demo_with_a_corrupt_settings_file_is_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "demo.json").write_text("{ not json")
    assert "demo.json: unreadable" in _demo_error(tmp_path)


def test_analyze_writes_the_analysis_to_tensorboard(
    ws: Path, flow: dict[str, Result], tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    copy = tmp_path / "fp32"  # a finished run: analyze returns it, and writes the scalars
    shutil.copytree(ws / "runs" / "fp32", copy)
    args = ["analyze", *flags(ws), "--candidates", "fp8_e4m3", "mxfp4_e2m1", "--every", "4", "--out", copy]
    result = cli(*args, "--tensorboard", tmp_path / "tb")
    assert result.code == 0, result.err
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    flat = Analysis.load(copy / "analysis").flat()
    assert set(events.Tags()["scalars"]) == {name for row in flat.values() for name in row}


def test_analyze_measures_operand_sensitivity_by_default(ws: Path, flow: dict[str, Result]) -> None:
    # the flow's analyze gave no --sensitivity: each operand alone, on as many of 2 validation batches as the
    # split holds (here 1), so that recommend's default objective within a budget is the measured one
    analysis = Analysis.load(ws / "runs" / "fp32" / "analysis")
    assert analysis.sensitivity is not None and analysis.sensitivity.granularity == "operand"
    assert len(analysis.sensitivity.reference_loss) == 1
    assert set(analysis.sensitivity.results) == set(analysis.keys())
    assert analysis.sensitivity.candidates == ("mxfp4_e2m1",)  # the cheapest candidate, the others estimated
    run = json.loads((ws / "runs" / "fp32" / "run.json").read_text())
    assert run["sensitivity_batches"] == "auto" and run["sensitivity_granularity"] == "operand"
    assert run["sensitivity_formats"] == ["mxfp4_e2m1"]
    budget = cli("recommend", ws / "runs" / "fp32", "-o", ws / "budget.yaml", "--bit-budget", "6")
    assert budget.code == 0, budget.err
    assert "objective: sensitivity (the analysis measured the sensitivity per operand" in budget.out
    assert "sensitivity measured in mxfp4_e2m1; bf16, fp8_e4m3 estimated from it" in budget.out
    assert "GEMM roles weighted equally (no calibration of your model" in budget.out  # where weights are from
    # a limit on measured loss change needs every candidate measured: one line saying how
    limit = cli(
        "recommend", ws / "runs" / "fp32", "-o", ws / "x.yaml", "--criterion", "max_loss_increase_pct=1"
    )
    assert limit.code == 2 and "--sensitivity-formats all" in limit.err
    both = cli("analyze", *flags(ws), "--sensitivity-formats", "all", "auto", "--out", ws / "runs" / "x")
    assert both.code == 2 and "'all' and 'auto' stand alone" in both.err
    unknown = cli(
        "analyze", *flags(ws), "--candidates", "fp8_e4m3", "--sensitivity-formats", "nvfp4", "--out", ws / "y"
    )
    assert unknown.code == 2 and "not among the observed candidates" in unknown.err


def test_analyze_measures_sensitivity_for_recommend(ws: Path, tmp_path: Path) -> None:
    run = tmp_path / "fp32"
    args = ["analyze", *flags(ws), "--candidates", "fp8_e4m3", "mxfp4_e2m1", "--every", "4", "--out", run]
    args += ["--sensitivity-formats", "all", "--sensitivity-granularity", "site"]
    result = cli(*args, "--sensitivity", 1)
    assert result.code == 0, result.err
    analysis = Analysis.load(run / "analysis")
    assert analysis.sensitivity is not None and set(analysis.sensitivity.candidates) == {
        "bf16",
        "fp8_e4m3",
        "mxfp4_e2m1",
    }
    assert (run / "model.pt").is_file()  # the trained model the sensitivity was measured on
    rows = analysis.sensitivity.table()
    assert rows and all(math.isfinite(float(row["loss_change%"])) for row in rows)
    mxfp4 = [float(r["loss_change%"]) for r in rows if r["candidate"] == "mxfp4_e2m1"]
    bf16 = [float(r["loss_change%"]) for r in rows if r["candidate"] == "bf16"]
    assert max(map(abs, mxfp4)) > max(map(abs, bf16))  # 4 bits move the loss more than 16
    plan = ws / "sensitive.yaml"
    chosen = cli("recommend", run, "-o", plan, "--criterion", "max_loss_increase_pct=0.01")
    assert chosen.code == 0, chosen.err
    assert cli(*args, "--sensitivity", 2).code == 2  # other settings than the run folder's: refused
    assert cli(*args, "--sensitivity", 1).code == 0  # finished: returned as it is
    too_many = cli("analyze", *flags(ws), "--out", tmp_path / "other", "--sensitivity", 99)
    assert too_many.code == 2, too_many.err
    assert "--sensitivity 99: the validation split holds 1 batch(es) of 8" in too_many.err
    assert not (tmp_path / "other").exists()  # refused before training


def test_analyze_without_tensorboard_stops_before_training(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    result = cli("analyze", *flags(ws), "--out", tmp_path / "run", "--tensorboard", tmp_path / "tb")
    assert result.code == 2 and "--tensorboard needs the tensorboard package" in result.err, result.err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_analyze_under_torchrun_merges_the_ranks(ws: Path, flow: dict[str, Result], tmp_path: Path, torchrun):
    """2 processes × 4 sequences: one analysis, merged over both ranks at each sampled step, written once,
    of the same operands and steps as one process on the whole batch measures."""
    args = [*flags(ws), "--candidates", "fp8_e4m3", "mxfp4_e2m1", "--every", "4"]
    run = torchrun(
        ["-m", "numscope.cli", "analyze", *args, "--out", str(tmp_path / "ddp")], timeout=300, env=ENV
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("analysis: ") == 1  # rank 0 prints
    merged = Analysis.load(tmp_path / "ddp" / "analysis")
    one = Analysis.load(ws / "runs" / "fp32" / "analysis")
    assert merged.meta["ranks"] == 2 and "ranks" not in one.meta
    assert set(merged.operands) == set(one.operands) and merged.steps == one.steps
    key = next(k for k in one.operands if k[1:] == ("fprop", "input"))
    # an activation: each rank saw half of the batch, the merge counts both halves, as one process does
    assert merged.elements[key] == one.elements[key]
    assert json.loads((tmp_path / "ddp" / "result.json").read_text())["world_size"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--loss-scaling", "sometimes"], "invalid choice: 'sometimes'"),
        (["train", "--steps", "0"], "expected an integer ≥ 1, got 0"),
        (["train", "--lr", "-1"], "expected a positive number, got '-1'"),
        (["train", "--lr", "-1e-3"], "argument --lr: expected a positive number, got '-1e-3'"),  # not a flag
        (["recommend", "x", "--max-be-ratio", "lots"], "expected a number or 'none', got 'lots'"),
        (["study", "--dofs", "-2"], "degrees of freedom must be > 0"),
        (["train", "--model", "tiny-bert"], "the following arguments are required: --text, --out, --plan"),
    ],
)
def test_bad_flags_exit_2_with_usage(args: list[str], message: str) -> None:
    result = cli(*args)
    assert result.code == 2 and message in result.err and "usage: numscope" in result.err


def test_errors_in_a_real_process_exit_2_without_traceback(ws: Path) -> None:
    result = run_cli("train", *flags(ws, "bert-base-uncased"), "--plan", "fp8", "--out", str(ws / "e"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "numscope train: error: --model bert-base-uncased: not a local path" in result.stderr


# ------------------------------------------------------------------------------------- example, torchrun
@pytest.mark.slow
def test_the_python_api_example_trains_under_its_recommended_plan(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_loop.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(line.split()[3]) for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.3
    plan = Plan.load(tmp_path / "plan.yaml")
    assert {row.format for row in plan.describe()} - {HIGH}  # some operand went below fp32


@pytest.mark.slow
def test_train_under_torchrun_is_data_parallel_over_gloo(ws: Path, tmp_path: Path, torchrun) -> None:
    """2 processes × 4 sequences against 1 process × 8, under the fp8 plan with dynamic loss scaling."""
    model = f"{ws / 'cli_models.py'}:bert"
    args = [*flags(ws, model), "--plan", "fp8", "--loss-scaling", "dynamic"]
    (tmp_path / "ddp").mkdir()
    (tmp_path / "one").mkdir()
    ddp = torchrun(
        ["-m", "numscope.cli", "train", *args, "--out", str(tmp_path / "ddp-run")],
        timeout=300,
        env={**ENV, "NUMSCOPE_TEST_PARAMETERS": str(tmp_path / "ddp")},
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert ddp.stdout.count("run folder:") == 1  # only rank 0 prints
    rank0, rank1 = (torch.load(tmp_path / "ddp" / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(rank0[name], rank1[name]) for name in rank0)
    result = json.loads((tmp_path / "ddp-run" / "result.json").read_text())
    assert result["world_size"] == 2 and result["rank_divergence"] == 0.0
    saved = numscope.load_checkpoint(tmp_path / "ddp-run" / "model.pt")["model"]
    assert all(torch.equal(saved[name], rank0[name]) for name in saved)
    with (tmp_path / "ddp-run" / "log.csv").open() as f:
        ddp_losses = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(ddp_losses) == 4  # one writer

    one = subprocess.run(
        [sys.executable, "-m", "numscope.cli", "train", *args, "--out", str(tmp_path / "one-run")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**ENV, "NUMSCOPE_TEST_PARAMETERS": str(tmp_path / "one")},
    )
    assert one.returncode == 0, one.stderr[-3000:]
    with (tmp_path / "one-run" / "log.csv").open() as f:
        one_losses = [float(r["loss"]) for r in csv.DictReader(f)]
    # the loss is weighted so that 2 ranks' gradient equals one process's on the whole batch: only fp32
    # rounding differs, which can flip fp8 elements on a rounding boundary (see tests/distributed)
    assert ddp_losses == pytest.approx(one_losses, rel=1e-4)
    alone = torch.load(tmp_path / "one" / "rank0.pt", weights_only=True)
    assert max(float((alone[name] - rank0[name]).abs().max()) for name in alone) < 5e-3


@pytest.mark.slow
def test_train_under_torchrun_shards_with_fsdp2_through_the_cli(ws: Path, tmp_path: Path, torchrun) -> None:
    """``numscope train --device cpu --parallel fsdp2`` under 2 processes (gloo): parameters, gradients and
    Adam's moments sharded, the mid-run checkpoint and model.pt gathered whole; the losses and the trained
    model are those of one process on the whole batch, to fp32 rounding (as DDP's)."""
    args = [*flags(ws), "--plan", "fp8", "--device", "cpu"]
    fsdp = torchrun(
        ["-m", "numscope.cli", "train", *args, "--parallel", "fsdp2", "--out", str(tmp_path / "fsdp")],
        timeout=300,
        env=ENV,
    )
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert fsdp.stdout.count("run folder:") == 1  # only rank 0 prints
    result = json.loads((tmp_path / "fsdp" / "result.json").read_text())
    assert result["world_size"] == 2 and result["device"] == "cpu"
    assert json.loads((tmp_path / "fsdp" / "run.json").read_text())["parallel"] == "fsdp2"
    one = cli("train", *args, "--out", tmp_path / "one")
    assert one.code == 0, one.err
    losses = {}
    for name in ("fsdp", "one"):
        with (tmp_path / name / "log.csv").open() as f:
            losses[name] = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(losses["fsdp"]) == 4 and losses["fsdp"] == pytest.approx(losses["one"], rel=1e-4)
    sharded, alone = (
        numscope.load_checkpoint(tmp_path / name / "model.pt")["model"] for name in ("fsdp", "one")
    )
    assert sharded.keys() == alone.keys()
    assert all(
        not hasattr(value, "to_local") and value.shape == alone[key].shape for key, value in sharded.items()
    )
    assert max(float((sharded[key] - alone[key]).abs().max()) for key in alone) < 5e-3

    # stopped on its 3rd step, after the checkpoint of step 2, and resumed: the sharded states reloaded
    stopping = [*flags(ws, f"{ws / 'cli_models.py'}:stopping"), "--plan", "fp8", "--parallel", "fsdp2"]
    stopped = torchrun(
        ["-m", "numscope.cli", "train", *stopping, "--out", str(tmp_path / "resumed")],
        timeout=300,
        env={**ENV, "NUMSCOPE_TEST_STOP": "1"},
    )
    assert stopped.returncode != 0 and (tmp_path / "resumed" / "checkpoint.pt").is_file()
    for name in ("resumed", "through"):
        done = torchrun(["-m", "numscope.cli", "train", *stopping, "--out", str(tmp_path / name)], env=ENV)
        assert done.returncode == 0, done.stderr[-3000:]
        with (tmp_path / name / "log.csv").open() as f:
            losses[name] = [float(r["loss"]) for r in csv.DictReader(f)]
    assert losses["resumed"] == losses["through"]


def test_demo_size_flags_reach_the_model_and_the_folder_keeps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NUMSCOPE_CACHE", str(tmp_path / "cache"))
    text = write_text(tmp_path / "text.txt", paragraphs=200)
    sizes = ["--hidden", "24", "--layers", "1", "--heads", "3", "--intermediate", "40", "--seq-len", "12"]
    sizes += ["--vocab-size", "300", "--batch-size", "4"]
    out = tmp_path / "demo"
    result = cli("demo", "--quick", "--steps", "1", "--text", text, "--out", out, *sizes)
    assert result.code == 0, result.err
    settings = json.loads((out / "demo.json").read_text())
    assert (settings["hidden"], settings["layers"], settings["heads"], settings["intermediate"]) == (
        24,
        1,
        3,
        40,
    )
    assert (settings["seq_len"], settings["vocab_size"], settings["train"]["batch_size"]) == (12, 300, 4)
    analysis = Analysis.load(out / "runs" / "fp32" / "analysis")  # the fp32 model's GEMMs, measured
    assert analysis.elements[("bert.encoder.layer.0.intermediate.dense", "fprop", "weight")] == 40 * 24
    assert not any(site.startswith("bert.encoder.layer.1.") for site, _, _ in analysis.elements)
    assert "hidden: 24 → 30" in _demo_error(out, "--steps", "1", "--text", text, "--hidden", "30", *sizes[2:])
    assert "--hidden 30 must be a multiple of --heads 4" in _demo_error(
        tmp_path / "x", "--hidden", "30", "--heads", "4"
    )
    assert "--seq-len: expected an integer ≥ 3, got 2" in _demo_error(tmp_path / "x", "--seq-len", "2")


def test_run_flags_are_the_config_dataclasses_fields_with_their_defaults_and_bounds() -> None:
    import dataclasses

    from numscope.run.config import TrainConfig
    from numscope.run.sources import DataSettings

    parser = build_parser()
    args = parser.parse_args(
        ["train", "--model", "tiny-bert", "--text", "t.txt", "--out", "o", "--plan", "fp8"]
    )
    for settings in (TrainConfig, DataSettings):
        for item in dataclasses.fields(settings):
            if "help" in item.metadata:
                assert getattr(args, item.name) == item.default, item.name
    changed = parser.parse_args(
        [
            "train",
            "--model",
            "m",
            "--text",
            "t",
            "--out",
            "o",
            "--plan",
            "fp8",
            "--lr",
            "1e-4",
            "--steps",
            "7",
        ]
    )
    assert (changed.lr, changed.steps) == (1e-4, 7)
    with contextlib.redirect_stderr(io.StringIO()) as err, pytest.raises(SystemExit):
        parser.parse_args(
            ["train", "--model", "m", "--text", "t", "--out", "o", "--plan", "p", "--seq-len", "2"]
        )
    assert "--seq-len: expected an integer ≥ 3, got 2" in err.getvalue()


def test_train_with_a_given_tokenizer_file(ws: Path, flow: dict[str, Result], tmp_path: Path) -> None:
    # the tokenizer the flow's runs trained on, given as a file: the same ids, the same blocks, the same run
    trained = sorted((ws / "cache" / "tokenizers").glob("*.json"))
    assert len(trained) == 1
    given = tmp_path / "tokenizer.json"
    given.write_bytes(trained[0].read_bytes())
    args = ["train", *flags(ws, vocab_size=8000), "--tokenizer", given, "--plan", "fp16", "--loss-scaling"]
    result = cli(*args, "dynamic", "--out", tmp_path / "given")  # --vocab-size 8000 yields to the file's
    assert result.code == 0, result.err
    ours = json.loads((tmp_path / "given" / "result.json").read_text())
    theirs = json.loads((ws / "runs" / "fp16-scaled" / "result.json").read_text())
    assert ours["val_loss"] == theirs["val_loss"] and ours["curve"] == theirs["curve"]
    run = json.loads((tmp_path / "given" / "run.json").read_text())
    from tokenizers import Tokenizer, models

    assert run["data"]["vocab_size"] == Tokenizer.from_file(str(given)).get_vocab_size() < 200
    assert len(run["data"]["tokenizer_sha256"]) == 64 and run["tokenizer_path"] == str(given.resolve())
    # evaluate finds the tokenizer file from run.json: the run's own loss at its own --val-blocks
    scored = cli("evaluate", tmp_path / "given", "--val-blocks", 16)
    assert scored.code == 0, scored.err
    assert (
        json.loads((tmp_path / "given" / "evaluations.json").read_text())["16"]["val_loss"]
        == ours["val_loss"]
    )
    # bad files: one clear line each
    missing = cli(*args, "dynamic", "--out", tmp_path / "x", "--tokenizer", tmp_path / "nope.json")
    assert missing.code == 2 and "--tokenizer" in missing.err and "no such file" in missing.err
    (tmp_path / "bad.json").write_text("{not json")
    bad = cli(*args, "dynamic", "--out", tmp_path / "x", "--tokenizer", tmp_path / "bad.json")
    assert bad.code == 2 and "not a tokenizers JSON" in bad.err and "Traceback" not in bad.err
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "plain.json"))
    plain = cli(*args, "dynamic", "--out", tmp_path / "x", "--tokenizer", tmp_path / "plain.json")
    assert plain.code == 2 and "lacks special tokens" in plain.err and "[MASK]" in plain.err


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux's sysfs")
def test_an_output_file_in_a_folder_nothing_can_be_written_to_is_one_clear_line(
    ws: Path, flow: dict[str, Result]
) -> None:
    """report -o and recommend -o into /sys: tried, not read from permissions (before, a traceback)."""
    for command, args in (
        ("report", [ws / "runs" / "fp32", "-o", "/sys/numscope.html"]),
        ("recommend", [ws / "runs" / "fp32", "-o", "/sys/numscope.yaml"]),
    ):
        result = cli(command, *args)
        assert result.code == 2, (command, result.err)
        lines = result.err.strip().splitlines()
        assert len(lines) == 1 and "/sys/numscope." in lines[0] and "cannot write into /sys" in lines[0], (
            lines
        )


def test_a_config_vocabulary_the_tokenizer_replaces_is_said(ws: Path) -> None:
    """--model config.json with vocab_size 300: the model is sized to the tokenizer trained on the text (at
    most --vocab-size 200; the toy text gives fewer), and the replacement is said (before, silently); as the
    numscope command it is one 'note:' line."""
    config = json.loads((ws / "bert.json").read_text())
    config["vocab_size"] = 300
    spec = ws / "bert_vocab300.json"
    spec.write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=r"its vocab_size 300 is replaced by the tokenizer's \d+ "):
        result = cli("train", *flags(ws, spec, steps=1), "--plan", "fp32", "--out", ws / "runs" / "vocab300")
    assert result.code == 0, result.err
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "numscope.cli", "train", *flags(ws, spec, steps=1), "--plan", "fp32",
               "--out", str(ws / "runs" / "vocab300-console")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    notes = [line for line in done.stderr.splitlines() if "vocab_size 300" in line]
    assert len(notes) == 1 and notes[0].startswith(
        f"numscope train: note: --model {spec}: its vocab_size 300 is replaced by the tokenizer's "
    ), done.stderr[-2000:]


def test_numscope_analyze_and_the_python_analyze_run_the_same_experiment_by_default() -> None:
    """With no flag, ``numscope analyze`` passes exactly the defaults of ``numscope.run.analyze`` (the
    observer's candidates and interval, and every sensitivity setting): the two run the same experiment."""
    import inspect

    from numscope.cli.runs import analyze_arguments
    from numscope.run import runner

    args = build_parser().parse_args(["analyze", "--model", "tiny-bert", "--text", "t.txt", "--out", "o"])
    given = analyze_arguments(args)
    defaults = {
        name: p.default for name, p in inspect.signature(runner.analyze).parameters.items() if name in given
    }
    assert set(defaults) == set(given)
    assert {name: tuple(v) if name == "candidates" else v for name, v in defaults.items()} == given
    config = {f: getattr(args, f) for f in ("steps", "batch_size", "lr", "seed", "eval_every")}
    assert config == {f: getattr(runner.TrainConfig(), f) for f in config}


def test_the_cli_reference_in_the_docs_is_the_parsers() -> None:
    """docs/cli.md's generated section (a section per verb, a table of its flags) equals what the parser
    generates now: a flag added, removed or reworded without regenerating the page fails here."""
    from numscope.cli.reference import current, reference, section

    page = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    assert current(page) == section(build_parser()), "run: python -m numscope.cli.reference docs/cli.md"
    generated = reference(build_parser())
    for verb in ("analyze", "forecast", "localize", "band", "train", "export"):
        assert f"### numscope {verb}\n" in generated
    assert "| `--plan` PLAN |" in generated and "`--compare` HIGH LOW" in generated
