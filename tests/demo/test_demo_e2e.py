"""`numscope demo --quick` end to end, as a user runs it (slow: about two minutes)."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from numscope.train.checkpoint import load_checkpoint


@pytest.mark.slow
def test_demo_quick_end_to_end(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NUMSCOPE_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "numscope.cli", "demo", "--quick", "--steps", "20", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    names = [
        "fp32",
        "recommended",
        "last-layers",
        "bf16",
        "fp16+scaling",
        "e5m2-grads",
        "e5m2-grads+scaling",
        "fp8",
    ]
    names += ["mxfp8", "int8", "mxfp4"]
    names += ["fp32-seed1", "fp32-seed2"]  # FP32 again from other seeds: the claims' seed noise
    names += ["recommended-seed1", "recommended-seed2"]  # the plan from those seeds: paired with them
    names += ["last-layers-seed1", "last-layers-seed2"]  # the heuristic at the plan's budget, paired too
    table = [line.split("|")[1].strip() for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[1:] == names  # the header, then one row per run in this order
    report = (out / "report.html").read_text()
    assert "data:image/png;base64," in report and 'id="claims"' in report
    assert all(f"<b>{name}</b>" in report for name in names) and "model.pt" in report
    assert (out / "plan.yaml").is_file()
    summary = json.loads((out / "summary.json").read_text())
    runs = {run["name"]: run for run in summary["runs"]}
    assert list(runs) == names
    vocab = 2000  # DemoConfig.quick(): an untrained model's loss is about ln(vocab)
    for name in names:  # every run keeps its final model, a BertForMaskedLM state dict, and no checkpoint
        folder = out / "runs" / name
        assert runs[name]["model"] == str(folder / "model.pt") and not (folder / "checkpoint.pt").exists()
        state = load_checkpoint(folder / "model.pt")["model"]
        assert state["cls.predictions.decoder.weight"].shape[0] == vocab
    first_loss = runs["fp32"]["train_log"][0]["loss"]  # step 1: the untrained model's, about ln(vocab)
    assert abs(first_loss - math.log(vocab)) < 0.5
    assert runs["fp32"]["val_loss"] < first_loss - 0.5  # the fp32 run's loss decreased
    assert runs["recommended"]["avg_bits"] < 32
    # the table's bits are the [plan] line's: both weigh the fp32 analysis's operand sizes
    stated = re.search(r"\[plan\] ([\d.]+) average bits", result.stderr + result.stdout)
    assert stated is not None and f"{runs['recommended']['avg_bits']:.2f}" == stated.group(1)
    assert len(summary["claims"]) == 7 and all(isinstance(c["held"], bool) for c in summary["claims"])
    printed = [line for line in result.stdout.splitlines() if line.startswith(("[held] ", "[NOT held] "))]
    assert printed == [f"[{'held' if c['held'] else 'NOT held'}] {c['text']}" for c in summary["claims"]]
    # a log, not a terminal: a few lines per stage, no redrawn bars (the 400-step demo wrote 660 KB of them)
    assert "\r" not in result.stderr and len(result.stdout) + len(result.stderr) < 50_000
    assert summary["unigram_loss"] < math.log(vocab)
    fp32_losses = [runs[name]["val_loss"] for name in ("fp32", "fp32-seed1", "fp32-seed2")]
    assert summary["fp32_seed_sd"] == pytest.approx(statistics.stdev(fp32_losses))
    assert len(set(fp32_losses)) == 3  # the seeds differ


def test_demo_rejects_a_missing_text_file(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "numscope.cli", "demo", "--quick", "--text", str(tmp_path / "nope.txt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "nope.txt: no such file" in result.stderr
