"""The edge cases found against Transformer Engine, torchao and microxcaling, and the recipe options of the
field (NVFP4 2-D / per-row / Four Over Six, MX CEIL and EVEN, MXINT8's -2.0, round half away, amax epsilon,
the random Hadamard transform, FP22 accumulation with promotion), each against a reference written here
from the published description."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import scipy.linalg
import torch

import numscope
from numscope.formats import native
from numscope.formats.transform import Rotation
from numscope.sites import accumulate_matmul

FLT_MAX = np.finfo(np.float32).max
E4M3 = ml_dtypes.float8_e4m3fn


def e4m3(values) -> np.ndarray:
    """Round to E4M3 with saturation (ml_dtypes is the reference cast)."""
    return np.clip(np.asarray(values, np.float32), -448, 448).astype(E4M3).astype(np.float32)


def e2m1(values) -> np.ndarray:
    return np.clip(np.asarray(values, np.float32), -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)


# -- 1. a tiny nonzero amax keeps its unit (scale clamped to the largest float32, as TE) -----------------


def te_current_scaling(x: np.ndarray, fmt_max: float, epsilon: float = 0.0) -> np.ndarray:
    """TE's current scaling reference: scale = max / max(amax, eps), inf -> FLT_MAX, 0 amax -> 1."""
    amax = max(np.float32(np.abs(x).max()), np.float32(epsilon))
    with np.errstate(over="ignore"):
        scale = np.float32(fmt_max) / np.float32(amax) if amax > 0 else np.float32(1)
    scale = np.float32(min(scale, FLT_MAX))
    return e4m3(x * scale) * np.float32(np.float32(1) / scale)


@pytest.mark.parametrize("value", [1e-37, 1e-38, 3e-41])
@pytest.mark.parametrize(
    "scaling",
    ["tensor", "row", "column", numscope.Scaling("block", block_shape=(1, 128))],
    ids=["tensor", "row", "column", "tile"],
)
def test_a_tiny_amax_keeps_its_unit(value: float, scaling) -> None:
    x = np.full((1, 128), value, np.float32)
    got = numscope.quantize(torch.from_numpy(x), "fp8_e4m3", scaling=scaling).numpy()
    expected = te_current_scaling(x, 448.0)
    assert (got > 0).all() and np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_the_issue_example_and_power_of_two_scales() -> None:
    x = torch.full((1, 128), 1e-37)
    tile = numscope.Scaling("block", block_shape=(1, 128))
    assert numscope.quantize(x, "fp8_e4m3", scaling=tile)[0, 0].item() == pytest.approx(1.0579e-37, rel=1e-4)
    two = numscope.quantize(x, "fp8_e4m3", scaling=numscope.Scaling("tensor", power_of_two=True))
    expected = e4m3(np.float32(1e-37) * np.float32(2.0**127)) * np.float32(2.0**-127)
    assert two[0, 0].item() == float(expected)  # the scale 2^127 (FLT_MAX rounded down to a power of two)
    scaler = numscope.DelayedScaler(numscope.Scaling("delayed"))
    assert (numscope.quantize(x, "fp8_e4m3", scaling=scaler) > 0).all()
    huge = np.full((1, 4), 3e38, np.float32)
    got = numscope.quantize(torch.from_numpy(huge), "fp8_e4m3", scaling="tensor").numpy()
    assert np.array_equal(got, te_current_scaling(huge, 448.0)) and np.isfinite(got).all()


def test_nvfp4_on_a_tiny_tensor() -> None:
    x = np.full((2, 32), 1e-37, np.float32)
    x[1, 3] = 3e-38
    got = numscope.quantize(torch.from_numpy(x), "nvfp4").numpy()
    assert (got > 0).all()
    assert np.array_equal(got, nvfp4_variant_reference(x, two_d=False, row=False, four_over_six=False))
    assert (numscope.quantize(torch.from_numpy(x), "nvfp4@divide") > 0).all()


