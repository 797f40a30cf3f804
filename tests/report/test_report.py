"""The HTML report: structure, embedded figures, the numbers it prints, and that it stays offline."""

from __future__ import annotations

import base64
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import numscope
from numscope.report import analysis_tables, gap_to_reference, plan_table, write_report
from numscope.report.views import format_range, short_site_names

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VOID_TAGS = {"meta", "img", "br", "hr", "link", "input", "col", "source", "wbr"}
CANDIDATES = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "mxfp8_e4m3", "mxfp4_e2m1")
SITES = (
    "bert.encoder.layer.0.attention.self.query",
    "bert.encoder.layer.0.output.dense",
    "bert.encoder.layer.1.attention.self.query",
    "bert.encoder.layer.1.output.dense",
    "cls.predictions.decoder",
)


def synthetic_runs() -> list[dict]:
    """Five runs with known final losses; the fp32 run's is 2.0 nats."""
    finals = {"fp32": 2.0, "bf16": 2.01, "fp16": 2.5, "fp16+scaling": 2.004, "mxfp4": 2.3}
    runs = []
    for index, (name, final) in enumerate(finals.items()):
        scaling = "dynamic" if name == "fp16+scaling" else "none"
        train_log = []
        scale = 2.0**16
        for step in range(1, 61):
            skipped = int(scaling == "dynamic" and step in (3, 4, 30))
            if skipped:
                scale /= 2
            elif scaling == "dynamic" and step % 20 == 0:
                scale *= 2
            loss = final + 4.0 * math.exp(-step / 15) + 0.05 * math.sin(step * (index + 1))
            train_log.append(
                {"step": step, "loss": loss, "scale": scale if scaling != "none" else 1.0, "skipped": skipped}
            )
        curve = [
            {"step": s, "val_loss": final + 4.0 * math.exp(-s / 15), "val_accuracy": 0.3 + s / 400}
            for s in (20, 40)
        ] + [{"step": 60, "val_loss": final, "val_accuracy": 0.45}]
        run = {
            "name": name,
            "plan": "fp16" if name.startswith("fp16") else name,
            "loss_scaling": scaling,
            "val_loss": final,
            "val_accuracy": 0.45,
            "skipped_steps": sum(r["skipped"] for r in train_log),
            "wall_seconds": 12.5 + index,
            "avg_bits": {"fp32": 32.0, "mxfp4": 4.25}.get(name),
            "curve": curve,
            "train_log": train_log,
        }
        if name == "fp16+scaling":
            run["underflow"] = [
                {"site": f"{site}.weight", "before%": 20.0 + i, "after%": 0.5} for i, site in enumerate(SITES)
            ]
        runs.append(run)
    return runs


def _backward_error(left: torch.Tensor, right: torch.Tensor, fmt: str) -> float:
    """Mean over outputs of |L·R − Q(L)·Q(R)| / (|L|·|R|) against a float64 product."""
    q_left, q_right = (_quantized(t, fmt, axis) for t, axis in ((left, 1), (right, 0)))
    exact = left.double() @ right.double()
    error = (exact - q_left.double() @ q_right.double()).abs()
    return float((error / (left.double().abs() @ right.double().abs())).mean())


def _quantized(tensor: torch.Tensor, fmt: str, axis: int) -> torch.Tensor:
    from numscope.formats.scaling import default_scaling

    scaling = default_scaling(numscope.get_format(fmt))
    if scaling is not None and scaling.kind == "block":
        scaling = numscope.Scaling("block", axis=axis)
    return numscope.quantize(tensor, fmt, scaling=scaling)


