"""examples/family_study.py end to end on a tiny GQA Llama: calibrate, recommend, the heuristic, random and
inverse plans at the same budget, every plan trained on every seed, the table with verdicts and predictions
(the script behind docs/results/plan-study.md's family results)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_family_study_runs_the_default_path_and_compares_every_plan(
    tmp_path: Path, corpus: list[str]
) -> None:
    model = tmp_path / "llama.json"
    config = json.loads((ROOT / "examples" / "llama_gqa.json").read_text())
    config.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64)
    model.write_text(json.dumps(config))
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(corpus[:200]))
    out = tmp_path / "study"
    command = [
        sys.executable, str(ROOT / "examples" / "family_study.py"), "--model", str(model),
        "--task", "clm", "--text", str(text), "--vocab-size", "300", "--seq-len", "32",
        "--batch-size", "4", "--steps", "4",
        "--seeds", "0", "1", "2", "--calibrate-seeds", "0", "1", "--random-plans", "1", "--also", "fp8_e4m3",
        "--sensitivity-early", "2", "--eval-blocks", "8", "--shuffled", "1", "--jobs", "2", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NUMSCOPE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=1500, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    result = json.loads((out / "family_study.json").read_text())
    names = {row["name"] for row in result["rows"]}
    assert {"fp32", "numscope@6", "last layers@6", "first/last layers@6", "random 1@6", "inverse@6"} <= names
    # the control: numscope's formats in other places, at its very bits
    rows = {row["name"]: row for row in result["rows"]}
    assert rows["numscope shuffled 1@6"]["family"] == "control"
    assert rows["numscope shuffled 1@6"]["bits"] == pytest.approx(rows["numscope@6"]["bits"], abs=1e-9)
    assert rows["numscope shuffled 1@6"]["formats"] == rows["numscope@6"]["formats"]
    for row in result["rows"]:
        assert len(row["gaps"]) == 3  # paired with FP32 on every seed
        if row["family"] != "reference":
            assert abs(row["bits"] - 6.0) < 0.1, row  # every plan at the same budget
            assert row["vs_numscope"] in ("same", "tie", "better", "worse"), row
    assert (out / "calibrate" / "gap_model.json").is_file()
    calibrated = json.loads((out / "calibrate" / "gap_model.json").read_text())
    assert calibrated["seeds"] == [0, 1] and calibrated["also"] == ["fp8_e4m3"]
    table = (out / "family_study.md").read_text()
    assert "gap models calibrated on seeds 0 1" in table and "| numscope@6 | numscope | 6.00 |" in table
    # the early checkpoint measured too, and every gap from the losses numscope evaluate scored
    analysis = json.loads((out / "calibrate" / "fp32" / "seed0" / "run.json").read_text())
    assert analysis["sensitivity_early"] == 2 and "losses on up to 8 validation blocks" in table
    # the calibration runs scored as the plans are: on the same blocks, once, after the last step
    calibration = json.loads((out / "calibrate" / "mxfp4_wgrad_only" / "seed1" / "run.json").read_text())
    assert calibration["data"]["val_blocks"] == 8 and calibration["train"]["eval_every"] == 4

    def scored(name: str) -> float:
        return json.loads((out / "runs" / name / "seed1" / "evaluations.json").read_text())["8"]["val_loss"]

    fp32, ours = scored("fp32"), scored("numscope@6")
    row = next(r for r in result["rows"] if r["name"] == "numscope@6")
    assert row["gaps"][1] == ours - fp32


def test_the_bert_example_config_is_the_demos_model() -> None:
    """examples/bert_demo.json (docs/results/plan-study.md's BERT through the CLI) has the demo's shape."""
    from numscope.run.experiment import Experiment
    from numscope.study import PlanStudyConfig

    config = json.loads((ROOT / "examples" / "bert_demo.json").read_text())
    demo = Experiment()
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (
        demo.hidden,
        demo.layers,
        demo.heads,
    )
    assert (
        config["intermediate_size"] == demo.intermediate and config["max_position_embeddings"] == demo.seq_len
    )
    # examples/bert_study.json: the same model at the plan study's 128-token blocks
    study = json.loads((ROOT / "examples" / "bert_study.json").read_text())
    assert study == {**config, "max_position_embeddings": PlanStudyConfig().seq_len}
    assert config["hidden_dropout_prob"] == config["attention_probs_dropout_prob"] == demo.dropout
