"""The benchmarks' command lines: a value they cannot run with is one argparse error line, not a crash later.

(The benchmarks themselves are not run here: they take minutes.)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

import numscope

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def rejected(capsys, module: ModuleType, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(argv)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith(f"{Path(sys.argv[0]).name}: error: argument ")
    return message


@pytest.mark.parametrize(
    ("bench", "argv", "expected"),
    [
        ("bench_train_step", ["--rounds", "0"], "--rounds: must be at least 1, got 0"),
        ("bench_accumulate", ["--rounds", "0"], "--rounds: must be at least 1, got 0"),
        ("bench_sums", ["--elements", "0"], "--elements: must be at least 1, got 0"),
        ("bench_train_step", ["--rounds", "two"], "--rounds: expected a whole number, got 'two'"),
        ("bench_train_step", ["--warmup", "-1"], "--warmup: must be at least 0, got -1"),
        ("bench_train_step", ["--threads", "0"], "--threads: must be at least 1, got 0"),
        ("bench_observer", ["--rounds", "0"], "--rounds: must be at least 1, got 0"),
        ("bench_observer", ["--every1-steps", "-1"], "--every1-steps: must be from 0 to 10, got -1"),
        ("bench_observer", ["--every1-steps", "11"], "--every1-steps: must be from 0 to 10, got 11"),
        ("bench_observer", ["--threads", "0"], "--threads: must be at least 1, got 0"),
        ("bench_observer", ["--max-elements", "0"], "--max-elements: must be at least 1, got 0"),
        ("bench_observer", ["--candidates", "fp9"], "mxfp8_e5m2, mxint8, nvfp4, tf32, or eXmY (e.g. 'e3m4')"),
        ("bench_quantize", ["--runs", "0"], "--runs: must be at least 1, got 0"),
        ("bench_quantize", ["--threads", "-2"], "--threads: must be at least 1, got -2"),
        ("bench_quantize", ["--shape", "64"], "--shape: expected ROWSxCOLS, e.g. 64x128, got '64'"),
        ("bench_quantize", ["--shape", "64x"], "--shape: expected ROWSxCOLS, e.g. 64x128, got '64x'"),
        ("bench_quantize", ["--shape", "2x3x4"], "--shape: expected ROWSxCOLS, e.g. 64x128, got '2x3x4'"),
        ("bench_quantize", ["--shape", "0x128"], "--shape: both sizes must be at least 1, got '0x128'"),
        ("demo_size", ["--mask-probability", "1.5"], "--mask-probability: must be in (0, 1], got 1.5"),
        ("demo_size", ["--lr", "0"], "--lr: must be > 0, got 0.0"),
        ("demo_size", ["--steps", "0"], "--steps: must be at least 1, got 0"),
        ("bench_default_path", ["--rounds", "0"], "--rounds: must be at least 1, got 0"),
        ("bench_default_path", ["--budget", "-1"], "--budget: must be > 0, got -1.0"),
        ("bench_default_path", ["--every", "0"], "--every: must be at least 1, got 0"),
    ],
)
def test_a_bad_argument_is_one_error_line(capsys, bench: str, argv: list[str], expected: str) -> None:
    assert rejected(capsys, load(bench), argv).endswith(expected)


def test_bench_train_step_accepts_the_smallest_run() -> None:
    args = load("bench_train_step").parse_args(["--rounds", "1", "--warmup", "0", "--threads", "1"])
    assert (args.rounds, args.warmup, args.threads) == (1, 0, 1)


def test_bench_train_step_has_a_row_for_every_preset_and_named_recipe() -> None:
    """The recipe table of docs/results/benchmarks.md comes from these rows: each preset and each named
    recipe."""
    bench = load("bench_train_step")
    rows = bench.rows()
    for recipe in numscope.Plan.recipes():
        assert callable(rows[f"recipe {recipe}"]), recipe
    for preset in numscope.Plan.presets():
        assert preset == "fp32" or f"{preset} plan" in rows or f"{preset} plan + LossScaler" in rows, preset
    args = bench.parse_args(["--size", "base", "--batch", "4"])
    assert (args.size, args.batch) == ("base", 4)
    assert bench.SIZES["demo"]["hidden"] == 128 and bench.SIZES["base"]["layers"] == 12


def test_bench_memory_names_its_rows() -> None:
    bench = load("bench_memory")
    assert bench.parse_args(["--rows", "fp32,plan fp8", "--threads", "1"]).rows == "fp32,plan fp8"
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "fp64"])
    assert bench.parse_args(["--rows", "fp32,observed", "--size", "base"]).size == "base"
    assert bench.SIZES["base"][:3] == (30522, 768, 12)  # BERT-base's vocabulary, hidden size and depth


def test_bench_quantize_parses_a_shape() -> None:
    assert load("bench_quantize").parse_args(["--shape", "64X128"]).shape == (64, 128)


def test_bench_observer_measures_the_issues_8_candidates_unless_told() -> None:
    from numscope.observe import DEFAULT_CANDIDATES

    bench = load("bench_observer")
    assert len(bench.parse_args([]).candidates) == 8
    assert bench.parse_args(["--candidates", "default"]).candidates == list(DEFAULT_CANDIDATES)
    assert bench.parse_args(["--candidates", "fp8_e4m3", "e3m4"]).candidates == ["fp8_e4m3", "e3m4"]


def test_demo_size_changes_only_the_settings_it_is_given() -> None:
    from numscope.demo.main import DemoConfig

    bench = load("demo_size")
    default = DemoConfig()
    assert bench.config_from(bench.parse_args([])) == default
    changed = bench.config_from(
        bench.parse_args(["--steps", "20", "--heads", "2", "--mask-probability", "0.2"])
    )
    assert (changed.train.steps, changed.train.eval_every, changed.heads) == (20, 20, 2)
    assert changed.train.mask_probability == 0.2 and changed.vocab_size == default.vocab_size
    from numscope.run.config import LOSS_SCALING

    assert bench.LOSS_SCALING == LOSS_SCALING
    assert bench.parse_args(["--loss-scaling", "dynamic"]).loss_scaling == "dynamic"


def test_forecast_cost_script_parses_and_says_its_usage() -> None:
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "forecast_cost.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "usage:" in done.stderr


@pytest.mark.slow
def test_the_gpu_check_runs_its_logic_on_the_cpu(tmp_path: Path) -> None:
    """``benchmarks/gpu_check.py --cpu``: every part on the CPU at small sizes (the device path against the
    native one, torchao's casts where it imports), its JSON and table written, no cast mismatch."""
    import json
    import os
    import subprocess

    peers = Path(sys.prefix) / "peers"  # torchao beside the venv (./run installs it there)
    path = os.pathsep.join(filter(None, [str(peers) if peers.is_dir() else "", os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--cpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["casts"]["compared"] > 250 and report["casts"]["mismatches"] == []
    assert {row["row"] for row in report["speed"]["rows"]} >= {"bf16 autocast", "fp8 plan", "te_nvfp4 recipe"}
    assert report["forecast"]["returncode"] == 0, report["forecast"]["tail"]
    if peers.is_dir():
        for recipe in ("torchao_tensorwise", "torchao_rowwise"):
            part = report["torchao"][recipe]
            assert part["casts_equal"] == {"input": True, "weight": True}
            assert part["gemm_error_over_bound"]["fp32"] <= 1.0
    assert (tmp_path / "gpu_check.md").read_text().startswith("# numscope GPU check")
