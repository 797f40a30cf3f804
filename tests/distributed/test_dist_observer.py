"""Observer statistics of two gloo ranks, merged, against one process on the concatenated batch."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_worker import OBSERVED_CANDIDATES, launch, observed_analysis

from numscope.analysis import Analysis

EXACT_STATS = ("amax", "dynamic_range", "zeros%", "nonfinite%")
EXACT_METRICS = ("underflow%", "overflow%")


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Analysis, list[dict], Path]:
    directory = tmp_path_factory.mktemp("observer")
    ranks = launch("observer", directory / "ranks", analysis_directory=str(directory / "analysis"))
    return Analysis.from_dict(ranks[0]["merged"]), ranks, directory / "analysis"


@pytest.fixture(scope="module")
def one_process() -> Analysis:
    return observed_analysis(rank=0, world_size=1)[0]


def test_merged_statistics_equal_one_process(merged: tuple, one_process: Analysis) -> None:
    analysis, _, _ = merged
    keys = one_process.keys()
    assert analysis.keys() == keys and len(keys) > 50
    for key in keys:
        expected, found = one_process.record(key, 0), analysis.record(key, 0)
        assert analysis.histograms[key] == one_process.histograms[key], key
        assert analysis.elements[key] == one_process.elements[key], key
        for name in EXACT_STATS:
            assert found.stats[name] == pytest.approx(expected.stats[name], rel=1e-9, abs=1e-12), (key, name)
        assert found.stats["rms"] == pytest.approx(expected.stats["rms"], rel=1e-6), key
        for candidate in OBSERVED_CANDIDATES:
            for name in EXACT_METRICS:
                assert found.metrics[candidate][name] == pytest.approx(
                    expected.metrics[candidate][name], rel=1e-9, abs=1e-9
                ), (key, candidate, name)
            assert found.metrics[candidate]["mse"] == pytest.approx(
                expected.metrics[candidate]["mse"], rel=1e-5, abs=1e-30
            ), (key, candidate)


def test_parameters_are_counted_once(merged: tuple, one_process: Analysis) -> None:
    analysis, _, _ = merged
    key = ("bert.encoder.layer.0.output.dense", "fprop", "weight")
    assert analysis.elements[key] == one_process.elements[key] == 32 * 64
    assert analysis.histograms[key].total == 32 * 64


def test_written_once_by_rank_zero(merged: tuple) -> None:
    analysis, ranks, directory = merged
    assert ranks[0]["written"] == str(directory) and ranks[1]["written"] is None
    assert Analysis.load(directory).keys() == analysis.keys()
