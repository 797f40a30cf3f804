"""examples/torchrun_train.py under a real torchrun on two local CPU ranks (DDP; FSDP2 with bf16 all-gather
and the observer)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dist_worker import free_port

from numscope.analysis import Analysis

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_train.py"
TIMEOUT_S = 180


def _torchrun(*args: str) -> str:
    """Run the example on 2 ranks and return its output; kills the whole process group on a timeout."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(EXAMPLE),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun {' '.join(args)} timed out after {TIMEOUT_S}s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    return output


def _losses(output: str) -> list[float]:
    return [float(value) for value in re.findall(r"^step +\d+ +loss ([\d.]+)", output, flags=re.MULTILINE)]


@pytest.mark.slow
def test_ddp_example_keeps_the_replicas_identical() -> None:
    output = _torchrun("--steps", "3")
    assert len(_losses(output)) == 3
    assert "largest parameter difference between ranks: 0\n" in output


@pytest.mark.slow
def test_fsdp2_example_with_bf16_all_gather_and_the_observer(tmp_path: Path) -> None:
    directory = tmp_path / "analysis"
    output = _torchrun("--steps", "6", "--fsdp2", "--param-dtype", "bf16", "--analysis", str(directory))
    losses = _losses(output)
    assert len(losses) == 6 and all(loss == loss for loss in losses)  # printed once (rank 0), no NaN
    assert f"analysis merged over 2 ranks, written once: {directory}" in output
    analysis = Analysis.load(directory)
    assert analysis.meta["ranks"] == 2 and analysis.steps == [0, 5]
    assert len(analysis.keys()) > 50
