"""Quantization error metrics and the backward error, against hand-computed values and float64 loops."""

import math

import numpy as np
import pytest
import torch

import numscope
from numscope.metrics import (
    backward_error,
    backward_error_from,
    block_scale_spread,
    candidate_metrics,
    cosine_similarity,
    operand_metrics,
    overflow_fraction,
    product_reference,
    quantize_sample,
    relative_error,
    saturated_block_fraction,
    sqnr_db,
    underflow_fraction,
)


def test_sqnr_relative_error_and_cosine_of_a_known_error():
    x, q = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 3.0])
    assert sqnr_db(x, q) == pytest.approx(10 * math.log10(25.0))
    assert relative_error(x, q) == pytest.approx(0.2)
    assert cosine_similarity(x, q) == pytest.approx(21 / (5 * math.sqrt(18)))
    assert sqnr_db(x, x) == math.inf and relative_error(x, x) == 0.0


def test_error_metrics_do_not_overflow_on_large_values():
    x = torch.tensor([3e30, 4e30])
    assert sqnr_db(x, torch.tensor([3e30, 3e30])) == pytest.approx(10 * math.log10(25.0))


def test_cosine_of_zero_vectors():
    zero = torch.zeros(3)
    assert cosine_similarity(zero, zero) == 1.0
    assert cosine_similarity(torch.ones(3), zero) == 0.0


def test_underflow_fraction_counts_nonzeros_that_became_zero():
    x = torch.tensor([0.0, 1e-10, 1.0, 2.0])
    q = torch.tensor([0.0, 0.0, 1.0, 2.0])
    assert underflow_fraction(x, q) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="same shape"):
        underflow_fraction(x, q[:2])


def test_overflow_fraction_uses_the_rounding_threshold():
    # E4M3: max 448, next step would be 480, so nearest rounding overflows above 464 (464 ties to 448)
    x = torch.tensor([1.0, 460.0, 464.0, 465.0, 1000.0])
    assert overflow_fraction(x, "fp8_e4m3", scaling=None) == pytest.approx(2 / 5)
    # int8: 127.5 ties to 128 (even), which is out of range
    ints = torch.tensor([127.4, 127.5, 200.0])
    assert overflow_fraction(ints, "int8", scaling=None) == pytest.approx(2 / 3)
    # current per-tensor scaling maps amax onto max: nothing overflows
    assert overflow_fraction(x, "fp8_e4m3") == 0.0


def test_block_saturation_and_scale_spread():
    # two MXFP8 blocks of 32; block 0 amax 500 has scale 2^(8-8) = 1, so 500 > 464 saturates
    x = torch.ones(64)
    x[0] = 500.0
    x[32:] = 2.0**-10
    assert saturated_block_fraction(x, "mxfp8_e4m3") == pytest.approx(0.5)
    assert overflow_fraction(x, "mxfp8_e4m3") == pytest.approx(1 / 64)
    spread = block_scale_spread(x, "mxfp8_e4m3")
    # block scales 2^0 and 2^(-10 - 8)
    assert spread.range_binades == pytest.approx(18.0)
    assert spread.std_binades == pytest.approx(9.0)
    assert (spread.blocks, spread.flushed) == (2, 0)


def test_block_metrics_follow_the_axis():
    x = torch.ones(32, 2)
    x[0, 0] = 500.0
    assert saturated_block_fraction(x, "mxfp8_e4m3", axis=0) == pytest.approx(0.5)
    assert saturated_block_fraction(x, "mxfp8_e4m3", axis=-1) == pytest.approx(1 / 32)


def test_block_metrics_reject_element_formats():
    with pytest.raises(ValueError, match="element format"):
        saturated_block_fraction(torch.ones(4), "fp8_e4m3")


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "nvfp4", "bf16"])
def test_operand_metrics_agree_with_the_single_metrics(fmt):
    x = torch.tensor(np.random.default_rng(0).standard_t(3, (64, 96)), dtype=torch.float32)
    spec = numscope.get_format(fmt)
    q = numscope.quantize(x, fmt, scaling=None if spec.kind == "block" else "tensor")
    metrics = operand_metrics(x, fmt)
    assert metrics["sqnr_db"] == pytest.approx(sqnr_db(x, q), rel=1e-6)
    assert metrics["rel_error"] == pytest.approx(relative_error(x, q), rel=1e-6)
    assert metrics["cosine"] == pytest.approx(cosine_similarity(x, q), rel=1e-6)
    assert metrics["underflow%"] == pytest.approx(100 * underflow_fraction(x, q))
    assert metrics["overflow%"] == pytest.approx(100 * overflow_fraction(x, fmt))
    if spec.kind == "block":
        assert metrics["saturated_blocks%"] == pytest.approx(100 * saturated_block_fraction(x, fmt))
        assert metrics["block_scale_range"] == pytest.approx(block_scale_spread(x, fmt).range_binades)
    else:
        assert "saturated_blocks%" not in metrics


