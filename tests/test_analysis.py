"""Analysis: flat names, summary, save/load round trip, clear errors for bad files, merging."""

from __future__ import annotations

import csv
import json
import math
import sys

import pytest
import torch

from numscope.analysis import Analysis, AnalysisError, OperandRecord, Sensitivity, merge
from numscope.metrics.stats import log2_histogram

SITE = "bert.encoder.layer.0.attention.self.query"
KEY = (SITE, "wgrad", "grad_output")


def small_analysis(scale: float = 1.0, sampled: int = 100) -> Analysis:
    analysis = Analysis(candidates=("bf16", "mxfp8_e4m3"))
    analysis.operands[KEY] = {
        step: OperandRecord(
            {"amax": 2.0 * scale + step, "rms": 0.5},
            {
                "bf16": {"sqnr_db": 50.0 + step, "underflow%": 0.0},
                "mxfp8_e4m3": {"sqnr_db": 30.0 - step, "underflow%": 1.5 * scale * (step + 1)},
            },
            sampled,
            4096,
        )
        for step in (0, 10)
    }
    analysis.elements[KEY] = 4096
    analysis.histograms[KEY] = log2_histogram(torch.tensor([0.0, 1.0, 3.0, -0.25]) * scale)
    analysis.backward_errors[(SITE, "wgrad")] = {
        ("mxfp8_e4m3", "fp32"): {
            0: {"mean": 1e-3, "p99": 4e-3, "max": 9e-3},
            10: {"mean": 2e-3, "p99": 5e-3, "max": 8e-3},
        },
    }
    analysis.meta["every"] = 10
    return analysis


def test_flat_names_are_legible():
    row = small_analysis().flat()[10]
    assert row[f"{SITE}/wgrad/grad_output/mxfp8_e4m3/underflow%"] == 16.5
    assert row[f"{SITE}/wgrad/grad_output/amax"] == 12.0
    assert row[f"{SITE}/wgrad/be/mxfp8_e4m3*fp32/p99"] == 5e-3


def test_operand_sizes_are_the_plans_weights_by_site():
    analysis = small_analysis()
    analysis.elements[(SITE, "fprop", "input")] = 1024
    assert analysis.operand_sizes() == {SITE: {("wgrad", "grad_output"): 4096, ("fprop", "input"): 1024}}


def test_summary_aggregates_over_steps():
    summary = small_analysis().summary()
    entry = summary[f"{SITE}/wgrad/grad_output/mxfp8_e4m3/sqnr_db"]
    assert entry == {"mean": 25.0, "min": 20.0, "max": 30.0, "steps": 2.0}
    assert summary[f"{SITE}/wgrad/be/mxfp8_e4m3*fp32/max"]["max"] == 9e-3


def test_save_load_round_trip(tmp_path):
    analysis = small_analysis()
    analysis.operands[KEY][0].metrics["bf16"]["sqnr_db"] = math.inf  # exact: infinite SQNR survives JSON
    analysis.save(tmp_path / "run")
    again = Analysis.load(tmp_path / "run")
    assert again == analysis
    assert again.steps == [0, 10]
    with open(tmp_path / "run" / "analysis.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["step"] for r in rows] == ["0", "10"]
    assert float(rows[1][f"{SITE}/wgrad/grad_output/mxfp8_e4m3/underflow%"]) == 16.5
    assert not [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]  # no temporaries


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(AnalysisError, match="directory does not exist"):
        Analysis.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AnalysisError, match=r"no analysis\.json in it"):
        Analysis.load(tmp_path / "empty")
    small_analysis().save(tmp_path / "bad")
    path = tmp_path / "bad" / "analysis.json"
    path.write_text(path.read_text()[:200])
    with pytest.raises(AnalysisError, match="not valid JSON"):
        Analysis.load(tmp_path / "bad")
    path.write_text(json.dumps({"numscope_analysis": 99}))
    with pytest.raises(AnalysisError, match="not a numscope analysis of version 1"):
        Analysis.load(tmp_path / "bad")
    path.write_text(json.dumps({"numscope_analysis": 1, "candidates": [], "operands": [{"site": "x"}]}))
    with pytest.raises(AnalysisError, match="malformed analysis data: KeyError"):
        Analysis.load(path)


def test_queries_name_what_is_missing():
    analysis = small_analysis()
    with pytest.raises(AnalysisError, match="was not sampled at step 3; sampled: \\[0, 10\\]"):
        analysis.record(KEY, 3)
    with pytest.raises(AnalysisError, match="candidate 'nvfp4' was not measured"):
        analysis.metric_values(KEY, "nvfp4", "sqnr_db")
    with pytest.raises(AnalysisError, match="recorded: mxfp8_e4m3\\*fp32"):
        analysis.be_values((SITE, "wgrad"), ("bf16", "fp32"))


