"""Generic IEEE-like eXmY formats against a brute-force reference, bit for bit.

ml_dtypes has no dtype for most of them (no zero-mantissa float with a sign, no e2m5), so the reference
here enumerates every finite value of the format from its bit layout and picks the nearest one by hand.
Ties go to the neighbour whose value is an even multiple of the gap between the two neighbours: inside a
binade that is the even mantissa (IEEE 754's ties-to-even), across a binade boundary the power of two,
and for formats without mantissa bits it is the larger power of two (the rule of every binade of
``e8m0``, as in ml_dtypes >= 0.7.0). Overflow is a tie or a nearer value at the virtual next power of two
2^(emax+1): inf with ``overflow="propagate"``, ±max with ``"saturate"``; ±inf stay ±inf, NaN stays NaN.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import numscope
from bits import assert_bits_equal

# through the native quantizers (the default) and through the eager reference (tests/formats/conftest.py)
pytestmark = pytest.mark.usefixtures("quantizer_path")

GENERIC = ["e2m0", "e3m0", "e4m0", "e5m0", "e7m0", "e2m1", "e3m1", "e2m5", "e4m2", "e5m4"]


def grid(name: str) -> np.ndarray:
    """Every non-negative finite value of the IEEE-like ``name`` (ascending, float64), from its bit layout."""
    e, m = int(name[1]), int(name[3:])
    bias = 2 ** (e - 1) - 1
    values = []
    for biased in range(2**e - 1):  # the all-ones exponent is inf and NaN
        for mantissa in range(2**m):
            if biased == 0:
                values.append(mantissa * 2.0 ** (1 - bias - m))
            else:
                values.append((2**m + mantissa) * 2.0 ** (biased - bias - m))
    values = np.unique(np.array(values, np.float64))
    return values


def reference(x: np.ndarray, name: str, overflow: str) -> np.ndarray:
    """Nearest value of ``name`` to float32 ``x`` by exhaustive search over the grid (see the module doc)."""
    values = grid(name)
    e = int(name[1])
    emax = 2 ** (e - 1) - 1
    top = 2.0 ** (emax + 1)  # the virtual next value: reaching it is overflow
    candidates = np.append(values, top)
    with np.errstate(invalid="ignore"):  # signalling NaN patterns
        wide = x.astype(np.float64)
    magnitude = np.abs(wide)
    finite = np.isfinite(magnitude)
    safe = np.where(finite, magnitude, 0.0)
    index = np.clip(np.searchsorted(candidates, safe, side="right") - 1, 0, len(candidates) - 2)
    low, high = candidates[index], candidates[index + 1]
    gap = high - low
    up = (high - safe < safe - low) | ((high - safe == safe - low) & (np.mod(high / gap, 2) == 0))
    nearest = np.where(safe >= top, top, np.where(up, high, low))
    overflowed = nearest >= top
    if overflow == "saturate":
        nearest = np.where(overflowed, values[-1], nearest)
    else:
        nearest = np.where(overflowed, np.inf, nearest)
    result = np.where(finite, nearest, magnitude)
    result = np.copysign(result, wide).astype(np.float32)
    return np.where(np.isnan(x), np.float32(np.nan), result)


def inputs(name: str) -> np.ndarray:
    """Every grid value and midpoint (with their float32 neighbours), huge values, specials, float32
    subnormals and random float32 bit patterns, all with both signs."""
    values = grid(name)
    top = 2.0 ** (2 ** (int(name[1]) - 1))
    points = np.concatenate([values, (values[1:] + values[:-1]) / 2, [(values[-1] + top) / 2, top]])
    points = points.astype(np.float32)
    assert np.array_equal(points.astype(np.float64)[: len(values)], values), (
        "the grid must be exact in float32"
    )
    neighbours = [np.nextafter(points, np.float32(np.inf)), np.nextafter(points, np.float32(-np.inf))]
    huge = np.array(
        [3e38, 2.0**127, 1.5 * 2.0**127, np.finfo(np.float32).max, 2.0**100, 1e20, 65536.0], np.float32
    )
    specials = np.array([0.0, np.inf, np.nan, 1e-45, 2.0**-126, 2.0**-127, 1e-40], np.float32)
    rng = np.random.default_rng(7)
    patterns = rng.integers(0, 2**32, size=50_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    scales = np.float32(2.0) ** rng.integers(-20, 20, size=50_000).astype(np.float32)
    ranged = (rng.uniform(0, 2, size=50_000).astype(np.float32) * scales).astype(np.float32)
    x = np.concatenate([points, *neighbours, huge, specials, patterns, ranged])
    return np.concatenate([x, -x])


@pytest.mark.parametrize("name", GENERIC)
def test_the_reference_grid_is_the_format(name: str) -> None:
    fmt = numscope.get_format(name)
    values = grid(name)
    assert values[-1] == fmt.max and values[1] == fmt.min_subnormal
    assert fmt.min_normal in values and fmt.overflow_threshold == (values[-1] + 2.0 ** (fmt.emax + 1)) / 2


@pytest.mark.parametrize("name", GENERIC)
@pytest.mark.parametrize("overflow", ["saturate", "propagate"])
def test_generic_formats_match_the_brute_force_reference(name: str, overflow: str) -> None:
    x = inputs(name)
    actual = numscope.quantize(torch.from_numpy(x), name, overflow=overflow).numpy()
    assert_bits_equal(actual, reference(x, name, overflow), inputs=x)


@pytest.mark.parametrize("name", ["e2m0", "e3m0", "e4m0", "e7m0", "e2m1", "e2m5"])
def test_huge_values_overflow_instead_of_vanishing(name: str) -> None:
    """|x| >= 2^127 used to round to 0 in formats without mantissa bits (a spacing of 2^127 has no normal
    float32 inverse); it overflows like any other value beyond max."""
    fmt = numscope.get_format(name)
    x = torch.tensor([3e38, -3e38, 2.0**127, float(np.finfo(np.float32).max)])
    assert numscope.quantize(x, name).tolist() == [fmt.max, -fmt.max, fmt.max, fmt.max]
    assert numscope.quantize(x, name, overflow="propagate").tolist() == [np.inf, -np.inf, np.inf, np.inf]
    assert numscope.quantize(x, name, rounding="zero").tolist() == [fmt.max, -fmt.max, fmt.max, fmt.max]
    stochastic = numscope.quantize(x, name, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    assert stochastic.tolist() == [fmt.max, -fmt.max, fmt.max, fmt.max]


@pytest.mark.parametrize("name", ["e4m0", "e2m5"])
def test_generic_codes_decode_to_the_quantized_values(name: str) -> None:
    x = inputs(name)
    x = x[~np.isnan(x)]
    tensor = torch.from_numpy(x)
    for overflow in ("saturate", "propagate"):
        expected = numscope.quantize(tensor, name, overflow=overflow).numpy()
        decoded = numscope.encode(tensor, name, overflow=overflow).decode().numpy()
        assert_bits_equal(decoded, expected, inputs=x)


def test_encode_refuses_nan_where_no_code_holds_it() -> None:
    """Without mantissa bits the all-ones exponent is one code, inf: NaN has none (it encoded as inf)."""
    x = torch.tensor([1.0, float("nan")])
    assert torch.isnan(numscope.quantize(x, "e4m0")[1])
    with pytest.raises(ValueError, match="e4m0 has no code for NaN"):
        numscope.encode(x, "e4m0")
    assert torch.isnan(numscope.encode(x, "e4m1").decode()[1])