def test_operand_metrics_reject_element_scaling_for_block_formats():
    with pytest.raises(ValueError, match="brings its own block scaling"):
        operand_metrics(torch.ones(32), "mxfp8_e4m3", scaling="tensor")


def test_operand_metrics_ignore_nonfinite_elements():
    x = torch.tensor([1.0, 2.0, float("inf"), 3.0])
    metrics = operand_metrics(x, "int8")
    assert math.isfinite(metrics["sqnr_db"])


def test_backward_error_is_zero_for_exactly_representable_operands():
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-8, 9, (16, 64), generator=generator).float()
    b = torch.randint(-8, 9, (64, 8), generator=generator).float()
    for fmt in ("fp8_e4m3", "int8", "mxfp8_e4m3"):
        result = backward_error(a, b, fmt, fmt, scaling_a=None, scaling_b=None)
        assert result.max == 0.0 and result.count > 0


def test_backward_error_matches_a_float64_loop():
    rng = np.random.default_rng(4)
    a = torch.tensor(rng.standard_t(3, (5, 40)), dtype=torch.float32)
    b = torch.tensor(rng.standard_t(3, (40, 3)), dtype=torch.float32)
    a[0] = 0.0  # a zero row: its entries have a zero denominator and are excluded
    qa = numscope.quantize(a, "fp8_e4m3", scaling="tensor").double().numpy()
    qb = numscope.quantize(b, "fp8_e5m2", scaling="tensor").double().numpy()
    A, B = a.double().numpy(), b.double().numpy()
    expected = []
    for i in range(5):
        for j in range(3):
            denominator = sum(abs(A[i, k]) * abs(B[k, j]) for k in range(40))
            if denominator > 0:
                exact = sum(A[i, k] * B[k, j] for k in range(40))
                quantized = sum(qa[i, k] * qb[k, j] for k in range(40))
                expected.append(abs(exact - quantized) / denominator)
    result = backward_error(a, b, "fp8_e4m3", "fp8_e5m2")
    assert result.count == 12 and result.excluded == 3
    assert result.mean == pytest.approx(np.mean(expected), rel=1e-9)
    assert result.max == pytest.approx(np.max(expected), rel=1e-9)
    assert result.p99 == pytest.approx(np.quantile(expected, 0.99), rel=1e-9)
    assert result.median == pytest.approx(np.median(expected), rel=1e-9)


