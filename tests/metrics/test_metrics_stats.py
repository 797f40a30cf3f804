"""Tensor statistics against values worked out by hand (and scipy where a closed form is long)."""

import math

import numpy as np
import pytest
import torch

from numscope.metrics import (
    FLOAT32_EXPONENTS,
    Log2Histogram,
    dynamic_range_binades,
    kurtosis,
    log2_histogram,
    student_t_dof,
    tensor_stats,
)


def test_dynamic_range_is_log2_of_max_over_min_nonzero():
    x = torch.tensor([0.0, 0.25, -4.0, 1.0, float("inf")])
    assert dynamic_range_binades(x) == pytest.approx(4.0)
    assert dynamic_range_binades(torch.zeros(3)) == 0.0


def test_histogram_counts_each_binade():
    x = torch.tensor([0.0, 1.0, 1.5, 2.0, 0.25, -3.0, float("nan"), 2.0**-149])
    hist = log2_histogram(x)
    counts = dict(zip(hist.exponents, hist.counts, strict=True))
    assert counts[0] == 2 and counts[1] == 2 and counts[-2] == 1 and counts[-149] == 1
    assert sum(hist.counts) == 6
    assert (hist.zeros, hist.nonfinite, hist.below, hist.above) == (1, 1, 0, 0)
    assert hist.exponents == FLOAT32_EXPONENTS
    assert hist.total == x.numel()


def test_histogram_outside_narrow_bins_goes_below_and_above():
    hist = log2_histogram(torch.tensor([1e-3, 1.0, 3.0, 1e3]), exponents=range(0, 2))
    assert hist.counts == (1, 1) and hist.below == 1 and hist.above == 1


def test_histograms_merge_exactly():
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=generator) * 1e-3
    b = torch.randn(777, generator=generator) * 1e4
    b[::7] = 0
    assert log2_histogram(a) + log2_histogram(b) == log2_histogram(torch.cat([a, b]))
    with pytest.raises(ValueError, match="same bins"):
        log2_histogram(a) + log2_histogram(b, exponents=range(-10, 10))


def test_histogram_round_trips_through_dict():
    hist = log2_histogram(torch.tensor([0.0, 1.0, 8.0, float("inf")]))
    assert Log2Histogram.from_dict(hist.to_dict()) == hist


def test_kurtosis_is_excess_kurtosis():
    assert kurtosis(torch.tensor([-1.0, 1.0])) == pytest.approx(-2.0)  # m4/m2² = 1
    # [0, 0, 0, 0, 5]: mean 1, m2 = (4·1 + 16)/5 = 4, m4 = (4·1 + 256)/5 = 52, 52/16 − 3 = 0.25
    assert kurtosis(torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0])) == pytest.approx(0.25, rel=1e-5)  # float32
    assert math.isnan(kurtosis(torch.ones(4)))


def test_kurtosis_matches_scipy_on_a_large_scaled_sample():
    stats = pytest.importorskip("scipy.stats")
    x = np.random.default_rng(1).standard_t(6, 50_000) * 1e6
    assert kurtosis(torch.tensor(x, dtype=torch.float32)) == pytest.approx(stats.kurtosis(x), rel=1e-3)


def test_t_quantile_table_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    from numscope.metrics.stats import _t_quantile_ratios

    dofs, ratios = _t_quantile_ratios()
    expected = stats.t.ppf(0.995, dofs) / stats.t.ppf(0.75, dofs)
    np.testing.assert_allclose(ratios, expected, rtol=1e-3)


@pytest.mark.parametrize("dof", [1.5, 3.0, 8.0])
def test_student_t_dof_recovers_the_degrees_of_freedom(dof):
    x = torch.tensor(np.random.default_rng(2).standard_t(dof, 200_000), dtype=torch.float32)
    assert student_t_dof(x * 123.0) == pytest.approx(dof, rel=0.2)


def test_student_t_dof_of_gaussian_is_large_and_of_mostly_zeros_is_nan():
    x = torch.tensor(np.random.default_rng(3).standard_normal(200_000), dtype=torch.float32)
    assert student_t_dof(x) > 40
    assert math.isnan(student_t_dof(torch.tensor([0.0] * 10 + [1.0, 2.0])))


def test_tensor_stats_keys_and_values():
    x = torch.tensor([0.0, 3.0, -4.0, 0.0, float("nan")])
    stats = tensor_stats(x)
    assert set(stats) == {"amax", "rms", "dynamic_range", "kurtosis", "t_dof", "zeros%", "nonfinite%"}
    assert stats["amax"] == 4.0
    assert stats["rms"] == pytest.approx(math.sqrt(25 / 4))  # over the 4 finite elements
    assert stats["dynamic_range"] == pytest.approx(math.log2(4 / 3))
    assert stats["zeros%"] == pytest.approx(40.0)
    assert stats["nonfinite%"] == pytest.approx(20.0)