# -- 2. @rceil where amax / max underflows ---------------------------------------------------------------


def test_rceil_scale_where_the_ratio_underflows() -> None:
    z = torch.zeros(1, 32)
    z[0, 0], z[0, 1] = 1e-41, 4.3e-43
    encoded = numscope.encode(z, "mxfp8_e5m2@rceil")
    assert encoded.scales.flatten()[0].item() == 0  # E8M0 code 0: 2^-127 (torchao's choice)
    expected = (z.numpy() * np.float32(2.0**127)).astype(ml_dtypes.float8_e5m2).astype(np.float32)
    expected = expected * np.float32(2.0**-127)
    got = numscope.quantize(z, "mxfp8_e5m2@rceil").numpy()
    assert np.array_equal(got, expected) and got[0, 1] == pytest.approx(4.484e-43, rel=1e-3)


@pytest.mark.parametrize("rule", ["floor", "ceil", "even", "rceil"])
@pytest.mark.parametrize("base", ["mxfp8_e5m2", "mxfp4_e2m1", "mxint8"])
def test_every_mx_rule_on_amaxes_near_float32s_bottom(rule: str, base: str) -> None:
    from test_formats_block import mx_reference  # the spec reference beside this file

    name = base if rule == "floor" else f"{base}@{rule}"
    rows = np.zeros((4, 32), np.float32)
    rows[0, :2] = [1e-41, 4.3e-43]
    rows[1, :3] = [2.0**-149, -(2.0**-140), 2.0**-127]
    rows[2, :2] = [1.1754942e-38, 3e-39]  # just below float32's smallest normal
    rows[3, :2] = [3e38, -1e38]
    got = numscope.quantize(torch.from_numpy(rows), name).numpy()
    expected = mx_reference(rows, numscope.get_format(name))
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


# -- 3. NVFP4's arithmetic order ------------------------------------------------------------------------


def test_nvfp4_follows_transformer_engines_order() -> None:
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16], x[0, 17] = 1.7567784786224365, 1.5685522556304932, 0.5
    te, divide = numscope.encode(x, "nvfp4"), numscope.encode(x, "nvfp4@divide")
    stored = {
        name: encoded.scales.flatten()[1].numpy().astype(np.uint8).view(E4M3).astype(np.float32)
        for name, encoded in (("te", te), ("divide", divide))
    }
    assert stored == {"te": 416.0, "divide": 384.0}
    assert numscope.quantize(x, "nvfp4")[0, 17].item() == pytest.approx(0.54376, abs=1e-5)
    assert numscope.quantize(x, "nvfp4@divide")[0, 17].item() == pytest.approx(0.50194, abs=1e-5)
    assert torch.equal(te.decode(), numscope.quantize(x, "nvfp4"))
    assert torch.equal(divide.decode(), numscope.quantize(x, "nvfp4@divide"))


# -- 4. no negative zero in the integer formats ---------------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "int4", "mxint8", "mxint8@full"])
def test_integer_zeros_are_positive_through_encode_and_decode(name: str) -> None:
    x = torch.tensor([-0.3, -0.0, -1e-9, 0.0, 100.0] + [1.0] * 27)
    scaling = "tensor" if name.startswith("int") else None
    got = numscope.quantize(x, name, scaling=scaling)
    assert not torch.signbit(got[got == 0]).any()
    assert torch.equal(
        got.view(torch.int32), numscope.encode(x, name, scaling=scaling).decode().view(torch.int32)
    )


# -- MX scale rules at their boundaries; MXINT8's -2.0 ---------------------------------------------------


