"""MX and NVFP4 against a plain numpy reference written from the spec text, block by block."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import numscope
from bits import assert_bits_equal

# through the native quantizers (the default) and through the eager reference (tests/formats/conftest.py)
pytestmark = pytest.mark.usefixtures("quantizer_path")

ELEMENT_DTYPE = {
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
    "fp6_e3m2": ml_dtypes.float6_e3m2fn,
    "fp6_e2m3": ml_dtypes.float6_e2m3fn,
    "fp4_e2m1": ml_dtypes.float4_e2m1fn,
}
MX = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1", "mxint8"]


def saturating_cast(values: np.ndarray, element) -> np.ndarray:
    """The element cast with saturation: clip to ±max first, then ml_dtypes (or rint for MXINT8)."""
    clipped = np.clip(values, -element.max, element.max).astype(np.float32)
    if isinstance(element, numscope.IntFormat):
        scale = 2.0**element.fraction_bits
        codes = np.clip(np.rint(values.astype(np.float64) * scale), element.min_code, element.max_code)
        return (codes / scale).astype(np.float32) + np.float32(0)  # the codes have no -0
    return clipped.astype(ELEMENT_DTYPE[element.name]).astype(np.float32)


def mx_block(block: np.ndarray, fmt) -> np.ndarray:
    """OCP MX v1.0: X = 2^(floor(log2 amax) − emax_elem), rceil 2^ceil(log2(amax/max_elem)), clamped."""
    if not np.isfinite(block).all():
        return np.full_like(block, np.nan)
    amax = float(np.abs(block).max())
    if amax == 0:
        return block * np.float32(0)  # ±0 keep their sign
    element = fmt.element
    floor_log2 = math.frexp(amax)[1] - 1
    if fmt.scale_rule == "rceil":
        ratio = float(np.float32(amax) / np.float32(element.max))
        mantissa, exponent = math.frexp(ratio)
        shared = (exponent - 1 if mantissa == 0.5 else exponent) if ratio > 0 else -127
    elif fmt.scale_rule == "ceil":  # ceil(log2 amax) - emax
        shared = floor_log2 + (amax != 2.0**floor_log2) - element.emax
    elif fmt.scale_rule == "even":  # amax rounded half up to the element's mantissa bits, then floor
        bits = element.mantissa_bits if hasattr(element, "mantissa_bits") else element.int_bits - 2
        significand = amax / 2.0**floor_log2  # in [1, 2)
        shared = floor_log2 + (significand >= 2 - 2.0 ** -(bits + 1)) - element.emax
    else:
        shared = floor_log2 - element.emax
    shared = min(max(shared, -127), 127)
    scale = 2.0**shared
    elements = saturating_cast((block.astype(np.float64) / scale).astype(np.float32), element)
    # the exact product, then float32, saturating: E4M3's 256 under 2^120 is 2^128, past float32's range
    big = float(np.finfo(np.float32).max)
    return np.clip(elements.astype(np.float64) * scale, -big, big).astype(np.float32)


def nvfp4_reference(x: np.ndarray, divide: bool = False) -> np.ndarray:
    """NVFP4 along the last axis, S = 448·6/amax (the largest float32 where that overflows).

    Transformer Engine's order (the default): s_b = e4m3(amax_b · (S · (1/6))), e = e2m1(v · (1 / (s_b ·
    (1/S)))), value e · (s_b · (1/S)). ``divide``: s_b = e4m3(amax_b/6·S); e = e2m1(v/(s_b/S)); e·(s_b/S).
    """
    f32 = np.float32
    big = np.finfo(np.float32).max
    amax = f32(np.abs(x).max()) if x.size else f32(0)
    encode = f32(min(f32(f32(448 * 6) / amax), big)) if np.isfinite(amax) and amax > 0 else f32(1)
    e2m1 = numscope.get_format("fp4_e2m1")
    out = np.empty_like(x)
    for index in np.ndindex(*x.shape[:-1]):
        row = x[index]
        padded = np.concatenate([row, np.zeros((-row.size) % 16, np.float32)])
        result = []
        for block in padded.reshape(-1, 16):
            if not np.isfinite(block).all():
                result.append(np.full(16, np.nan, np.float32))
                continue
            block_amax = f32(np.abs(block).max())
            if divide:
                wanted = f32(f32(block_amax / f32(6)) * encode)
            else:
                wanted = f32(block_amax * f32(encode * f32(1 / 6)))
            stored = np.clip(np.array([wanted], np.float32), 0, 448)
            stored = stored.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)[0]
            decode = f32(stored / encode) if divide else f32(stored * f32(f32(1) / encode))
            if decode == 0:  # the block underflows: signed zeros
                result.append(block * np.float32(0))
                continue
            scaled = (block / decode) if divide else block * f32(min(f32(f32(1) / decode), big))
            elements = saturating_cast(scaled.astype(np.float32), e2m1)
            result.append((elements * decode).astype(np.float32))
        out[index] = np.concatenate(result)[: row.size]
    return out


def mx_reference(x: np.ndarray, fmt, axis: int = -1) -> np.ndarray:
    moved = np.moveaxis(x, axis, -1)
    out = np.empty_like(moved)
    for index in np.ndindex(*moved.shape[:-1]):
        row = moved[index]
        padded = np.concatenate([row, np.zeros((-row.size) % fmt.block_size, np.float32)])
        blocks = [mx_block(b, fmt) for b in padded.reshape(-1, fmt.block_size)]
        out[index] = np.concatenate(blocks)[: row.size]
    return np.moveaxis(out, -1, axis)


def reference(x: np.ndarray, name: str, axis: int = -1) -> np.ndarray:
    fmt = numscope.get_format(name)
    if fmt.tensor_scale:
        moved = np.ascontiguousarray(np.moveaxis(x, axis, -1))
        return np.moveaxis(nvfp4_reference(moved, fmt.scale_math == "divide"), -1, axis)
    return mx_reference(x, fmt, axis)


def sample(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Values spanning many binades, so that blocks exercise small scales, large scales and subnormals."""
    rng = np.random.default_rng(seed)
    magnitude = 2.0 ** rng.integers(-30, 30, size=(*shape[:-1], 1))
    return (rng.standard_normal(shape) * magnitude * 2.0 ** rng.uniform(-8, 8, size=shape)).astype(np.float32)