def test_backward_error_stats_exclude_zero_denominators_and_flag_nonfinite_products():
    from numscope.metrics.backward_error import BE_STATS, backward_error_stats

    exact = torch.tensor([[1.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    magnitude = torch.tensor([[2.0, 0.0], [4.0, 1.0]], dtype=torch.float64)
    products = torch.tensor(
        [
            [[1.5, 0.0], [1.0, 0.5]],  # BE 0.25, excluded, 0.25, 0.5
            [[1.0, 0.0], [math.inf, 0.0]],  # 0, excluded, inf, 0
            [[0.0, 0.0], [0.0, 0.0]],
        ],
        dtype=torch.float64,
    )
    numbers = backward_error_stats(exact, products, magnitude)
    first, second, _ = (dict(zip(BE_STATS, row, strict=True)) for row in numbers.tolist())
    assert first["count"] == 3 and first["excluded"] == 1
    assert first["mean"] == pytest.approx((0.25 + 0.25 + 0.5) / 3)
    assert first["median"] == 0.25 and first["max"] == 0.5
    assert first["p99"] == pytest.approx(float(torch.quantile(torch.tensor([0.25, 0.25, 0.5]), 0.99)))
    assert second["mean"] == math.inf and second["max"] == math.inf and second["median"] == 0.0
    everything_zero = backward_error_stats(exact * 0, products[:1] * 0, magnitude * 0)[0].tolist()
    assert all(math.isnan(v) for v in everything_zero[:4]) and everything_zero[4:] == [0.0, 4.0]


@pytest.mark.parametrize("entries", [1, 2, 7, 99, 100, 101, 250, 4096])
def test_backward_error_p99_without_the_median_is_the_same_bits(entries: int) -> None:
    """median=False finds the 99th percentile among each row's largest entries (topk) instead of a sort:
    every other column is the same bits, with excluded, infinite and all-excluded rows among them."""
    from numscope.metrics.backward_error import backward_error_stats

    generator = torch.Generator().manual_seed(entries)
    exact = torch.randn(entries, generator=generator, dtype=torch.float64)
    magnitude = exact.abs() + torch.rand(entries, generator=generator, dtype=torch.float64)
    magnitude[torch.rand(entries, generator=generator) < 0.3] = 0.0  # excluded where the product is finite
    products = exact + torch.randn(6, entries, generator=generator, dtype=torch.float64) * 1e-3
    products[1, : entries // 3] = math.inf  # BE inf
    products[2] = products[2].round(decimals=2)  # ties between entries
    products[3] = exact  # BE 0 everywhere
    magnitude_all_excluded = magnitude.clone()
    with_sort = backward_error_stats(exact, products, magnitude)
    with_topk = backward_error_stats(exact, products, magnitude, median=False)
    assert torch.isnan(with_topk[:, 1]).all()
    keep = [0, 2, 3, 4, 5]
    assert torch.equal(with_sort[:, keep].nan_to_num(-1.0), with_topk[:, keep].nan_to_num(-1.0))
    magnitude_all_excluded[:] = 0.0
    nothing = backward_error_stats(exact, exact[None].clone(), magnitude_all_excluded, median=False)[0]
    assert torch.isnan(nothing[:4]).all() and nothing[4:].tolist() == [0.0, float(entries)]


def test_block_formats_run_their_blocks_along_the_contraction_dim():
    rng = np.random.default_rng(5)
    # columns of a (and rows of b) differ in scale by 2^12: blocks across k would mix them
    spread = np.logspace(0, 12, 64, base=2)
    a = torch.tensor(rng.standard_normal((64, 64)) * spread[None, :], dtype=torch.float32)
    b = torch.tensor(rng.standard_normal((64, 64)) * spread[:, None], dtype=torch.float32)
    fmt = "mxfp4_e2m1"
    qa = numscope.quantize(a, fmt, scaling=numscope.Scaling("block", axis=1))
    qb = numscope.quantize(b, fmt, scaling=numscope.Scaling("block", axis=0))
    expected = backward_error_from(product_reference(a, b), qa, qb)
    assert backward_error(a, b, fmt, fmt) == expected
    across = backward_error(
        a,
        b,
        fmt,
        fmt,
        scaling_a=numscope.Scaling("block", axis=0),
        scaling_b=numscope.Scaling("block", axis=1),
    )
    assert across.mean != expected.mean


def test_sampled_backward_error_estimates_the_full_mean():
    rng = np.random.default_rng(6)
    a = torch.tensor(rng.standard_t(4, (256, 128)), dtype=torch.float32)
    b = torch.tensor(rng.standard_t(4, (128, 256)), dtype=torch.float32)
    full = backward_error(a, b, "int8", "int8")
    sampled = backward_error(
        a, b, "int8", "int8", sample_rows=64, sample_cols=64, generator=torch.Generator().manual_seed(0)
    )
    assert sampled.sampled and not full.sampled and sampled.count == 64 * 64
    assert sampled.mean == pytest.approx(full.mean, rel=0.1)
    assert sampled.max <= full.max


def test_backward_error_rejects_bad_shapes():
    with pytest.raises(ValueError, match="contraction sizes differ"):
        backward_error(torch.ones(2, 3), torch.ones(4, 2), "int8", "int8")
    with pytest.raises(ValueError, match="2-D operands"):
        backward_error(torch.ones(2, 3, 4), torch.ones(4, 2), "int8", "int8")


def test_operand_metrics_of_int8_by_hand():
    # int8, per-tensor scaling: scale = 127 / 3; 1 → round(42.33) = 42 → 42·3/127; 3 → 127 → 3;
    # 2^-10 → round(0.041) = 0 (an underflow); 0 stays 0
    x = torch.tensor([1.0, 3.0, 0.0, 2.0**-10])
    q1 = 42 * 3 / 127
    signal = 1.0 + 9.0 + 2.0**-20
    noise = (1.0 - q1) ** 2 + 2.0**-20
    metrics = operand_metrics(x, "int8")
    assert metrics["sqnr_db"] == pytest.approx(10 * math.log10(signal / noise), rel=1e-6)
    assert metrics["rel_error"] == pytest.approx(math.sqrt(noise / signal), rel=1e-6)
    assert metrics["mse"] == pytest.approx(noise / 4, rel=1e-6)
    assert metrics["cosine"] == pytest.approx((q1 + 9.0) / math.sqrt(signal * (q1**2 + 9.0)), rel=1e-9)
    assert metrics["underflow%"] == pytest.approx(100 / 3)
    assert metrics["overflow%"] == 0.0


CASES = [
    ("bf16", None),
    ("fp16", None),
    ("fp8_e4m3", "tensor"),
    ("fp8_e5m2", "tensor"),
    ("int8", "tensor"),
    ("int8", "row"),
    ("fp8_e4m3", "column"),
    ("fp8_e4m3", numscope.Scaling("tensor", margin=1)),
    ("fp8_e4m3", numscope.Scaling("block", block_shape=(1, 32))),
    ("mxfp8_e4m3", "auto"),
    ("mxfp4_e2m1", "auto"),
    ("nvfp4", "auto"),
    ("mxfp6_e3m2", numscope.Scaling("block", axis=0)),
]


def test_candidate_metrics_equal_one_operand_metrics_call_per_candidate():
    x = torch.tensor(np.random.default_rng(7).standard_t(3, (64, 96)), dtype=torch.float32)
    x[0, :5] = 0.0
    together = candidate_metrics(x, {f"{fmt}/{i}": (fmt, scaling) for i, (fmt, scaling) in enumerate(CASES)})
    assert list(together) == [f"{fmt}/{i}" for i, (fmt, _) in enumerate(CASES)]
    for i, (fmt, scaling) in enumerate(CASES):
        alone = operand_metrics(x, fmt, scaling)
        assert together[f"{fmt}/{i}"].keys() == alone.keys()
        for name, value in alone.items():
            if math.isnan(value):
                assert math.isnan(together[f"{fmt}/{i}"][name]), (fmt, name)
            else:
                assert together[f"{fmt}/{i}"][name] == pytest.approx(value, rel=1e-12, abs=1e-15), (fmt, name)


@pytest.mark.parametrize(("fmt", "scaling"), CASES[:8] + CASES[9:12])
def test_operand_metrics_measure_what_quantize_returns(fmt, scaling):
    x = torch.tensor(np.random.default_rng(8).standard_t(4, (32, 64)), dtype=torch.float32) * 1e3
    spec = numscope.get_format(fmt)
    q = numscope.quantize(x, fmt, scaling=None if spec.kind == "block" else scaling)
    metrics = operand_metrics(x, fmt, scaling)
    assert metrics["sqnr_db"] == pytest.approx(sqnr_db(x, q), rel=1e-6)
    assert metrics["underflow%"] == pytest.approx(100 * underflow_fraction(x, q))


@pytest.mark.parametrize(
    ("fmt", "scaling"),
    [("fp8_e4m3", "tensor"), ("int8", "tensor"), ("mxfp4_e2m1", None), ("nvfp4", None), ("bf16", None)],
)
def test_quantize_sample_quantizes_rows_as_inside_the_whole_tensor(fmt, scaling):
    x = torch.tensor(np.random.default_rng(9).standard_t(3, (256, 64)), dtype=torch.float32)
    rows = torch.tensor([3, 17, 200, 17])
    whole = numscope.quantize(x, fmt, scaling=scaling)
    amax = x.abs().max()
    assert float(x[rows].abs().max()) < float(amax)
    sample_scaling = "auto" if scaling is None and fmt != "bf16" else scaling
    assert torch.equal(quantize_sample(x[rows], fmt, sample_scaling, amax=amax), whole[rows])
    if fmt in ("fp8_e4m3", "int8", "nvfp4"):
        # without the whole tensor's amax the sample would be scaled by its own, smaller one
        assert not torch.equal(quantize_sample(x[rows], fmt, sample_scaling), whole[rows])