def synthetic_analysis():
    """A real :class:`numscope.Analysis` built through its constructor from real tensors and real casts.

    Every site's grad_output is tiny (log-normal magnitudes around 2^-26, the regime where fp16 flushes
    to zero); inputs and weights are O(1). Metrics are measured with ``numscope.quantize``.
    """
    analysis_module = pytest.importorskip("numscope.analysis", reason="numscope.analysis has not landed")
    stats = pytest.importorskip("numscope.metrics.stats", reason="numscope.metrics.stats has not landed")
    generator = torch.Generator().manual_seed(0)
    analysis = analysis_module.Analysis(candidates=CANDIDATES)
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    for index, site in enumerate(SITES):
        grad = torch.randn(64, 48, generator=generator) * 2.0 ** (-26 + 2 * index)
        grad[grad.abs() < grad.abs().quantile(0.02)] = 0.0
        tensors[(site, "grad_output")] = grad
        tensors[(site, "input")] = torch.randn(64, 32, generator=generator)
        tensors[(site, "weight")] = torch.randn(48, 32, generator=generator) * 0.05
    for site in SITES:
        for gemm, operands in (
            ("fprop", ("input", "weight")),
            ("dgrad", ("grad_output", "weight")),
            ("wgrad", ("grad_output", "input")),
        ):
            for operand in operands:
                tensor = tensors[(site, operand)]
                key = (site, gemm, operand)
                metrics = {}
                for fmt in CANDIDATES:
                    quantized = _quantized(tensor, fmt, -1)
                    nonzero = tensor != 0
                    noise = (tensor - quantized).double().pow(2).sum().clamp_min(1e-300)
                    metrics[fmt] = {
                        "underflow%": 100.0 * float(((quantized == 0) & nonzero).sum() / nonzero.sum()),
                        "overflow%": 0.0,
                        "sqnr_db": float(10 * torch.log10(tensor.double().pow(2).sum() / noise)),
                    }
                record = analysis_module.OperandRecord(
                    stats.tensor_stats(tensor), metrics, tensor.numel(), tensor.numel()
                )
                analysis.operands[key] = {10: record}
                analysis.histograms[key] = stats.log2_histogram(tensor)
                analysis.elements[key] = tensor.numel()
        grad, inputs, weight = (tensors[(site, name)] for name in ("grad_output", "input", "weight"))
        products = {"fprop": (inputs, weight.T), "dgrad": (grad, weight), "wgrad": (grad.T, inputs)}
        for gemm, (left, right) in products.items():
            analysis.backward_errors[(site, gemm)] = {
                (fmt, fmt): {10: {"mean": _backward_error(left, right, fmt), "p99": 0.0, "max": 0.0}}
                for fmt in CANDIDATES
            }
    return analysis


