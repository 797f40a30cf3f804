"""examples/torchrun_train.py under a real torchrun on two local CPU ranks (DDP; FSDP2 with bf16 all-gather
and the observer)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from numscope.analysis import Analysis

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_train.py"


def _torchrun(torchrun, *args: str) -> str:
    """Run the example on 2 ranks and return its output (stdout and stderr)."""
    result = torchrun([str(EXAMPLE), *args], timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def _losses(output: str) -> list[float]:
    return [float(value) for value in re.findall(r"^step +\d+ +loss ([\d.]+)", output, flags=re.MULTILINE)]


@pytest.mark.slow
def test_ddp_example_keeps_the_replicas_identical(torchrun) -> None:
    output = _torchrun(torchrun, "--steps", "3")
    assert len(_losses(output)) == 3
    assert "largest parameter difference between ranks: 0\n" in output


@pytest.mark.slow
def test_fsdp2_example_with_bf16_all_gather_and_the_observer(torchrun, tmp_path: Path) -> None:
    directory = tmp_path / "analysis"
    output = _torchrun(
        torchrun, "--steps", "6", "--fsdp2", "--param-dtype", "bf16", "--analysis", str(directory)
    )
    losses = _losses(output)
    assert len(losses) == 6 and all(loss == loss for loss in losses)  # printed once (rank 0), no NaN
    assert f"analysis merged over 2 ranks, written once: {directory}" in output
    analysis = Analysis.load(directory)
    assert analysis.meta["ranks"] == 2 and analysis.steps == [0, 5]
    assert len(analysis.keys()) > 50
