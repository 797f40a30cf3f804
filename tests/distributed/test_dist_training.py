"""The fp8-converted tiny BERT under DDP and FSDP2 on two gloo ranks, against one process on the whole
batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_worker import STEPS, TRAIN_STEPS, convert_fp8, full_parameters, launch, tiny_bert, train_fp8


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return launch("bert", tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def one_process() -> dict:
    model = convert_fp8(tiny_bert())
    result = train_fp8(model, STEPS, rank=0, world_size=1)
    result["parameters"] = full_parameters(model)
    return result


def _largest_difference(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> float:
    assert left.keys() == right.keys()
    return max(float((left[name] - right[name]).abs().max()) for name in left)


def test_ddp_two_ranks_equal_one_process_on_the_whole_batch(ranks: list[dict], one_process: dict) -> None:
    for result in ranks:
        run = result["ddp"]
        assert run["divergence"] == 0.0
        assert run["skipped_steps"] == one_process["skipped_steps"] == 0
        # Only fp32 rounding differs (DDP's all-reduce order; a rank's mean over its own masked tokens is not
        # exactly half of the whole batch's), but an fp8 element sitting on a rounding boundary can then flip:
        # measured 6e-8 and, after a change of the scale's rounding, 7e-4 after 3 steps. Rank-local amax
        # (below) is 3e-2, so the bound still separates the two.
        assert _largest_difference(run["parameters"], one_process["parameters"]) < 5e-3
        assert run["losses"] == pytest.approx(one_process["losses"], rel=1e-4)  # same flips, measured 4e-6


def test_rank_local_amax_breaks_the_equality(ranks: list[dict], one_process: dict) -> None:
    # Scaling(reduce_amax=False): each rank scales its own half; measured 3e-2 after 3 steps.
    run = ranks[0]["ddp_local_amax"]
    assert run["divergence"] == 0.0  # DDP still keeps replicas identical; they just differ from one process
    assert _largest_difference(run["parameters"], one_process["parameters"]) > 1e-2


def test_fsdp2_trains_and_matches_ddp(ranks: list[dict]) -> None:
    ddp, fsdp2 = ranks[0]["ddp_fixed"], ranks[0]["fsdp2_fixed"]
    assert ranks[1]["fsdp2_fixed"]["losses"] == fsdp2["losses"]
    assert len(fsdp2["losses"]) == TRAIN_STEPS and fsdp2["skipped_steps"] == 0
    assert fsdp2["losses"][-1] < 0.85 * fsdp2["losses"][0]
    # FSDP2 runs with rank-local amax (see test_fsdp2_with_reduced_amax): within 2% of DDP's loss.
    assert fsdp2["losses"] == pytest.approx(ddp["losses"], rel=2e-2)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="FSDP2 + amax all-reduce: ranks issue FSDP2's post-backward reduce-scatter and numscope's "
    "synchronous per-operand amax all-reduce in different orders; on one group gloo aborts ('Received data "
    "size doesn't match expected size'), on separate groups the ranks deadlock",
)
def test_fsdp2_with_reduced_amax(tmp_path: Path) -> None:
    launch("fsdp2_reduced_amax", tmp_path, timeout=45)
