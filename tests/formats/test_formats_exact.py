"""Element formats against ml_dtypes (fp16 against numpy), bit for bit, over codes, ties and random patterns.

Every comparison is on float32 bit patterns, with any NaN equal to any NaN.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import numscope
from bits import assert_bits_equal
from numscope._compat import torch_release

# through the native quantizers (the default) and through the eager reference (tests/formats/conftest.py)
pytestmark = pytest.mark.usefixtures("quantizer_path")

REFERENCE: dict[str, type] = {
    "bf16": ml_dtypes.bfloat16,
    "fp16": np.float16,
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
    "fp8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "fp8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "fp6_e3m2": ml_dtypes.float6_e3m2fn,
    "fp6_e2m3": ml_dtypes.float6_e2m3fn,
    "fp4_e2m1": ml_dtypes.float4_e2m1fn,
    "e8m0": ml_dtypes.float8_e8m0fnu,
    "e3m4": ml_dtypes.float8_e3m4,
    "e4m3": ml_dtypes.float8_e4m3,
}


def reference_cast(x: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return x.astype(REFERENCE[name]).astype(np.float32)


def ours(x: np.ndarray, name: str, **kwargs) -> np.ndarray:
    return numscope.quantize(torch.from_numpy(np.ascontiguousarray(x)), name, **kwargs).numpy()


def all_codes(name: str) -> np.ndarray:
    """Every value of the format, decoded by the reference (NaN and inf included)."""
    bits = numscope.get_format(name).bits
    dtype = REFERENCE[name]
    if bits == 16:
        return np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(dtype).astype(np.float32)
    return np.arange(2**bits, dtype=np.uint8).view(dtype).astype(np.float32)


def ties_and_neighbours(name: str) -> np.ndarray:
    """Midpoints of adjacent finite values (and the overflow threshold), with their float32 neighbours."""
    codes = all_codes(name)
    values = np.unique(codes[np.isfinite(codes)].astype(np.float64))
    fmt = numscope.get_format(name)
    top = np.array([fmt.overflow_threshold, -fmt.overflow_threshold])
    mids = np.concatenate([(values[1:] + values[:-1]) / 2, top]).astype(np.float32)
    assert np.all(mids.astype(np.float64)[:-2] == (values[1:] + values[:-1]) / 2), "midpoints must be exact"
    up = np.nextafter(mids, np.float32(np.inf))
    down = np.nextafter(mids, np.float32(-np.inf))
    return np.concatenate([mids, up, down])


@pytest.fixture(scope="module")
def random_patterns() -> np.ndarray:
    """10^6 uniformly random float32 bit patterns plus values of every scale and the specials."""
    rng = np.random.default_rng(2024)
    patterns = rng.integers(0, 2**32, size=1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    scales = np.float32(2.0) ** rng.integers(-150, 128, size=200_000).astype(np.float32)
    ranged = (rng.uniform(-2, 2, size=200_000).astype(np.float32) * scales).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38, -3.4e38], np.float32)
    return np.concatenate([patterns, ranged, specials])


def test_random_patterns_cover_the_interesting_classes(random_patterns: np.ndarray) -> None:
    finite = random_patterns[np.isfinite(random_patterns)]
    assert (np.abs(finite) < np.finfo(np.float32).tiny).sum() > 1000  # float32 subnormals
    assert np.isinf(random_patterns).sum() >= 2 and np.isnan(random_patterns).sum() > 1000
    assert (np.abs(finite) > 60000).sum() > 100_000  # overflow of every small format


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_every_code_is_returned_unchanged(name: str) -> None:
    codes = all_codes(name)
    assert_bits_equal(ours(codes, name, overflow="propagate"), reference_cast(codes, name), inputs=codes)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_ties_and_their_neighbours_match_the_reference(name: str) -> None:
    x = ties_and_neighbours(name)
    assert_bits_equal(ours(x, name, overflow="propagate"), reference_cast(x, name), inputs=x)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_random_float32_patterns_match_the_reference(name: str, random_patterns: np.ndarray) -> None:
    x = random_patterns
    actual = ours(x, name, overflow="propagate")
    expected = reference_cast(x, name)
    keep = ~np.isnan(x)  # NaN input: our own rule, tested below
    assert_bits_equal(actual[keep], expected[keep], inputs=x[keep])


@pytest.mark.parametrize("name", [*sorted(REFERENCE), "tf32", "int8", "int4", "fp32"])
@pytest.mark.parametrize("overflow", ["saturate", "propagate"])
def test_nan_input_stays_nan(name: str, overflow: str) -> None:
    x = np.array([np.nan, -np.nan, 1.0], np.float32)
    y = ours(x, name, overflow=overflow)
    assert np.isnan(y[:2]).all() and y[2] == 1.0


def test_fp6_and_fp4_nan_is_our_choice_not_ml_dtypes() -> None:
    """ml_dtypes turns NaN into a finite code for formats without NaN; we keep NaN visible (documented)."""
    x = np.array([np.nan], np.float32)
    for name in ("fp6_e3m2", "fp6_e2m3", "fp4_e2m1"):
        assert not np.isnan(reference_cast(x, name)).any()
        assert np.isnan(ours(x, name)).all()


def tf32_reference(x: np.ndarray) -> np.ndarray:
    """float32 bit pattern rounded to 10 mantissa bits, ties to even; NaN and inf pass through."""
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~np.uint64(0x1FFF)
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x), out, x)


def test_tf32_matches_a_bit_rounding_reference(random_patterns: np.ndarray) -> None:
    x = np.concatenate([random_patterns, ties_and_neighbours("bf16")])
    assert_bits_equal(ours(x, "tf32", overflow="propagate"), tf32_reference(x), inputs=x)


def test_tf32_ties_go_to_even() -> None:
    one_ulp = 2.0**-10
    x = np.array([1 + one_ulp / 2, 1 + 3 * one_ulp / 2, -(1 + one_ulp / 2)], np.float32)
    assert ours(x, "tf32").tolist() == [1.0, 1 + 2 * one_ulp, -1.0]


@pytest.mark.parametrize(
    "name",
    [
        "fp8_e4m3",
        "fp8_e5m2",
        "fp8_e4m3fnuz",
        "fp8_e5m2fnuz",
        "fp6_e3m2",
        "fp6_e2m3",
        "fp4_e2m1",
        "bf16",
        "fp16",
        "e3m4",
        "e4m3",
        "tf32",
    ],
)
def test_saturate_sends_every_finite_overflow_to_max(name: str, random_patterns: np.ndarray) -> None:
    fmt = numscope.get_format(name)
    x = random_patterns[np.isfinite(random_patterns)]
    y = ours(x, name, overflow="saturate")
    beyond = np.abs(x) > fmt.max
    assert beyond.sum() > 0
    assert np.array_equal(y[beyond], np.sign(x[beyond]) * np.float32(fmt.max))
    inside = ~beyond
    assert_bits_equal(y[inside], ours(x[inside], name, overflow="propagate"), inputs=x[inside])


def test_e8m0_saturates_finite_overflow_and_propagates_nan() -> None:
    """E8M0 has NaN and no inf: past 2^127 (from 1.5 · 2^127 on, nearest by value) saturate gives 2^127,
    propagate NaN (ml_dtypes' cast); zero, negatives and ±inf are NaN under both."""
    x = np.array([1.4 * 2.0**127, 1.5 * 2.0**127, 3.0e38, 0.0, -1.0, np.inf], np.float32)
    assert ours(x, "e8m0").tolist()[:3] == [2.0**127] * 3
    assert np.isnan(ours(x, "e8m0")[3:]).all()
    propagated = ours(x, "e8m0", overflow="propagate")
    assert propagated[0] == 2.0**127 and np.isnan(propagated[1:]).all()
    assert_bits_equal(propagated, reference_cast(x, "e8m0"), inputs=x)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fp8_e5m2", np.inf),
        ("bf16", np.inf),
        ("fp16", np.inf),
        ("e3m4", np.inf),
        ("fp8_e4m3", np.nan),
        ("fp8_e4m3fnuz", np.nan),
        ("fp8_e5m2fnuz", np.nan),
        ("fp6_e3m2", 28.0),
        ("fp4_e2m1", 6.0),
        ("int8", 127.0),
    ],
)
@pytest.mark.parametrize("overflow", ["saturate", "propagate"])
def test_infinity_follows_the_module_rule(name: str, expected: float, overflow: str) -> None:
    """inf stays inf where the format has it, becomes NaN where it only has NaN, ±max where it has neither."""
    y = ours(np.array([np.inf, -np.inf], np.float32), name, overflow=overflow)
    if np.isnan(expected):
        assert np.isnan(y).all()
    else:
        assert y.tolist() == [expected, -expected]