@pytest.mark.parametrize(
    "name,amax,expected_exponent",
    [
        ("mxfp4_e2m1", 4.0, 0),  # floor(log2 4) - 2
        ("mxfp4_e2m1", 7.99, 0),
        ("mxfp4_e2m1@ceil", 4.0, 0),  # exact power of two: ceil = floor
        ("mxfp4_e2m1@ceil", 4.0000005, 1),
        ("mxfp4_e2m1@even", 6.99, 0),  # 1.7475 * 2^2: below the midpoint 1.75 of E2M1's 1.5 and 2
        ("mxfp4_e2m1@even", 7.0, 1),  # 1.75 * 2^2: the midpoint, rounded up
        ("mxfp8_e4m3@even", 2.0 * (2 - 2**-4) - 1e-6, -7),  # E4M3's emax is 8; below 1.9375 * 2
        ("mxfp8_e4m3@even", 2.0 * (2 - 2**-4), -6),
        ("mxfp4_e2m1@rceil", 6.0, 0),  # ceil(log2(6 / 6))
        ("mxfp4_e2m1@rceil", 6.0000005, 1),
    ],
)
def test_mx_scale_rules_at_their_boundaries(name: str, amax: float, expected_exponent: int) -> None:
    x = torch.zeros(1, 32)
    x[0, 5] = amax
    code = numscope.encode(x, name).scales.flatten()[0].item()
    assert code - 127 == expected_exponent


def test_mxint8_full_range_uses_minus_two() -> None:
    x = torch.full((1, 32), 0.5)
    x[0, 0] = -1.9921875  # -127.5 / 64: amax < 2, so the scale is 1; rounds to the code -128 (ties to even)
    assert numscope.quantize(x, "mxint8")[0, 0].item() == -127 / 64
    assert numscope.quantize(x, "mxint8@full")[0, 0].item() == -2.0
    assert numscope.quantize(-x, "mxint8@full")[0, 0].item() == 127 / 64  # +2.0 has no code


# -- NVFP4 2-D, per-row and Four Over Six, against references written from their descriptions -----------


