"""Loss scaling, amax reduction and fp8 collectives across two real gloo ranks on localhost."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import pytest
import torch
from dist_worker import GATHER_CASES, launch, whole_tensor

import numscope
from numscope import distributed


@pytest.fixture(scope="module")
def loss_scaler_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return launch("loss_scaler", tmp_path_factory.mktemp("loss_scaler"))


@pytest.fixture(scope="module")
def amax_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return launch("amax", tmp_path_factory.mktemp("amax"))


def test_overflow_on_one_rank_skips_the_step_on_both(loss_scaler_ranks: list[dict]) -> None:
    for case in ("plain", "ddp"):
        for rank, result in enumerate(loss_scaler_ranks):
            outcome = result[case]
            assert not outcome["changed"], f"{case}: rank {rank} stepped"
            assert outcome["skipped_steps"] == 1
            assert outcome["scale"] == 2.0**7, f"{case}: rank {rank} did not back off"
    # Rank 0 saw no inf itself: it skips because rank 1 did, and names no parameter of its own.
    assert loss_scaler_ranks[0]["plain"]["overflow"].parameters == ()
    assert loss_scaler_ranks[1]["plain"]["overflow"].parameters == ("0.weight",)


def test_without_the_reduction_the_ranks_diverge(loss_scaler_ranks: list[dict]) -> None:
    for case in ("plain_no_reduce", "fsdp2_no_reduce"):
        rank0, rank1 = (result[case] for result in loss_scaler_ranks)
        assert rank0["changed"] and rank0["skipped_steps"] == 0 and rank0["scale"] == 2.0**8, case
        assert rank1["skipped_steps"] == 1 and rank1["scale"] == 2.0**7, case
    assert not loss_scaler_ranks[1]["plain_no_reduce"]["changed"]


def test_default_found_inf_reduction_under_fsdp2(loss_scaler_ranks: list[dict]) -> None:
    # The gradients are sharded DTensors; only rank 1's shard holds the inf. The default reduction skips the
    # step on both ranks with one all-reduce: each rank checks its local shards, no per-parameter collective.
    for rank, result in enumerate(loss_scaler_ranks):
        outcome = result["fsdp2"]
        assert not outcome["changed"] and outcome["skipped_steps"] == 1, f"rank {rank} stepped"
        assert outcome["scale"] == 2.0**7
        assert outcome["collectives"] == {"c10d.allreduce_": 1}
    assert loss_scaler_ranks[0]["fsdp2"]["overflow"].parameters == ()
    assert loss_scaler_ranks[1]["fsdp2"]["overflow"].parameters == ("0.weight",)
    # Without the reduction there is no collective at all.
    assert loss_scaler_ranks[0]["fsdp2_no_reduce"]["collectives"] == {}


def test_a_weight_moved_in_memory_on_one_rank_keeps_the_collectives_in_step(tmp_path: Path) -> None:
    # As FSDP2 re-gathers each unsharded parameter into new memory for backward: whether convert reuses the
    # fprop-quantized weight for dgrad (and so skips one amax all-reduce) must not depend on the address.
    ranks = launch("moved_weight", tmp_path, timeout=45)
    assert not ranks[0]["moved"] and ranks[1]["moved"]
    for result in ranks:
        assert torch.equal(result["all_grads"][0], ranks[0]["grads"])
        assert torch.equal(result["all_grads"][1], ranks[1]["grads"])


def test_fp8_tensors_cross_gloo_as_uint8_views(tmp_path: Path) -> None:
    ranks = launch("collectives", tmp_path)
    expected = torch.cat(
        [torch.tensor([1.0 + rank, -0.5, 448.0], dtype=torch.float8_e4m3fn) for rank in (0, 1)]
    )
    for rank, result in enumerate(ranks):
        assert result["raw_error"] is not None, "gloo accepted fp8: the uint8 detour may be unneeded"
        assert result["gathered_dtype"] == "torch.float8_e4m3fn"
        assert torch.equal(result["gathered"], expected.view(torch.uint8))
        assert torch.equal(result["broadcast"], torch.tensor([3.0, 3.0]))
        assert (result["rank"], result["world_size"]) == (rank, 2)


def test_reduced_amax_makes_each_rank_quantize_as_one_process(amax_ranks: list[dict]) -> None:
    whole = whole_tensor()
    one_process = numscope.quantize(whole, "fp8_e4m3", scaling="tensor")
    assert torch.equal(torch.cat([r["reduced"] for r in amax_ranks]), one_process)
    # The switch is honoured: rank 0's half (amax ~37x smaller) gets its own, finer scale.
    local = torch.cat([r["local"] for r in amax_ranks])
    assert not torch.equal(local, one_process)
    assert torch.equal(amax_ranks[0]["local"], numscope.quantize(whole[:4], "fp8_e4m3", scaling="tensor"))


def test_nvfp4_tensor_amax_is_reduced_unless_switched_off(amax_ranks: list[dict]) -> None:
    whole = whole_tensor()
    assert torch.equal(torch.cat([r["nvfp4_reduced"] for r in amax_ranks]), numscope.quantize(whole, "nvfp4"))
    assert torch.equal(amax_ranks[0]["nvfp4_local"], numscope.quantize(whole[:4], "nvfp4"))
    assert not torch.equal(amax_ranks[0]["nvfp4_local"], amax_ranks[0]["nvfp4_reduced"])


def test_column_amax_runs_over_every_rank_s_rows(amax_ranks: list[dict]) -> None:
    """A column's scale comes from all its rows, and data parallelism splits the rows over the ranks."""
    whole = whole_tensor()
    one_process = numscope.quantize(whole, "int8", scaling="column")
    assert torch.equal(torch.cat([r["column_reduced"] for r in amax_ranks]), one_process)
    assert torch.equal(torch.cat([r["column_fast"] for r in amax_ranks]), one_process)
    assert torch.equal(amax_ranks[0]["column_local"], numscope.quantize(whole[:4], "int8", scaling="column"))
    assert not torch.equal(amax_ranks[0]["column_local"], amax_ranks[0]["column_reduced"])