def test_torch_saturates_e4m3fn_where_we_follow_ml_dtypes() -> None:
    """torch's native E4M3FN cast saturates from torch 2.12 on (even inf -> 448; before, NaN beyond the
    range); numscope's casts are the same on both: propagate is ml_dtypes' (NaN), saturate clamps first."""
    x = np.array([np.inf, -np.inf, 465.0, 1e6, -500.0, 464.0], np.float32)
    native = torch.from_numpy(x).to(torch.float8_e4m3fn).float().numpy()
    if torch_release() >= (2, 12):
        assert native.tolist() == [448.0, -448.0, 448.0, 448.0, -448.0, 448.0]
    else:
        assert np.isnan(native[:5]).all() and native[5] == 448.0
    ours_propagate = ours(x, "fp8_e4m3", overflow="propagate")
    assert_bits_equal(ours_propagate, reference_cast(x, "fp8_e4m3"), inputs=x)
    assert np.isnan(ours_propagate[:5]).all() and ours_propagate[5] == 448.0
    assert ours(x, "fp8_e4m3", overflow="saturate")[2:].tolist() == [448.0, 448.0, -448.0, 448.0]


def test_fnuz_formats_have_no_negative_zero() -> None:
    x = np.array([-0.0, -1e-30, -1e-45], np.float32)
    for name in ("fp8_e4m3fnuz", "fp8_e5m2fnuz"):
        y = ours(x, name)
        assert (y == 0).all() and not np.signbit(y).any()
        y = ours(x, name, flush_subnormals=True)
        assert not np.signbit(y).any()


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_integers_match_rint_and_clip(name: str, random_patterns: np.ndarray) -> None:
    fmt = numscope.get_format(name)
    rng = np.random.default_rng(5)
    x = np.concatenate(
        [
            rng.uniform(-2 * fmt.max, 2 * fmt.max, 200_000).astype(np.float32),
            np.arange(-2 * fmt.max, 2 * fmt.max, 0.5, dtype=np.float32),  # every tie
            random_patterns[~np.isnan(random_patterns)],
        ]
    )
    with np.errstate(all="ignore"):
        # + 0: integer codes have no -0 (numpy's rint keeps the sign of a negative value rounded to 0)
        expected = np.clip(np.rint(x), -fmt.max, fmt.max).astype(np.float32) + np.float32(0)
    assert_bits_equal(ours(x, name), expected, inputs=x)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp4_e2m1", "bf16", "e3m4"])