class _TagChecker(HTMLParser):
    """Collects attributes and checks that every non-void tag is closed in order."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.attributes: list[tuple[str, str, str]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.attributes += [(tag, name, value or "") for name, value in attrs]
        if tag not in VOID_TAGS:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def _parse(text: str) -> _TagChecker:
    checker = _TagChecker()
    checker.feed(text)
    checker.close()
    assert not checker.errors, checker.errors[:5]
    assert not checker.stack, f"unclosed tags: {checker.stack}"
    return checker


def _images(checker: _TagChecker) -> list[bytes]:
    sources = [value for tag, name, value in checker.attributes if tag == "img" and name == "src"]
    images = []
    for source in sources:
        assert source.startswith("data:image/png;base64,"), source[:60]
        images.append(base64.b64decode(source.split(",", 1)[1], validate=True))
    return images


def _offline(text: str, checker: _TagChecker) -> None:
    for _tag, name, value in checker.attributes:
        if name in ("src", "href"):
            assert not value.lower().startswith(("http://", "https://", "//")), value
    assert "<script" not in text.lower()


def test_runs_only_report_is_valid_offline_html_with_gap_figures(tmp_path: Path) -> None:
    runs = synthetic_runs()
    note = "claim X did not hold at this scale: 2.5 vs 2.0 nats"
    path = write_report(
        tmp_path / "report.html", title="runs only", runs=runs, notes=[note], command="numscope demo"
    )
    text = path.read_text(encoding="utf-8")
    checker = _parse(text)
    _offline(text, checker)
    images = _images(checker)
    assert len(images) >= 2 and all(image.startswith(PNG_SIGNATURE) for image in images)
    for run in runs:
        assert f"<b>{run['name']}</b>" in text
    # fp16 2.5 vs fp32 2.0 → +25.00%; bf16 2.01 → +0.50% (highlighted); fp16+scaling 2.004 → +0.20%
    assert re.search(r'<tr class="bad">.*?<b>fp16</b>.*?\+25\.00%', text)
    assert re.search(r'<tr class="good">.*?<b>bf16</b>.*?\+0\.50%', text)
    assert re.search(r'<tr class="good">.*?<b>fp16\+scaling</b>.*?\+0\.20%', text)
    assert re.search(r'<tr class="bad">.*?<b>mxfp4</b>.*?\+15\.00%', text)
    assert "claim X did not hold at this scale" in text and "numscope demo" in text
    assert numscope.__version__ in text
    assert not list(tmp_path.glob(".*tmp")), "the temporary file must be renamed away"


def test_a_diverged_run_shows_nan_and_no_gap(tmp_path: Path) -> None:
    runs = synthetic_runs()
    runs[2]["val_loss"] = float("nan")
    runs[2]["train_log"][-5:] = [
        {"step": s, "loss": float("nan"), "scale": 1.0, "skipped": 0} for s in range(56, 61)
    ]
    text = write_report(tmp_path / "r.html", title="t", runs=runs).read_text()
    _parse(text)
    row = re.search(r"<tr[^>]*>(?:(?!</tr>).)*<b>fp16</b>.*?</tr>", text).group(0)
    assert '<td class="num">nan</td>' in row and '<td class="num gap">—</td>' in row


def test_the_demos_runs_each_get_a_colour_a_row_and_a_legend_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numscope demo's ten runs (fp32, recommended, every baseline: the E5M2 pair, mxfp8, int8...)."""
    from numscope.demo.claims import RECOMMENDED, REFERENCE
    from numscope.demo.main import BASELINES
    from numscope.report import plots

    names = [REFERENCE.name, RECOMMENDED, *(spec.name for spec in BASELINES)]
    assert {"mxfp8", "int8"} <= set(names) and len(names) == 10
    assert len(set(plots.run_colours(names).values())) == len(names)
    template = synthetic_runs()[1]
    runs = [
        {**template, "name": name, "plan": name, "val_loss": 2.0 + index / 1000}
        for index, name in enumerate(names)
    ]
    legends: list[list[str]] = []
    real_legend = plots._unique_legend

    def recorded(fig):
        handles, labels = real_legend(fig)
        legends.append(labels)
        return handles, labels

    monkeypatch.setattr(plots, "_unique_legend", recorded)
    text = write_report(tmp_path / "r.html", title="demo runs", runs=runs, context_free_loss=2.5).read_text()
    _parse(text)
    for name in names:
        assert f"<b>{name}</b>" in text
    gap = f"+{100 * names.index('int8') / 1000 / 2.0:.2f}%"  # its loss 2.0 + index / 1000 against 2.0
    assert re.search(rf'<tr class="good">.*?<b>int8</b>.*?{re.escape(gap)}', text)
    assert legends and set(names) <= set(legends[0])


def test_a_diverging_run_leaves_the_loss_axes_to_the_others_and_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import matplotlib.pyplot as plt

    from numscope.report import plots

    runs = synthetic_runs()
    diverged = {**runs[0], "name": "int8", "plan": "int8"}  # from fp32's start up to 14 nats
    diverged["train_log"] = [{**row, "loss": 2.0 + row["step"] / 5} for row in runs[0]["train_log"]]
    diverged["curve"] = [{**point, "val_loss": 2.0 + point["step"] / 5} for point in runs[0]["curve"]]
    figures = []
    monkeypatch.setattr(plots, "_png", lambda fig, tight=True: figures.append(fig) or b"")
    plots.loss_curves([*runs, diverged], context_free_loss=4.0)
    (figure,) = figures
    try:
        train_ax, val_ax = figure.axes[:2]
        first = max(run["train_log"][0]["loss"] for run in runs)  # the highest EMA point: a run's first loss
        assert first <= train_ax.get_ylim()[1] < 8.0  # every other run whole, the diverged one cut
        assert 4.0 < val_ax.get_ylim()[1] < 8.0  # the context-free line and the other runs' curves
        for ax, last in ((train_ax, "ends at 1"), (val_ax, "ends at 14.00")):
            notes = [text.get_text() for text in ax.texts]
            assert len(notes) == 1 and notes[0].startswith("↑ int8 above the axis") and last in notes[0]
    finally:
        plt.close(figure)
    figures.clear()
    plots.loss_curves(runs)  # no run off the scale: no note
    assert not any(ax.texts for ax in figures[0].axes)
    plt.close(figures[0])