def nvfp4_te_blocks(x: np.ndarray, block_amax: np.ndarray, encode: np.ndarray, target: float):
    """TE-order NVFP4 of the 16-blocks of 2-D ``x`` given each block's amax (rows, nblocks) and the encode
    scale (scalar or per row): (values, squared error per block)."""
    f32 = np.float32
    rows = x.shape[0]
    blocks = x.reshape(rows, -1, 16)
    encode = np.asarray(encode, np.float32).reshape(-1, 1) if np.ndim(encode) else f32(encode)
    stored = e4m3(np.minimum(block_amax * (encode * f32(1 / target)), FLT_MAX).astype(np.float32))
    decode = (stored * (f32(1) / encode)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.minimum(f32(1) / decode, FLT_MAX).astype(np.float32)
    elements = e2m1(blocks * inverse[..., None])
    elements = np.where((stored > 0)[..., None], elements, elements * 0)
    values = (elements * decode[..., None]).astype(np.float32)
    error = ((values.astype(np.float64) - blocks) ** 2).sum(-1)
    return values, error


def nvfp4_variant_reference(x: np.ndarray, two_d: bool, row: bool, four_over_six: bool) -> np.ndarray:
    rows, cols = x.shape
    f32 = np.float32
    target = f32((256 if four_over_six else 448) * 6)
    if row:
        with np.errstate(over="ignore"):
            encode = np.array([min(target / f32(np.abs(r).max()), FLT_MAX) for r in x], np.float32)
    else:
        with np.errstate(over="ignore"):
            encode = f32(min(target / f32(np.abs(x).max()), FLT_MAX))
    block_amax = np.abs(x).reshape(rows, -1, 16).max(-1)
    if two_d:
        padded = np.pad(np.abs(x), ((0, (-rows) % 16), (0, 0)))
        tiles = padded.reshape(-1, 16, cols // 16, 16).max(axis=(1, 3))
        block_amax = np.repeat(tiles, 16, axis=0)[:rows]
    six, six_error = nvfp4_te_blocks(x, block_amax, encode, 6.0)
    if not four_over_six:
        return six.reshape(rows, cols)
    four, four_error = nvfp4_te_blocks(x, block_amax, encode, 4.0)
    if two_d:  # one choice per tile: the tile's summed error

        def tile_sum(error: np.ndarray) -> np.ndarray:
            padded = np.pad(error, ((0, (-rows) % 16), (0, 0)))
            return np.repeat(padded.reshape(-1, 16, error.shape[1]).sum(1), 16, axis=0)[:rows]

        six_error, four_error = tile_sum(six_error), tile_sum(four_error)
    choose = (four_error < six_error)[..., None]
    return np.where(choose, four, six).reshape(rows, cols)


@pytest.mark.parametrize("options", ["2d", "row", "4over6", "2d@4over6", "row@4over6"])
@pytest.mark.parametrize("shape", [(32, 64), (21, 48)])
def test_nvfp4_variants_match_their_references(options: str, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(shape[0])
    x = (rng.standard_normal(shape) * 2.0 ** rng.integers(-6, 6, size=(shape[0], 1))).astype(np.float32)
    got = numscope.quantize(torch.from_numpy(x), f"nvfp4@{options}").numpy()
    expected = nvfp4_variant_reference(x, "2d" in options, "row" in options, "4over6" in options)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_four_over_six_chooses_four_where_it_is_closer() -> None:
    x = torch.zeros(1, 16)
    x[0, :4] = torch.tensor([4.0, 3.1, 3.0, 1.0])  # scaled to 6: 3.1 -> 4.65 -> 4 (0.52 off); to 4: exact 3
    six, chosen = numscope.quantize(x, "nvfp4"), numscope.quantize(x, "nvfp4@4over6")
    assert ((chosen - x) ** 2).sum() < ((six - x) ** 2).sum()
    assert numscope.get_format("nvfp4@2d").bits_per_element == 4 + 8 / 256


def test_2d_weights_quantize_alike_along_either_axis() -> None:
    w = torch.randn(48, 64)
    along_rows = numscope.quantize(w, "nvfp4@2d", scaling=numscope.Scaling("block", axis=-1))
    along_columns = numscope.quantize(w, "nvfp4@2d", scaling=numscope.Scaling("block", axis=0))
    assert torch.equal(along_rows, along_columns)  # one 16x16 scale serves fprop and dgrad


# -- round half away from zero, amax epsilon ------------------------------------------------------------


def away_reference(x: np.ndarray, dtype) -> np.ndarray:
    """Nearest grid value of every x; ties to the larger magnitude (brute force over every finite code)."""
    codes = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    grid = np.unique(codes[np.isfinite(codes)])
    distance = np.abs(x[:, None] - grid[None, :])
    best = distance.min(1, keepdims=True)
    candidates = np.where(distance == best, np.abs(grid)[None, :], -1)
    return grid[np.argmax(candidates, 1)]


@pytest.mark.parametrize("name,dtype", [("fp8_e4m3", E4M3), ("fp4_e2m1", ml_dtypes.float4_e2m1fn)])
def test_round_half_away_from_zero(name: str, dtype) -> None:
    fmt = numscope.get_format(name)
    codes = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    grid = np.unique(codes[np.isfinite(codes) & (np.abs(codes) <= fmt.max)])
    ties = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    x = np.concatenate([ties, grid, np.random.default_rng(0).uniform(-fmt.max, fmt.max, 500)]).astype(
        np.float32
    )
    got = numscope.quantize(torch.from_numpy(x), name, rounding="nearest_away").numpy()
    assert np.array_equal(got, away_reference(x, dtype))
    nearest = numscope.quantize(torch.from_numpy(ties), name).numpy()
    assert (np.abs(got[: ties.size]) >= np.abs(nearest)).all() and (got[: ties.size] != nearest).any()


def test_round_half_away_in_bf16_and_int8() -> None:
    tie = 1 + 2**-8  # halfway between bf16's 1 and 1 + 2^-7
    got = numscope.quantize(torch.tensor([tie, -tie, 1 + 3 * 2**-8]), "bf16", rounding="nearest_away")
    assert got.tolist() == [1 + 2**-7, -(1 + 2**-7), 1 + 2**-6]
    assert numscope.quantize(torch.tensor([2.5, -2.5, 3.5]), "int8", rounding="nearest_away").tolist() == [
        3,
        -3,
        4,
    ]


def test_amax_epsilon_as_transformer_engine() -> None:
    x = np.zeros((4, 8), np.float32)
    x[0, 0] = 1e-6
    scaling = numscope.Scaling("tensor", amax_epsilon=1e-3)
    got = numscope.quantize(torch.from_numpy(x), "fp8_e4m3", scaling=scaling).numpy()
    assert np.array_equal(got, te_current_scaling(x, 448.0, epsilon=1e-3))
    assert got[0, 0] != numscope.quantize(torch.from_numpy(x), "fp8_e4m3", scaling="tensor")[0, 0].item()
    with pytest.raises(ValueError, match="amax_epsilon must be a finite float >= 0"):
        numscope.Scaling("tensor", amax_epsilon=-1.0)


# -- the random Hadamard transform ----------------------------------------------------------------------


def test_rotation_is_a_signed_sylvester_hadamard_matrix() -> None:
    for size in (16, 32):
        q = Rotation(size, seed=3).matrix().double() * math.sqrt(size)
        hadamard = torch.from_numpy(scipy.linalg.hadamard(size).astype(np.float64))
        signs = torch.diagonal(q @ hadamard.t()) / size  # q = D H: D = diag(q Hᵀ) / size
        signs = signs.round()  # 1/sqrt(32) is not exact in float32
        assert torch.equal(signs.abs(), torch.ones(size, dtype=torch.float64))
        assert torch.allclose(q, signs[:, None] * hadamard, rtol=0, atol=1e-6)
        assert torch.allclose(q @ q.t() / size, torch.eye(size, dtype=torch.float64), atol=1e-6)
    assert not torch.equal(Rotation(16, 0).matrix(), Rotation(16, 1).matrix())


def test_rotated_quantization_preserves_the_gemm() -> None:
    """Two operands quantized in the rotated basis and rotated back multiply to the product of their
    rotated quantizations (the GEMM the hardware runs), up to float32 rounding."""
    generator = torch.Generator().manual_seed(0)
    dy, x = torch.randn(64, 8, generator=generator), torch.randn(64, 12, generator=generator)
    x[5, 3] = 40.0  # an outlier the rotation spreads over its block
    rotation = Rotation(16, seed=5)

    def quantize(tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return numscope.quantize(tensor, "mxfp4_e2m1", scaling=numscope.Scaling("block", axis=axis))

    emulated = rotation.quantized(dy, 0, quantize).t() @ rotation.quantized(x, 0, quantize)
    hardware = quantize(rotation.rotate(dy, 0), 0).t() @ quantize(rotation.rotate(x, 0), 0)
    assert torch.allclose(emulated, hardware, rtol=0, atol=1e-4)
    exact = dy.t() @ x
    plain = quantize(dy, 0).t() @ quantize(x, 0)
    assert (emulated - exact).norm() < (plain - exact).norm()  # the outlier's block no longer drowns


def test_a_plan_transform_reaches_the_wgrad_operands() -> None:
    plan = numscope.Plan.from_dict(
        {"numscope_plan": 1, "default": {"wgrad": {"format": "mxfp4_e2m1", "transform": "rht16"}}}
    )
    spec = plan.default.operand("wgrad", "input")
    assert spec.transform == "rht16" and "rht16" in spec.describe_scaling()
    assert numscope.Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(numscope.PlanError, match="unknown transform 'hadamard'"):
        numscope.OperandSpec("fp8_e4m3", transform="hadamard")
    torch.manual_seed(0)
    layer, reference = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    reference.load_state_dict(layer.state_dict())
    numscope.convert(layer, plan)
    x = torch.randn(48, 16)
    layer(x).sum().backward()
    reference(x).sum().backward()
    grad_output = torch.ones(48, 8)
    rotation = Rotation(16)

    def quantize(tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return numscope.quantize(tensor, "mxfp4_e2m1", scaling=numscope.Scaling("block", axis=axis))

    expected = rotation.quantized(grad_output, 0, quantize).t() @ rotation.quantized(x, 0, quantize)
    assert torch.allclose(layer.weight.grad, expected, atol=1e-5)
    assert not torch.allclose(layer.weight.grad, reference.weight.grad, atol=1e-3)


# -- FP22 accumulation and DeepSeek-V3's promotion --------------------------------------------------------


def fp22_reference(a: np.ndarray, b: np.ndarray, promote: int | None) -> np.ndarray:
    """Products summed exactly in chunks of 32, each partial and every addition rounded to E8M13; with
    ``promote``, each run of that many products then added in fp32."""
    fp22 = numscope.get_format("e8m13")

    def rounded(value: float) -> float:
        return numscope.quantize(torch.tensor([value], dtype=torch.float32), fp22).item()

    out = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            products = a[i].astype(np.float64) * b[:, j]
            partials = [
                rounded(float(np.float32(products[k : k + 32].sum()))) for k in range(0, a.shape[1], 32)
            ]
            group = len(partials) if promote is None else promote // 32
            total = np.float32(0)
            for start in range(0, len(partials), group):
                run = partials[start]
                for value in partials[start + 1 : start + group]:
                    run = rounded(run + value)
                total = np.float32(total + np.float32(run))
            out[i, j] = total
    return out


def test_fp22_accumulation_and_promotion() -> None:
    generator = torch.Generator().manual_seed(0)
    a, b = torch.rand(3, 512, generator=generator), torch.rand(512, 2, generator=generator)
    for name, promote in (("fp22", None), ("fp22_promote128", 128)):
        got = accumulate_matmul(a, b, name).numpy()
        expected = fp22_reference(a.numpy(), b.numpy(), promote)
        assert np.allclose(got, expected, rtol=2e-7, atol=0), name  # fp32 chunk sums: summation order
    exact = a.double() @ b.double()
    error = {
        name: (accumulate_matmul(a, b, name).double() - exact).abs().max().item()
        for name in ("fp22", "fp22_promote128", "fp32")
    }
    assert error["fp32"] < error["fp22_promote128"] < error["fp22"]


@pytest.mark.skipif(not native.available(), reason="the native quantizers could not be built")
@pytest.mark.parametrize("name", ["fp22", "fp22_promote128"])
def test_the_native_narrow_accumulation_gives_the_eager_loops_bits(name: str) -> None:
    """accumulate_matmul's one-pass C fold of the chunk sums against its eager loop, on shapes with batch
    dimensions, a contraction that is no multiple of 32, ties of the 13-bit rounding, overflow to inf and
    NaN inputs."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(2, 5, 300, generator=generator) * 1e3
    b = torch.randn(300, 7, generator=generator)
    a[0, 0, :64] = 3e38  # products past float32's range: inf, and inf - inf: NaN
    a[0, 1, 5] = float("nan")
    a[1, 2] = torch.ldexp(torch.ones(300), torch.randint(-140, -120, (300,), generator=generator))
    b[:, 3] = 1.0 + 2.0**-14  # sums on the midpoints of e8m13's grid
    before = native.native_enabled()
    try:
        fused = accumulate_matmul(a, b, name)
        native.set_native(False)
        eager = accumulate_matmul(a, b, name)
    finally:
        native.set_native(before)
    assert fused.isinf().any() and fused.isnan().any()
    assert torch.equal(fused.view(torch.int32), eager.view(torch.int32))


@pytest.mark.skipif(not native.available(), reason="the native quantizers could not be built")
def test_the_native_promoted_gemm_gives_the_eager_loops_bits(monkeypatch) -> None:
    """DeepSeek-V3's promoted GEMM (codes and per-tile scales registered, fp22 runs of 128 promoted with an
    FMA) in one pass of C against the eager loop: a batched activation by a 2-D weight (the scales
    broadcast), ties, overflow to inf and NaN inputs."""
    from numscope.formats.quantize import tile_quantize
    from numscope.sites.gemm import register_factors

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 384, generator=generator) * 10.0 ** torch.randint(
        -3, 4, (2, 6, 1), generator=generator
    )
    w = torch.randn(384, 130, generator=generator)
    x[0, 0, :200] = 3e38  # beyond E4M3 after scaling: fp22 partials overflow
    x[1, 1, 7] = float("nan")
    fmt = numscope.get_format("fp8_e4m3")

    def operand(t: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
        scaling = numscope.Scaling("block", block_shape=tile, amax_epsilon=1e-4, scale_from_decode=True)
        values, codes, decode = tile_quantize(t, fmt, scaling, factors=True)
        values = values.clone()
        register_factors(values, codes, decode)
        return values

    calls = []
    promoted_sum = native.promoted_sum
    monkeypatch.setattr(native, "promoted_sum", lambda *args: calls.append(1) or promoted_sum(*args))
    before = native.native_enabled()
    try:
        a, b = operand(x, (1, 128)), operand(w.t().contiguous(), (128, 128)).t()
        fused = accumulate_matmul(a, b, "fp22_promote128")
        native.set_native(False)
        eager = accumulate_matmul(a, b, "fp22_promote128")
    finally:
        native.set_native(before)
    assert calls, "the promoted GEMM did not take the registered codes and scales"
    assert fused.isinf().any() and fused.isnan().any() and fused.isfinite().any()
    assert torch.equal(fused.view(torch.int32), eager.view(torch.int32))


# -- MX blocks near float32's largest value: finite in, finite out ------------------------------------------

NEAR_MAX_CASES = [
    (name, rule, False)
    for name in ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1", "mxfp6_e2m3", "mxint8")
    for rule in ("floor", "ceil", "even", "rceil")
] + [("mxfp8_e4m3", "rceil", True), ("mxfp4_e2m1", "ceil", True)]  # the compiled kernels: one compile each


@pytest.mark.parametrize("name,rule,compiled", NEAR_MAX_CASES)
def test_mx_blocks_near_float32_max_stay_finite(quantizer_path, name: str, rule: str, compiled: bool) -> None:
    """A block holding 3.4e38 rounds up to the element 256 (E4M3) or 8 (E2M1) under the ceil rules: the
    MX value 2^128 lies past float32 and decodes to ±FLT_MAX, never inf (the ceil rules gave +inf)."""
    from test_formats_block import mx_reference  # the spec reference beside this file

    rng = np.random.default_rng(7)
    rows = rng.uniform(-1, 1, (6, 32)).astype(np.float32) * np.float32(3.0e38)
    rows[0, 0], rows[1, 3], rows[2, 31] = FLT_MAX, -FLT_MAX, np.float32(3.4e38)
    rows[3, :] = FLT_MAX
    fmt = name if rule == "floor" else f"{name}@{rule}"
    x = torch.from_numpy(rows)
    got = numscope.quantize(x, fmt, compiled=compiled)
    assert torch.isfinite(got).all()
    assert np.array_equal(got.numpy(), mx_reference(rows, numscope.get_format(fmt)))
    assert torch.equal(numscope.encode(x, fmt).decode(), got)
    packed = native.block_pack_columns(x.T.contiguous(), numscope.get_format(fmt))  # kept for wgrad
    if packed is not None:
        assert torch.equal(packed[1](*packed[0]).T, got)