def test_flush_subnormals_zeroes_exactly_the_subnormals(name: str) -> None:
    fmt = numscope.get_format(name)
    codes = all_codes(name)
    codes = codes[np.isfinite(codes)]
    y = ours(codes, name, flush_subnormals=True)
    sub = np.abs(codes) < fmt.min_normal
    assert (y[sub] == 0).all() and np.array_equal(y[~sub], codes[~sub])
    assert np.array_equal(np.signbit(y[sub]), np.signbit(codes[sub]))


def test_e8m0_below_2_pow_minus_126_rounds_to_nearest_by_value() -> None:
    """float32 subnormals: nearest of 2^-127 and 2^-126 by value, the tie 1.5 * 2^-127 upward (as in every
    binade above), everything below 2^-127 to 2^-127 (E8M0 has no zero); ml_dtypes >= 0.7.0 agrees."""
    patterns = np.concatenate(
        [np.arange(1, 0x800000, 7, dtype=np.uint32), np.array([0x400000, 0x5FFFFF, 0x600000], np.uint32)]
    )
    x = patterns.view(np.float32)
    expected = np.where(x.astype(np.float64) >= 1.5 * 2.0**-127, 2.0**-126, 2.0**-127).astype(np.float32)
    assert_bits_equal(ours(x, "e8m0"), expected, inputs=x)
    assert_bits_equal(ours(x, "e8m0"), reference_cast(x, "e8m0"), inputs=x)
    normal = np.array([1.0, 1.5 * 2.0**-126, np.nextafter(np.float32(1.5), np.float32(0)), 1.5], np.float32)
    assert ours(normal, "e8m0").tolist() == [1.0, 2.0**-125, 1.0, 2.0]


def test_float64_input_rounds_once_not_twice() -> None:
    """float64 goes to float32 rounded to odd, so nearest rounding is that of the float64 value itself:
    numpy's direct float64 -> float16 cast on values a hair off fp16 midpoints (where going through
    float32's nearest would land on the midpoint and round to even, the wrong way half the time)."""
    rng = np.random.default_rng(0)
    low = rng.integers(1, 0x7BFF, 20_000).astype(np.uint16).view(np.float16)
    high = np.nextafter(low, np.float16(np.inf))
    midpoint = (low.astype(np.float64) + high.astype(np.float64)) / 2
    nudge = np.abs(midpoint) * 2.0**-40 * rng.choice([-1.0, 1.0], midpoint.size)
    x = np.concatenate([midpoint + nudge, -(midpoint + nudge), midpoint, [1e300, -1e300, 1e-300, np.inf]])
    ours64 = numscope.quantize(torch.from_numpy(x), "fp16", overflow="propagate").numpy()
    assert ours64.dtype == np.float64
    with np.errstate(over="ignore"):  # ±1e300 overflow to ±inf, as they should
        expected = x.astype(np.float16).astype(np.float64)
        through_float32 = x.astype(np.float32).astype(np.float16).astype(np.float64)
    assert np.array_equal(ours64, expected)
    assert not np.array_equal(through_float32, expected)  # the double rounding this avoids
    # bf16: 1 + 2^-8 + 2^-40 lies just above the midpoint of 1 and 1 + 2^-7; float32 alone would drop 2^-40
    assert numscope.quantize(torch.tensor([1 + 2.0**-8 + 2.0**-40], dtype=torch.float64), "bf16").item() == (
        1 + 2.0**-7
    )
    assert numscope.quantize(torch.tensor([1 + 2.0**-30], dtype=torch.float64), "fp32").item() == 1.0


def test_the_bit_comparison_itself_tells_signed_zeros_apart_and_matches_nans() -> None:
    values = np.array([0.0, np.nan, 1.0], dtype=np.float32)
    assert_bits_equal(values, values.copy())
    with pytest.raises(AssertionError, match="1 of 3 differ"):
        assert_bits_equal(np.array([-0.0, np.nan, 1.0], dtype=np.float32), values)
    with pytest.raises(AssertionError, match="float32"):
        assert_bits_equal(values.astype(np.float64), values)