def test_a_run_from_another_seed_keeps_its_runs_colour_dashed_and_is_compared_with_fp32_from_that_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import matplotlib.pyplot as plt

    from numscope._names import parse_seed_run
    from numscope.report import plots

    names = ["fp32", "recommended", "bf16", "fp32-seed1", "recommended-seed1", "recommended-seed2", "x-seed1"]
    colours = plots.run_colours(names)
    assert colours["recommended-seed1"] == colours["recommended-seed2"] == colours["recommended"]
    assert colours["fp32-seed1"] == colours["fp32"] and colours["x-seed1"] not in (colours["fp32"],)
    assert len({colours[name] for name in ("fp32", "recommended", "bf16", "x-seed1")}) == 4
    assert parse_seed_run("recommended-seed12") == ("recommended", 12) and parse_seed_run("fp8") is None
    template = synthetic_runs()[0]

    def run(name: str, losses: list[float]) -> dict:
        curve = [{"step": 10 * (i + 1), "val_loss": v, "val_accuracy": 0.1} for i, v in enumerate(losses)]
        return {**template, "name": name, "curve": curve}

    runs = [
        run("fp32", [3.0, 2.0]),
        run("recommended", [3.03, 2.02]),
        run("fp32-seed1", [3.3, 2.2]),
        run("recommended-seed1", [3.3, 2.244]),  # 2% behind fp32-seed1, 12.2% behind fp32
    ]
    figures = []
    monkeypatch.setattr(plots, "_png", lambda fig, tight=True: figures.append(fig) or b"")
    plots.loss_curves(runs)
    (figure,) = figures
    try:
        gap_ax = figure.axes[2]
        lines = {line.get_label(): line for line in gap_ax.get_lines()}
        assert list(lines["recommended-seed1"].get_ydata()) == pytest.approx([0.0, 2.0])  # paired
        assert list(lines["recommended"].get_ydata()) == pytest.approx([1.0, 1.0])
        assert list(lines["fp32-seed1"].get_ydata()) == pytest.approx([10.0, 10.0])  # the seed noise
        assert (
            lines["recommended-seed1"].get_linestyle() == "--" and lines["recommended"].get_linestyle() == "-"
        )
    finally:
        plt.close(figure)


def test_gap_to_reference() -> None:
    assert gap_to_reference(2.02, 2.0) == pytest.approx(1.0)
    assert gap_to_reference(1.9, 2.0) == pytest.approx(-5.0)
    assert gap_to_reference(float("nan"), 2.0) is None
    assert gap_to_reference(2.0, None) is None


def test_no_fp32_run_says_so_and_empty_inputs_skip_sections(tmp_path: Path) -> None:
    runs = [
        {
            "name": "bf16",
            "plan": "bf16",
            "loss_scaling": "none",
            "val_loss": 2.0,
            "val_accuracy": 0.4,
            "skipped_steps": 0,
            "wall_seconds": 1.0,
            "avg_bits": 16.0,
        }
    ]
    text = write_report(tmp_path / "r.html", title="t", runs=runs).read_text()
    checker = _parse(text)
    assert "No run is named <code>fp32</code>" in text
    assert _images(checker) == []  # no curves, no analysis: no figures, and nothing breaks
    assert 'id="curves"' not in text and 'id="histograms"' not in text


def test_plan_table_per_site_carries_formats_bits_and_reasons() -> None:
    from numscope.plan import OperandSpec, Plan, SiteSpec

    spec = SiteSpec({("wgrad", "grad_output"): OperandSpec("fp8_e5m2")})
    plan = Plan.uniform("mxfp8").with_rule("*.decoder", spec, {"wgrad/grad_output": "underflow 0.10% <= 1%"})
    rows = plan_table(plan, SITES)
    assert len(rows) == 6 * len(SITES)
    decoder = {(r["gemm"], r["operand"]): r for r in rows if r["site"] == "cls.predictions.decoder"}
    assert decoder[("wgrad", "grad_output")]["format"] == "fp8_e5m2"
    assert decoder[("wgrad", "grad_output")]["bits"] == 8.0
    assert decoder[("wgrad", "grad_output")]["reason"] == "underflow 0.10% <= 1%"
    assert decoder[("fprop", "input")]["format"] == "high" and decoder[("fprop", "input")]["bits"] == 32.0
    query = [r for r in rows if r["site"] == SITES[0]]
    assert {r["bits"] for r in query} == {8.25}
    by_rule = plan_table(plan)
    assert {r["site"] for r in by_rule} == {"(default)", "*.decoder"}


