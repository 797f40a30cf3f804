"""Adaptive precision under DDP and FSDP2 over gloo: every rank takes the same decisions (real processes, real
``torch.distributed``): the observer merges each sampled step across the ranks before the adapter decides."""

from __future__ import annotations

import pytest
from dist_worker import launch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return launch("adaptive", tmp_path_factory.mktemp("adaptive"))


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_every_rank_takes_the_same_decisions(ranks: list[dict], wrapper: str) -> None:
    first, second = (rank[wrapper] for rank in ranks)
    causes = {row["cause"] for row in first["history"]}
    assert {"guard", "replan"} <= causes, first["history"]  # both kinds of decision happened
    assert first["history"] == second["history"]
    assert first["plan"] == second["plan"]
    assert first["bits"] == second["bits"]