def test_merge_is_exact_for_fractions_maxima_and_histograms():
    one, two = small_analysis(1.0, sampled=100), small_analysis(3.0, sampled=300)
    merged = merge([one, two])
    record = merged.record(KEY, 0)
    assert record.stats["amax"] == 6.0  # max
    assert record.metrics["mxfp8_e4m3"]["underflow%"] == pytest.approx((1.5 * 100 + 4.5 * 300) / 400)
    assert record.sampled == 400 and record.elements == 8192
    assert merged.histograms[KEY] == one.histograms[KEY] + two.histograms[KEY]
    assert merged.histograms[KEY].total == 8
    assert merged.be_values((SITE, "wgrad"), ("mxfp8_e4m3", "fp32"), "max") == [9e-3, 8e-3]
    with pytest.raises(AnalysisError, match="at least one"):
        merge([])


def test_merge_weighs_each_candidate_by_the_sample_it_was_measured_on(tmp_path):
    """Element formats are measured on the element sample, block formats on a sample of whole rows: a
    merge weighs each candidate's metrics by its own sample, and the sizes survive a save."""
    one, two = small_analysis(1.0, sampled=100), small_analysis(3.0, sampled=100)
    one.operands[KEY][0].sampled_by_candidate["mxfp8_e4m3"] = 1000
    two.operands[KEY][0].sampled_by_candidate["mxfp8_e4m3"] = 3000
    record = merge([one, two]).record(KEY, 0)
    assert record.metrics["mxfp8_e4m3"]["underflow%"] == pytest.approx((1.5 * 1000 + 4.5 * 3000) / 4000)
    assert record.sample_size("mxfp8_e4m3") == 4000 and record.sample_size("bf16") == record.sampled == 200
    one.save(tmp_path)
    assert Analysis.load(tmp_path).record(KEY, 0).sample_size("mxfp8_e4m3") == 1000


def test_merged_backward_errors_weigh_each_part_by_its_entries():
    one, two = small_analysis(), small_analysis()
    one.backward_errors[(SITE, "wgrad")][("mxfp8_e4m3", "fp32")][0].update(count=10.0, excluded=5.0)
    two.backward_errors[(SITE, "wgrad")][("mxfp8_e4m3", "fp32")][0].update(
        mean=5e-3, count=30.0, excluded=0.0
    )
    stats = merge([one, two]).backward_errors[(SITE, "wgrad")][("mxfp8_e4m3", "fp32")][0]
    assert stats["mean"] == pytest.approx((1e-3 * 10 + 5e-3 * 30) / 40)
    assert stats["count"] == 40 and stats["excluded"] == 5 and stats["max"] == 9e-3


def test_tensorboard_sink_writes_every_flat_name(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # a dev dependency

    analysis = small_analysis()
    assert analysis.write_tensorboard(tmp_path / "tb") is True
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    expected = analysis.flat()
    assert set(events.Tags()["scalars"]) == {name for row in expected.values() for name in row}
    for name in events.Tags()["scalars"]:
        found = {event.step: event.value for event in events.Scalars(name)}
        want = {step: row[name] for step, row in expected.items() if name in row}
        assert found == pytest.approx(want, rel=1e-6), name  # TensorBoard stores float32


def test_tensorboard_sink_is_optional(tmp_path, monkeypatch):
    for name in [
        module for module in sys.modules if module.startswith(("tensorboard", "torch.utils.tensorboard"))
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    assert small_analysis().write_tensorboard(tmp_path / "tb") is False  # the caller is told
    assert not (tmp_path / "tb").exists()


def test_sensitivity_files_are_checked(tmp_path):
    with pytest.raises(AnalysisError, match=r"cannot load a sensitivity from .*: directory does not exist"):
        Sensitivity.load(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "sensitivity.json").write_text('{"numscope_sensitivity": 1, "candidates": []}')
    with pytest.raises(AnalysisError, match="malformed sensitivity data: KeyError"):
        Sensitivity.load(tmp_path / "bad")
    (tmp_path / "bad" / "sensitivity.json").write_text("{")
    with pytest.raises(AnalysisError, match="not valid JSON"):
        Sensitivity.load(tmp_path / "bad")
    analysis = small_analysis()
    analysis.sensitivity = Sensitivity(("bf16",), "site", [3.0], {(SITE, "*", "*"): {"bf16": {"loss": 3.5}}})
    data = analysis.to_dict()
    data["sensitivity"]["numscope_sensitivity"] = 7
    with pytest.raises(AnalysisError, match="not a numscope sensitivity of version 1"):
        Analysis.from_dict(data)
    analysis.save(tmp_path / "with")
    assert Analysis.load(tmp_path / "with") == analysis
    assert merge([analysis, small_analysis()]).sensitivity == analysis.sensitivity