def test_format_ranges_follow_the_scaling() -> None:
    fp16 = format_range("fp16", 1e-3, {"underflow%": 12.5})
    assert (fp16.low, fp16.low_normal, fp16.high, fp16.scaling) == (-24, -14, math.log2(65504), "none")
    assert fp16.underflow_percent == 12.5
    e4m3 = format_range("fp8_e4m3", 2.0**-20)  # per-tensor scaled: max 448 lands on amax
    assert e4m3.high == -20 and e4m3.low == pytest.approx(-20 - math.log2(448) - 9)
    int8 = format_range("int8", 1.0)
    assert int8.low == int8.low_normal == pytest.approx(-math.log2(127))
    block = format_range("mxfp4_e2m1", 4.0)
    assert (block.scaling, block.high, block.low) == ("block", 2.0, pytest.approx(2.0 - math.log2(6) - 1))
    assert format_range("plan", 1.0) is None and format_range("fp8_e4m3", None) is None


def test_short_site_names() -> None:
    short = short_site_names(SITES)
    assert short[SITES[0]] == "L0.attention.self.query"
    assert short["cls.predictions.decoder"] == "cls.predictions.decoder"
    assert short_site_names(["a.layer.0.x", "b.layer.0.x"]) == {
        "a.layer.0.x": "a.layer.0.x",
        "b.layer.0.x": "b.layer.0.x",
    }


def test_the_heatmap_adds_the_mixed_pairs_after_the_formats() -> None:
    analysis = synthetic_analysis()
    gemm_key = (SITES[0], "wgrad")
    analysis.backward_errors[gemm_key][("fp8_e5m2", "fp8_e4m3")] = {0: {"mean": 0.25}, 1: {"mean": 0.75}}
    view = analysis_tables(analysis)
    assert view.backward_error_columns == (*CANDIDATES, "fp8_e5m2×fp8_e4m3")
    assert view.backward_errors["wgrad"][SITES[0]]["fp8_e5m2×fp8_e4m3"] == pytest.approx(0.5)


def test_full_report_with_analysis_and_plan(tmp_path: Path) -> None:
    analysis = synthetic_analysis()
    view = analysis_tables(analysis)
    assert view.sites == SITES
    assert set(view.backward_errors) == {"fprop", "dgrad", "wgrad"}
    assert view.backward_error_columns == CANDIDATES
    first = view.operand(SITES[0], "wgrad", "grad_output")
    assert first.metrics["fp16"]["underflow%"] > 50  # magnitudes ~2^-26 sit below fp16's 2^-24
    assert first.metrics["bf16"]["underflow%"] == 0
    from numscope.plan import Plan

    runs = synthetic_runs()
    path = write_report(
        tmp_path / "full.html",
        title="full",
        runs=runs,
        analysis=analysis,
        plan=Plan.uniform("fp8"),
        extra_images=[
            (
                "extra figure",
                _images(_parse(write_report(tmp_path / "x.html", title="x", runs=runs).read_text()))[0],
            )
        ],
    )
    text = path.read_text()
    checker = _parse(text)
    _offline(text, checker)
    images = _images(checker)
    # curves, loss scale, heatmap, 2-3 representative histograms, 3 grids, 1 underflow chart (the run's
    # before/after: it includes the unscaled shares), 1 extra
    assert len(images) >= 10
    assert all(image.startswith(PNG_SIGNATURE) for image in images)
    for anchor in ("runs", "curves", "plan", "backward-error", "histograms", "underflow", "figures"):
        assert f'id="{anchor}"' in text and f'href="#{anchor}"' in text
    for site in SITES:
        assert site in text
    assert text.count("fp8_e5m2") >= len(SITES) * 2  # the hybrid plan's grad_output format, per site


