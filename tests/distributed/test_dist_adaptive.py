"""Adaptive precision under DDP over gloo: every rank takes the same decisions (real processes, real
``torch.distributed``): the observer merges each sampled step across the ranks before the adapter decides."""

from __future__ import annotations

from pathlib import Path

from dist_worker import launch


def test_every_rank_takes_the_same_decisions(tmp_path: Path) -> None:
    first, second = launch("adaptive", tmp_path)
    causes = {row["cause"] for row in first["history"]}
    assert {"guard", "replan"} <= causes, first["history"]  # both kinds of decision happened
    assert first["history"] == second["history"]
    assert first["plan"] == second["plan"]
    assert first["bits"] == second["bits"]