def test_delayed_scaling_records_the_global_amax(amax_ranks: list[dict]) -> None:
    whole = whole_tensor()
    reference = numscope.DelayedScaler(numscope.Scaling("delayed", history_len=4))
    for step in range(3):
        expected = numscope.quantize(whole * (step + 1), "fp8_e4m3", scaling=reference)
        assert torch.equal(torch.cat([r["delayed"][step] for r in amax_ranks]), expected)
    for result in amax_ranks:
        assert torch.equal(result["delayed_history"], reference.amax_history)


def test_a_rank_with_an_empty_share_keeps_the_amax_reductions_in_step(amax_ranks: list[dict]) -> None:
    part = whole_tensor()[4:]  # rank 1's half; rank 0 quantized an empty tensor at the same calls
    empty, full = (result["empty_share"] for result in amax_ranks)
    assert empty["tensor"].shape == (0, 64) and empty["nvfp4"].shape == (0, 64)
    assert empty["column"].shape == (0, 64)
    assert torch.equal(full["column"], numscope.quantize(part, "int8", scaling="column"))
    assert torch.equal(full["tensor"], numscope.quantize(part, "fp8_e4m3", scaling="tensor"))
    assert torch.equal(full["nvfp4"], numscope.quantize(part, "nvfp4"))
    reference = numscope.DelayedScaler(numscope.Scaling("delayed", history_len=4))
    for step in range(2):
        expected = numscope.quantize(part * (step + 1), "fp8_e4m3", scaling=reference)
        assert torch.equal(full["delayed"][step], expected)
    assert torch.equal(empty["delayed_history"], reference.amax_history)  # the ranks' histories agree
    assert torch.equal(full["delayed_history"], reference.amax_history)


@pytest.mark.parametrize("name", sorted(GATHER_CASES))
def test_low_precision_all_gather_equals_quantizing_the_whole(amax_ranks: list[dict], name: str) -> None:
    fmt, scaling = GATHER_CASES[name]
    expected = numscope.quantize(whole_tensor(), fmt, scaling=scaling)
    for result in amax_ranks:
        assert torch.equal(result["gathers"][name], expected)


def test_helpers_outside_distributed_runs_are_a_world_of_one() -> None:
    values = torch.tensor([0.5, -2.0], dtype=torch.float8_e5m2)
    assert (distributed.rank(), distributed.world_size(), distributed.is_rank_zero()) == (0, 1, True)
    assert distributed.all_gather_tensor(values) is values
    assert torch.equal(distributed.to_wire(values), values.view(torch.uint8))
    assert torch.equal(
        distributed.all_gather_quantized(whole_tensor(), "fp8_e4m3"),
        numscope.quantize(whole_tensor(), "fp8_e4m3", scaling="tensor"),
    )


def test_gloo_goes_over_loopback_only_when_every_rank_is_on_this_machine(monkeypatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two machines: the user's network decides
    assert distributed.use_loopback_on_one_node() is None and "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # not under torchrun
    assert distributed.use_loopback_on_one_node() is None and "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    loopback = distributed.use_loopback_on_one_node()
    assert loopback is not None and loopback.startswith("lo") and os.environ["GLOO_SOCKET_IFNAME"] == loopback
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice stands
    assert distributed.use_loopback_on_one_node() is None and os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_destroy_process_group_lets_a_failed_runs_ddp_go_first(tmp_path: Path) -> None:
    """The traceback of a failed run keeps its DDP wrapper (which holds the gloo group) alive; torch hangs
    at exit now and then when that wrapper outlives the group, so the frames are cleared before it goes."""
    from torch import distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    alive: list[weakref.ref] = []

    def failing_run() -> None:
        wrapped = DistributedDataParallel(torch.nn.Linear(2, 2))
        wrapped(torch.ones(1, 2)).sum().backward()
        alive.append(weakref.ref(wrapped))
        raise ValueError("the run failed")

    try:
        with pytest.raises(ValueError, match="the run failed") as caught:
            failing_run()
        gc.collect()
        assert alive[0]() is not None  # held by the traceback's frame
        distributed.destroy_process_group(caught.value)
        assert alive[0]() is None and not dist.is_initialized()
        distributed.destroy_process_group()  # without a group: nothing to do
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_low_precision_all_gather_rejects_what_it_cannot_gather() -> None:
    with pytest.raises(ValueError, match="allowed: none, tensor, row"):
        distributed.all_gather_quantized(whole_tensor(), "fp8_e4m3", scaling="column")
    with pytest.raises(ValueError, match="'bf16' has 16 bits"):
        distributed.all_gather_quantized(whole_tensor(), "bf16", scaling=None)
    with pytest.raises(ValueError, match="delayed"):
        distributed.all_gather_quantized(whole_tensor(), "fp8_e4m3", scaling=numscope.DelayedScaler())
