"""Adaptive precision under DDP and FSDP2 over gloo: every rank takes the same decisions (real processes, real
``torch.distributed``): the observer merges each sampled step across the ranks before the adapter decides;
FSDP2 decides as DDP does."""

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


def test_fsdp2_takes_the_decisions_of_ddp(ranks: list[dict]) -> None:
    """The same model, batches and plan: sharding changes what each rank holds, not what is measured (a
    measurement reused from an FSDP2 parameter whose storage was freed made these differ run to run)."""
    ddp, fsdp2 = ranks[0]["ddp"], ranks[0]["fsdp2"]
    assert fsdp2["history"] == ddp["history"]
    assert fsdp2["plan"] == ddp["plan"]
