"""The CNN demo: scikit-learn's digits, a small CNN with BatchNorm, the runs over seeds, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from numscope.cli import main
from numscope.demo.cnn import CNNConfig, digits, small_cnn, train_one
from numscope.plan import Plan


def test_the_digits_split_and_the_cnn() -> None:
    train_x, train_y, val_x, val_y = digits()
    assert train_x.shape == (1437, 1, 8, 8) and val_x.shape == (360, 1, 8, 8) and val_y.shape == (360,)
    assert set(train_y.tolist()) == set(range(10)) and abs(train_x.mean().item()) < 1e-5
    assert small_cnn()(val_x[:4]).shape == (4, 10)


def test_a_short_run_learns_and_is_reproducible() -> None:
    data = digits()
    config = CNNConfig(steps=30, eval_every=10)
    first = train_one(Plan.uniform("fp8"), "dynamic", config, 0, data)
    again = train_one(Plan.uniform("fp8"), "dynamic", config, 0, data)
    assert first["val_loss"] == again["val_loss"]  # seeded: the same run twice
    assert first["curve"][-1]["val_loss"] < first["curve"][0]["val_loss"]
    assert first["avg_bits"] == pytest.approx(8.0) and [p["step"] for p in first["curve"]] == [10, 20, 30]


@pytest.mark.slow  # ten short runs and the report (about 15 s)
def test_the_cnn_demo_end_to_end(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--workload", "cnn", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [row["run"] for row in summary["rows"]] == ["fp32", "fp16", "fp16+scaling", "fp8", "recommended"]
    assert summary["fp32_seed_noise_nats"] > 0 and len(summary["runs"]["fp8"]) == 2
    assert all(run["val_accuracy"] > 0.8 for runs in summary["runs"].values() for run in runs)
    assert (tmp_path / "plan.yaml").is_file() and (tmp_path / "analysis" / "analysis.json").is_file()
    html = (tmp_path / "report.html").read_text()
    assert "fp16+scaling" in html and "recommended" in html
    assert "standard deviation over 2 seeds" in out and f"report: {tmp_path / 'report.html'}" in out
