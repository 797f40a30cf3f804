"""Scaling: tensor, row/column, tiles, delayed; encode/decode round trips."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import numscope
from numscope import DelayedScaler, Scaling


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_tensor_scale_is_the_correctly_rounded_quotient() -> None:
    """s = fp32(max / amax), one rounding (``448 / t`` in torch is reciprocal-then-multiply: two)."""
    rng = np.random.default_rng(0)
    for amax in rng.uniform(1e-3, 1e3, size=300).astype(np.float32):
        x = torch.tensor([float(amax), -0.5 * float(amax)])
        scale = numscope.encode(x, "fp8_e4m3", scaling="tensor").scales
        assert scale.item() == np.float32(448) / amax


def test_tensor_scaling_maps_amax_to_max_and_descales() -> None:
    x = randn(64, 64) * 1e-3
    y = numscope.quantize(x, "fp8_e4m3", scaling="tensor")
    scale = np.float32(448) / np.float32(x.abs().max().item())
    expected = (x.numpy() * scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * (
        np.float32(1) / scale
    )
    assert np.array_equal(y.numpy(), expected)
    assert y.abs().max().item() == pytest.approx(x.abs().max().item(), rel=1e-6)


def test_margin_and_power_of_two() -> None:
    x = randn(100) * 3.0
    amax = x.abs().max().item()
    scale = numscope.encode(x, "fp8_e4m3", scaling=Scaling("tensor", margin=2)).scales.item()
    assert scale == np.float32(np.float32(448) / np.float32(amax)) / 4
    pow2 = numscope.encode(x, "fp8_e4m3", scaling=Scaling("tensor", power_of_two=True)).scales.item()
    assert np.frexp(pow2)[0] == 0.5 and pow2 <= 448 / amax < 2 * pow2
    y = numscope.quantize(x, "fp8_e4m3", scaling=Scaling("tensor", power_of_two=True))
    assert torch.equal(y, numscope.quantize(x * pow2, "fp8_e4m3") / pow2)


@pytest.mark.parametrize("kind", ["tensor", "row", "column"])
def test_all_zero_tensor_quantizes_to_zero(kind: str) -> None:
    for name in ("fp8_e4m3", "int8", "fp4_e2m1"):
        y = numscope.quantize(torch.zeros(4, 8), name, scaling=kind)
        assert torch.equal(y, torch.zeros(4, 8))


def test_row_and_column_scaling_use_one_scale_per_slice() -> None:
    x = randn(8, 16) * torch.logspace(-3, 3, 8).reshape(8, 1)
    rows = numscope.quantize(x, "int8", scaling="row")
    for i in range(8):
        assert torch.equal(rows[i], numscope.quantize(x[i], "int8", scaling="tensor"))
    cols = numscope.quantize(x, "int8", scaling="column")
    for j in range(16):
        assert torch.equal(cols[:, j], numscope.quantize(x[:, j].contiguous(), "int8", scaling="tensor"))
    assert not torch.equal(rows, cols)


@pytest.mark.parametrize("block_shape", [(1, 128), (128, 128), (1, 32), (32, 32)])
def test_tile_scaling_pads_and_matches_per_tile_tensor_scaling(block_shape: tuple[int, int]) -> None:
    x = randn(150, 200, seed=3) * torch.logspace(-2, 2, 200)
    y = numscope.quantize(x, "fp8_e4m3", scaling=Scaling("block", block_shape=block_shape))
    m, n = block_shape
    for r in range(0, 150, m):
        for c in range(0, 200, n):
            tile = x[r : r + m, c : c + n].contiguous()
            assert torch.equal(y[r : r + m, c : c + n], numscope.quantize(tile, "fp8_e4m3", scaling="tensor"))


def test_delayed_scaling_uses_the_history_and_round_trips_its_state() -> None:
    scaler = DelayedScaler(Scaling("delayed", history_len=3))
    first = randn(32)
    y = numscope.quantize(first, "fp8_e4m3", scaling=scaler)  # first call: its own amax
    assert torch.equal(y, numscope.quantize(first, "fp8_e4m3", scaling="tensor"))
    big, small = randn(32, seed=1) * 10, randn(32, seed=2) * 0.1
    numscope.quantize(big, "fp8_e4m3", scaling=scaler)
    y = numscope.quantize(small, "fp8_e4m3", scaling=scaler)  # scale from max(history) = amax(big)
    scale = np.float32(448) / np.float32(big.abs().max().item())
    assert torch.equal(y, numscope.quantize(small * float(scale), "fp8_e4m3") * float(np.float32(1) / scale))
    state = scaler.state_dict()
    assert state["steps"] == 3 and state["amax_history"][0].item() == small.abs().max().item()
    again = DelayedScaler(Scaling("delayed", history_len=3))
    again.load_state_dict(state)
    probe = randn(32, seed=4)
    assert torch.equal(
        numscope.quantize(probe, "fp8_e4m3", scaling=scaler),
        numscope.quantize(probe, "fp8_e4m3", scaling=again),
    )
    for _ in range(3):  # big and probe fall out of a history of 3
        numscope.quantize(small, "fp8_e4m3", scaling=scaler)
    assert scaler.history_amax().item() == small.abs().max().item()


def test_delayed_most_recent_uses_only_the_last_amax() -> None:
    scaler = DelayedScaler(Scaling("delayed", amax_compute="most_recent"))
    numscope.quantize(randn(16) * 100, "fp8_e4m3", scaling=scaler)
    numscope.quantize(randn(16), "fp8_e4m3", scaling=scaler)
    assert scaler.history_amax().item() == randn(16).abs().max().item()


def test_delayed_scaler_skips_non_finite_amax() -> None:
    scaler = DelayedScaler()
    numscope.quantize(randn(16), "fp8_e4m3", scaling=scaler)
    numscope.quantize(torch.tensor([float("inf"), 1.0]), "fp8_e4m3", scaling=scaler)
    assert scaler.steps == 1 and torch.isfinite(scaler.amax_history).all()


SCALINGS = [None, "tensor", "row", "column", Scaling("tensor", margin=1, power_of_two=True)]
ELEMENTS = [
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_e4m3fnuz",
    "fp6_e3m2",
    "fp4_e2m1",
    "bf16",
    "fp16",
    "tf32",
    "e3m4",
    "int8",
    "int4",
    "e8m0",
]


@pytest.mark.parametrize("name", ELEMENTS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_encode_decodes_to_quantize(name: str, scaling) -> None:
    x = randn(6, 40, seed=5) * torch.logspace(-4, 4, 40)
    if name == "e8m0":
        x = x.abs() + 1e-30
    encoded = numscope.encode(x, name, scaling=scaling)
    expected = numscope.quantize(x, name, scaling=scaling)
    decoded = encoded.decode()
    assert torch.equal(torch.nan_to_num(decoded, nan=7.0), torch.nan_to_num(expected, nan=7.0))
    assert encoded.bits >= x.numel() * numscope.get_format(name).bits


def test_encode_with_delayed_scaling_decodes_to_quantize() -> None:
    a, b = DelayedScaler(), DelayedScaler()
    for seed in range(3):
        x = randn(50, seed=seed) * (seed + 1)
        assert torch.equal(
            numscope.encode(x, "fp8_e4m3", scaling=a).decode(), numscope.quantize(x, "fp8_e4m3", scaling=b)
        )


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("fp8_e4m3", ml_dtypes.float8_e4m3fn),
        ("fp8_e5m2", ml_dtypes.float8_e5m2),
        ("fp8_e4m3fnuz", ml_dtypes.float8_e4m3fnuz),
        ("fp8_e5m2fnuz", ml_dtypes.float8_e5m2fnuz),
    ],
)
def test_fp8_codes_are_ml_dtypes_bit_patterns(name: str, dtype) -> None:
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(dtype).astype(np.float32)
    x = np.concatenate([values, np.array([1e6, -1e6, np.inf, -np.inf, np.nan], np.float32)])
    encoded = numscope.encode(torch.from_numpy(x), name, overflow="propagate")
    expected = x.astype(dtype).view(np.uint8)
    got = encoded.codes.numpy()
    is_nan = np.isnan(x.astype(dtype).astype(np.float32))
    assert np.array_equal(got[~is_nan], expected[~is_nan])
    assert np.isnan(got[is_nan].view(dtype).astype(np.float32)).all()


def test_quantize_keeps_shape_and_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = randn(3, 5, 7).to(dtype)
        for name, scaling in [("fp8_e4m3", "tensor"), ("mxfp4_e2m1", None), ("int8", "row")]:
            y = numscope.quantize(x, name, scaling=scaling)
            assert y.shape == x.shape and y.dtype == x.dtype
    assert numscope.quantize(torch.tensor(3.3), "fp4_e2m1").item() == 3.0
    assert numscope.quantize(torch.tensor(3.3), "mxfp4_e2m1").shape == ()


EMPTY_SCALINGS = [None, "tensor", "row", "column", Scaling("block", block_shape=(1, 4)), "delayed"]


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("shape", [(0, 8), (8, 0), (0,), (2, 0, 3)])
@pytest.mark.parametrize("name", [fmt.name for fmt in numscope.formats()])
def test_an_empty_tensor_quantizes_to_itself_under_every_scaling(name: str, shape: tuple, fast: bool) -> None:
    """An MLM head over masked positions sees a batch without a masked token: nothing to scale or round,
    no amax recorded (before, torch's 'amax(): Expected reduction dim' error)."""
    from numscope.formats import fast_enabled, set_fast

    before = fast_enabled()
    set_fast(fast)
    try:
        block = isinstance(numscope.get_format(name), numscope.BlockFormat)
        for scaling in [None, Scaling("block", axis=0)] if block else EMPTY_SCALINGS:
            for dtype in (torch.float32, torch.float16):
                x = torch.empty(shape, dtype=dtype)
                delayed = DelayedScaler(Scaling("delayed")) if scaling == "delayed" else None
                out = numscope.quantize(x, name, scaling=delayed or scaling)
                assert out.shape == x.shape and out.dtype == dtype, (name, scaling)
                if delayed is not None:
                    assert delayed.steps == 0 and not delayed.amax_history.any()
                if not (isinstance(scaling, Scaling) and scaling.block_shape is not None):
                    decoded = numscope.encode(x, name, scaling=delayed or scaling).decode()
                    assert decoded.shape == x.shape, (name, scaling)
    finally:
        set_fast(before)


def test_an_empty_tensor_still_gets_the_argument_checks() -> None:
    empty = torch.empty(0, 8)
    with pytest.raises(ValueError, match="needs block_shape"):
        numscope.quantize(empty, "fp8_e4m3", scaling=Scaling("block"))
    with pytest.raises(ValueError, match="brings its own block scaling; scaling 'tensor' does not apply"):
        numscope.quantize(empty, "mxfp8_e4m3", scaling="tensor")
    with pytest.raises(ValueError, match=r"block axis 2 is out of range for a tensor of shape \(0, 8\)"):
        numscope.quantize(empty, "nvfp4", scaling=Scaling("block", axis=2))
    with pytest.raises(
        ValueError, match=r"block_shape \(2, 4\) needs a tensor of >= 2 dims, got shape \(0,\)"
    ):
        numscope.quantize(torch.empty(0), "fp8_e4m3", scaling=Scaling("block", block_shape=(2, 4)))


def test_a_delayed_scaler_keeps_its_history_through_an_empty_tensor() -> None:
    scaler = DelayedScaler(Scaling("delayed", history_len=4))
    x = randn(16, 16)
    numscope.quantize(x, "fp8_e4m3", scaling=scaler)
    history = scaler.amax_history.clone()
    assert numscope.quantize(torch.empty(0, 16), "fp8_e4m3", scaling=scaler).shape == (0, 16)
    assert scaler.steps == 1 and torch.equal(scaler.amax_history, history)
    assert torch.equal(scaler.scale_for(torch.empty(0), 448.0), torch.tensor(448.0) / x.abs().max())