def test_report_from_a_real_observer_on_a_tiny_bert(tmp_path: Path) -> None:
    observe = pytest.importorskip("numscope.observe", reason="the observer has not landed").observe
    from numscope.run.model import make_bert_mlm

    model = make_bert_mlm(vocab_size=64, hidden=16, layers=1, heads=2, intermediate=32, max_position=16)
    ids = torch.randint(5, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with observe(model, candidates=["bf16", "fp16", "fp8_e5m2", "mxfp4_e2m1"], every=1) as observer:
        model(input_ids=ids, labels=ids).loss.backward()
        observer.step()
    analysis = observer.analysis()
    text = write_report(
        tmp_path / "observed.html",
        title="observed",
        runs=[],
        analysis=analysis,
        plan=numscope.Plan.uniform("mxfp8"),
    ).read_text()
    checker = _parse(text)
    _offline(text, checker)
    images = _images(checker)
    assert len(images) >= 5 and all(image.startswith(PNG_SIGNATURE) for image in images)
    for anchor in ("plan", "backward-error", "histograms", "underflow"):
        assert f'id="{anchor}"' in text
    for site in analysis.sites():
        assert site in text


def test_claims_show_as_held_or_not_right_after_the_runs(tmp_path: Path) -> None:
    runs = synthetic_runs()
    notes = [
        ("plan within 1% of FP32 with fewer bits: holds", True),
        ("fp16 recovers: does NOT hold", False),
        "a plain note",
    ]
    setup = {"model": "BertForMaskedLM, 2 layers", "training": "500 steps × 16 blocks"}
    text = write_report(
        tmp_path / "r.html", title="t", runs=runs, notes=notes, context_free_loss=6.5, setup=setup
    ).read_text()
    _parse(text)
    assert '<div class="note held"><span class="badge">held</span>plan within 1%' in text
    assert '<div class="note not-held"><span class="badge">not held</span>fp16 recovers' in text
    assert '<div class="note">a plain note</div>' in text
    assert "1 of 2 claims held in this run, 1 did not" in text
    order = [text.index(f'<section id="{anchor}">') for anchor in ("runs", "claims", "curves", "setup")]
    assert order == sorted(order)
    assert "BertForMaskedLM, 2 layers" in text and "500 steps × 16 blocks" in text
    assert "The dashed line (6.500 nats)" in text


def test_a_runs_underflow_before_and_after_scaling_replaces_the_analysis_chart(tmp_path: Path) -> None:
    runs = synthetic_runs()
    scaled = next(run for run in runs if run["name"] == "fp16+scaling")
    scaled["underflow_scale"] = 2.0**16
    scaled["underflow_source"] = "per site, from the histograms"
    text = write_report(tmp_path / "r.html", title="t", runs=runs, analysis=synthetic_analysis()).read_text()
    section = re.search(r'<section id="underflow">.*?</section>', text).group(0)
    assert section.count("<img") == 1 and "fp16+scaling: per site, from the histograms." in section
    del scaled["underflow"]
    text = write_report(tmp_path / "r.html", title="t", runs=runs, analysis=synthetic_analysis()).read_text()
    section = re.search(r'<section id="underflow">.*?</section>', text).group(0)
    assert section.count("<img") == 1 and "with no loss scale" in section


def test_a_loss_scale_that_never_moved_is_a_sentence_not_a_flat_chart(tmp_path: Path) -> None:
    runs = synthetic_runs()
    scaled = next(run for run in runs if run["name"] == "fp16+scaling")
    moving = write_report(tmp_path / "a.html", title="t", runs=runs).read_text()
    assert 'alt="loss scale"' in moving
    for row in scaled["train_log"]:
        row["scale"], row["skipped"] = 2.0**16, 0
    steady = write_report(tmp_path / "b.html", title="t", runs=runs).read_text()
    assert 'alt="loss scale"' not in steady
    assert "the loss scale stayed at 2<sup>16</sup> for all 60 steps: no gradient overflowed" in steady


def test_the_loss_axis_top_leaves_out_a_diverging_run_and_survives_nan_curves() -> None:
    from numscope.report.plots import _typical_top

    drawn = [("fp32", "k", 6.0, 5.0), ("bf16", "b", 6.1, 5.0), ("int8", "r", 11.3, 11.3)]
    assert _typical_top(drawn, 4.0) == 6.1  # int8 is far above the others: named, not scaled to
    nan_first = [("fp16", "g", math.nan, math.nan), ("bf16", "b", 6.1, 5.0)]  # a curve NaN throughout
    assert _typical_top(nan_first, 4.0) == 6.1
    assert _typical_top([("fp16", "g", math.nan, math.nan)], 4.0) == 4.0
