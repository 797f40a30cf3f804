"""Observer statistics of two gloo ranks, merged, against one process on the concatenated batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_worker import OBSERVED_CANDIDATES, OBSERVED_EVERY, OBSERVED_STEPS, launch, observed_analysis

import numscope
from numscope.analysis import Analysis

EXACT_STATS = ("amax", "dynamic_range", "zeros%", "nonfinite%")
EXACT_METRICS = ("underflow%", "overflow%")
SAMPLED = [step for step in range(OBSERVED_STEPS) if step % OBSERVED_EVERY == 0]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    directory = tmp_path_factory.mktemp("observer")
    found = launch("observer", directory / "ranks", analysis_directory=str(directory / "analysis"))
    return found, directory / "analysis"


@pytest.fixture(scope="module")
def one_process() -> tuple[Analysis, list[dict]]:
    analysis, _, collectives = observed_analysis(rank=0, world_size=1)
    return analysis, collectives


def _assert_equal_to_one_process(analysis: Analysis, expected: Analysis) -> None:
    keys = expected.keys()
    assert analysis.keys() == keys and len(keys) > 50
    assert analysis.steps == expected.steps == SAMPLED
    for key in keys:
        assert analysis.histograms[key] == expected.histograms[key], key
        assert analysis.elements[key] == expected.elements[key], key
        for step in SAMPLED:
            want, found = expected.record(key, step), analysis.record(key, step)
            for name in EXACT_STATS:
                assert found.stats[name] == pytest.approx(want.stats[name], rel=1e-9, abs=1e-12), (key, name)
            assert found.stats["rms"] == pytest.approx(want.stats["rms"], rel=1e-6), key
            for candidate in OBSERVED_CANDIDATES:
                for name in EXACT_METRICS:
                    assert found.metrics[candidate][name] == pytest.approx(
                        want.metrics[candidate][name], rel=1e-9, abs=1e-9
                    ), (key, candidate, name)
                # sums of squares are float32 sums, so ranks round differently from one process
                for name in ("mse", "rel_error"):
                    assert found.metrics[candidate][name] == pytest.approx(
                        want.metrics[candidate][name], rel=1e-5, abs=1e-30
                    ), (key, candidate, name)
                assert found.metrics[candidate]["sqnr_db"] == pytest.approx(
                    want.metrics[candidate]["sqnr_db"], abs=1e-4
                ), (key, candidate)


def test_merged_at_step_equals_one_process(ranks: tuple, one_process: tuple) -> None:
    found, _ = ranks
    _assert_equal_to_one_process(Analysis.from_dict(found[0]["analysis"]), one_process[0])
    # Every rank holds the same merged analysis (so every rank would recommend the same plan).
    rank0, rank1 = (json.dumps(result["analysis"], sort_keys=True) for result in found)
    assert rank0 == rank1


def test_one_gather_per_sampled_step(ranks: tuple, one_process: tuple) -> None:
    found, _ = ranks
    for result in found:
        per_step = result["collectives"]
        for step in range(OBSERVED_STEPS):
            if step in SAMPLED:  # one all_gather_object: gloo sends the payload sizes, then the payloads
                assert per_step[step] == {"c10d.allgather_": 2}, (step, per_step)
            else:
                assert per_step[step] == {}, (step, per_step)
    assert one_process[1] == [{}] * OBSERVED_STEPS


def test_merging_afterwards_gives_the_same(ranks: tuple, one_process: tuple) -> None:
    found, _ = ranks
    _assert_equal_to_one_process(Analysis.from_dict(found[0]["merged_afterwards"]), one_process[0])


def test_parameters_are_counted_once(ranks: tuple, one_process: tuple) -> None:
    analysis = Analysis.from_dict(ranks[0][0]["analysis"])
    key = ("bert.encoder.layer.0.output.dense", "fprop", "weight")
    assert analysis.elements[key] == one_process[0].elements[key] == 32 * 64
    assert analysis.histograms[key].total == len(SAMPLED) * 32 * 64


def test_every_rank_recommends_the_plan_of_one_process(ranks: tuple, one_process: tuple) -> None:
    found, _ = ranks
    expected = numscope.recommend(one_process[0], max_be_ratio=None).to_dict()
    assert found[0]["plan"] == found[1]["plan"] == expected


def test_written_once_by_rank_zero(ranks: tuple) -> None:
    found, directory = ranks
    assert found[0]["written"] == str(directory) and found[1]["written"] is None
    saved = Analysis.load(directory)
    analysis = Analysis.from_dict(found[0]["analysis"])
    assert saved.keys() == analysis.keys()
    assert saved.histograms == analysis.histograms and saved.elements == analysis.elements


def test_backward_errors_merged_at_step(ranks: tuple) -> None:
    found, _ = ranks
    merged = [Analysis.from_dict(result["mlp"]) for result in found]
    local = [Analysis.from_dict(result["mlp_local"]) for result in found]
    assert merged[0].backward_errors == merged[1].backward_errors
    gemm_keys = local[0].backward_errors.keys()
    assert merged[0].backward_errors.keys() == gemm_keys and len(gemm_keys) == 5  # layer 0 has no dgrad
    for gemm_key in gemm_keys:
        for pair, per_step in local[0].backward_errors[gemm_key].items():
            rank0, rank1, both = per_step[0], local[1].backward_errors[gemm_key][pair][0], merged[0]
            found_stats = both.backward_errors[gemm_key][pair][0]
            assert found_stats["max"] == max(rank0["max"], rank1["max"])
            for stat in ("mean", "p99"):  # each rank's sub-product has as many rows: the plain mean
                assert found_stats[stat] == pytest.approx((rank0[stat] + rank1[stat]) / 2, rel=1e-12)