def ours(x: np.ndarray, name: str, **kwargs) -> np.ndarray:
    return numscope.quantize(torch.from_numpy(np.ascontiguousarray(x)), name, **kwargs).numpy()


@pytest.mark.parametrize(
    "name",
    [
        *MX,
        *(
            f"{base}@{rule}"
            for base in ("mxfp8_e4m3", "mxfp4_e2m1", "mxint8")
            for rule in ("rceil", "ceil", "even")
        ),
        "mxfp6_e2m3@even",
        "mxint8@full",
        "nvfp4",
        "nvfp4@divide",
    ],
)
@pytest.mark.parametrize("shape", [(6, 64), (5, 70), (3, 17)])
def test_block_formats_match_the_spec_reference(name: str, shape: tuple[int, ...]) -> None:
    x = sample(shape, seed=shape[1])
    assert_bits_equal(ours(x, name), reference(x, name))


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp4_e2m1@rceil", "nvfp4"])
@pytest.mark.parametrize("axis", [0, 1, -2])
def test_blocks_run_along_the_chosen_axis(name: str, axis: int) -> None:
    x = sample((40, 3, 20), seed=axis + 7)
    got = ours(x, name, scaling=numscope.Scaling("block", axis=axis))
    assert_bits_equal(got, reference(x, name, axis))
    assert not np.array_equal(got, ours(x, name)) or axis == -1


def test_extreme_blocks_clamp_the_e8m0_scale() -> None:
    """Blocks of float32 subnormals and of values near float32 max: the shared exponent hits ±127."""
    x = np.stack([np.full(32, 1e-44, np.float32), np.full(32, 3e38, np.float32), np.linspace(-1, 1, 32)])
    x = x.astype(np.float32)
    for name in [*MX, "mxfp8_e4m3@rceil", "nvfp4"]:
        assert_bits_equal(ours(x, name), reference(x, name))


@pytest.mark.parametrize("name", [*MX, "mxfp8_e4m3@rceil", "nvfp4"])
def test_zero_blocks_give_zero_and_bad_blocks_give_nan(name: str) -> None:
    x = sample((4, 64), seed=3)
    x[0] = 0.0
    x[1, :32] = 0.0
    x[2, 5] = np.nan
    x[3, 40] = -np.inf
    y = ours(x, name)
    block = numscope.get_format(name).block_size
    assert (y[0] == 0).all() and not np.isnan(y[0]).any()
    assert (y[1, :32] == 0).all()
    assert np.isnan(y[2, :block]).all() and not np.isnan(y[2, block:]).any()
    start = 40 // block * block
    assert np.isnan(y[3, start : start + block]).all() and not np.isnan(y[3, :start]).any()
    assert not np.isnan(ours(np.zeros((2, 48), np.float32), name)).any()


def test_nvfp4_of_an_all_zero_tensor_is_zero() -> None:
    y = ours(np.zeros((3, 20), np.float32), "nvfp4")
    assert (y == 0).all()


@pytest.mark.parametrize("name", [*MX, "mxfp4_e2m1@rceil", "nvfp4"])
def test_block_encode_decodes_to_quantize(name: str) -> None:
    x = torch.from_numpy(sample((4, 70), seed=11))
    encoded = numscope.encode(x, name)
    decoded = encoded.decode()
    assert torch.equal(decoded, numscope.quantize(x, name))
    fmt = numscope.get_format(name)
    blocks = math.ceil(70 / fmt.block_size) * 4
    assert encoded.scales.shape == (4, blocks // 4, 1) and encoded.scales.dtype == torch.uint8
    assert encoded.bits == 4 * 70 * fmt.element.bits + blocks * fmt.scale_format.bits + 32 * fmt.tensor_scale


def test_mxfp8_codes_are_ml_dtypes_bit_patterns() -> None:
    x = torch.from_numpy(sample((4, 64), seed=12))
    encoded = numscope.encode(x, "mxfp8_e4m3")
    elements = encoded.codes.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scales = encoded.scales.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    assert np.array_equal((elements * scales).reshape(4, 64), numscope.quantize(x, "mxfp8_e4m3").numpy())
