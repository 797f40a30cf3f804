"""The torch.compile fast path against the eager reference, bit for bit (the native quantizers, which
stand in front of it where they cover a call, are off here; test_formats_native.py checks them).

Covers the configurations the benchmark times (per-tensor fp8_e4m3, bf16, mxfp8_e4m3, mxfp4_e2m1, nvfp4,
per-tensor int8) over random values spread across many binades, format ties, zeros, float32 subnormals,
±inf and NaN, and last axes that do not divide the block. Each configuration compiles once or twice
(a few seconds each), which is why the list is short; the other scalings and formats share these kernels'
code (``numscope.formats.cast.cast``, ``scale_from_amax``, the block arithmetic) and are checked more
lightly below.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import numscope
from bits import assert_bits_equal
from numscope.formats import fast, native, set_fast
from numscope.formats.native import set_native

CONFIGS: list[tuple[str, str | None]] = [
    ("fp8_e4m3", "tensor"),
    ("bf16", None),
    ("mxfp8_e4m3", None),
    ("mxfp4_e2m1", None),
    ("nvfp4", None),
    ("int8", "tensor"),
]


@pytest.fixture(autouse=True)
def restore_fast():
    """The torch.compile kernels, without the native quantizers in front of them (tested on their own in
    test_formats_native.py): "fast" here is the compiled kernel, "eager" the reference."""
    before, native_before = fast.fast_enabled(), native.native_enabled()
    set_native(False)
    yield
    set_fast(before)
    set_native(native_before)


def both(x: torch.Tensor, name: str, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(eager, fast) results of the same call."""
    set_fast(False)
    eager = numscope.quantize(x, name, **kwargs)
    set_fast(True)
    compiled = numscope.quantize(x, name, **kwargs)
    return eager, compiled


def spread(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random values over ±2^-40..2^40, rows at different magnitudes, a third of them on fp32 ties of
    1-, 3- and 7-bit mantissas (half-way patterns), so that rounding ties occur wherever scales are 2^k."""
    rng = np.random.default_rng(seed)
    row_scale = 2.0 ** rng.integers(-30, 30, size=(*shape[:-1], 1))
    values = rng.standard_normal(shape) * row_scale * 2.0 ** rng.uniform(-10, 10, size=shape)
    values = values.astype(np.float32)
    bits = values.view(np.uint32)
    tie_bit = rng.choice(np.array([1 << 21, 1 << 19, 1 << 15], np.uint32), size=shape)
    tied = (bits & ~((tie_bit << 1) - 1)) | tie_bit
    return np.where(rng.random(shape) < 1 / 3, tied, bits).astype(np.uint32).view(np.float32)


def specials(name: str, length: int) -> np.ndarray:
    """Rows of edge values: exact ties at scale 1, zeros, float32 subnormals, inf and NaN blocks."""
    fmt = numscope.get_format(name)
    element = getattr(fmt, "element", fmt)
    top = float(fmt.max) if not isinstance(fmt, numscope.BlockFormat) else element.max * 2.0**4
    rng = np.random.default_rng(length)
    rows = []
    # ties of the element grid at scale 1 (amax == max): midpoints of e4m3, e2m1, int and bf16 values
    grid = np.concatenate([np.arange(0, 8, 0.25), np.arange(8, 64, 2.0), np.arange(64, 448, 16.0)])
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    rows.append(np.resize(np.concatenate([[top], mids * np.float32(top / 448), -mids]), length))
    rows.append(np.zeros(length, np.float32))
    row = np.zeros(length, np.float32)
    row[::3] = -0.0
    rows.append(row)
    rows.append(rng.integers(1, 0x800000, size=length).astype(np.uint32).view(np.float32))  # fp32 subnormals
    row = (rng.standard_normal(length) * 1e-38).astype(np.float32)
    rows.append(row)
    row = rng.standard_normal(length).astype(np.float32)
    row[3], row[length - 2] = np.inf, -np.inf
    rows.append(row)
    row = rng.standard_normal(length).astype(np.float32)
    row[length // 2] = np.nan
    rows.append(row)
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize(("name", "scaling"), CONFIGS)
def test_fast_path_equals_eager_bit_for_bit(name: str, scaling: str | None) -> None:
    inputs = [
        spread((37, 70), seed=1),  # 70 divides neither 32 nor 16
        spread((3, 5, 64), seed=2),  # whole blocks, three dimensions
        specials(name, 70),
    ]
    for values in inputs:
        x = torch.from_numpy(values)
        eager, compiled = both(x, name, scaling=scaling)
        assert_bits_equal(compiled, eager)
    # the non-finite rows poison a tensor scale: check each special row on its own too
    for row in specials(name, 70):
        eager, compiled = both(torch.from_numpy(row).reshape(2, 35), name, scaling=scaling)
        assert_bits_equal(compiled, eager)


def test_new_shapes_reuse_the_compiled_kernels() -> None:
    x = torch.from_numpy(spread((37, 70), seed=3))
    both(x, "mxfp8_e4m3")
    both(x, "fp8_e4m3", scaling="tensor")
    graphs = counters["stats"]["unique_graphs"]
    for shape in [(50, 90), (13, 70), (4, 6, 100)]:
        x = torch.from_numpy(spread(shape, seed=sum(shape)))
        for name, scaling in [("mxfp8_e4m3", None), ("fp8_e4m3", "tensor")]:
            eager, compiled = both(x, name, scaling=scaling)
            assert_bits_equal(compiled, eager)
    assert counters["stats"]["unique_graphs"] == graphs, "a new shape compiled a new graph"


@pytest.mark.slow  # eight more compiled configurations (~10 s each on a loaded 2-core machine)
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("fp8_e5m2", {"scaling": "row", "overflow": "propagate"}),
        ("fp8_e4m3", {"scaling": numscope.Scaling("column", margin=1, power_of_two=True)}),
        ("fp4_e2m1", {"flush_subnormals": True}),
        ("mxfp4_e2m1@rceil", {"scaling": numscope.Scaling("block", axis=0)}),
        ("mxfp8_e4m3@even", {}),
        ("nvfp4@2d@4over6", {}),
        ("nvfp4@row", {"scaling": numscope.Scaling("block", axis=0)}),
        ("fp8_e4m3", {"scaling": numscope.Scaling("tensor", amax_epsilon=1e-3)}),
    ],
)
def test_other_scalings_and_options_match_too(name: str, kwargs: dict) -> None:
    x = torch.from_numpy(spread((40, 48), seed=5))
    eager, compiled = both(x, name, **kwargs)
    assert_bits_equal(compiled, eager)


@pytest.mark.slow  # one more compiled configuration
def test_delayed_scaling_matches_and_keeps_the_same_history() -> None:
    scalers = [numscope.DelayedScaler(numscope.Scaling("delayed", history_len=4)) for _ in range(2)]
    for step in range(3):
        x = torch.from_numpy(spread((16, 40), seed=10 + step)) * (step + 1)
        set_fast(False)
        eager = numscope.quantize(x, "fp8_e4m3", scaling=scalers[0])
        set_fast(True)
        compiled = numscope.quantize(x, "fp8_e4m3", scaling=scalers[1])
        assert_bits_equal(compiled, eager)
    assert torch.equal(scalers[0].amax_history, scalers[1].amax_history)


@pytest.mark.slow  # traces and fails to compile one configuration (~15 s)
def test_a_failed_compile_warns_and_runs_the_same_kernel_eagerly() -> None:
    x = torch.from_numpy(spread((16, 40), seed=20))
    set_fast(False)
    expected = numscope.quantize(x, "fp6_e2m3", scaling="row")
    set_fast(True)
    broken = {"cpp.cxx": (None, "/nonexistent/g++"), "force_disable_caches": True}
    with torch._inductor.config.patch(broken), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = numscope.quantize(x, "fp6_e2m3", scaling="row")
        second = numscope.quantize(x * 2, "fp6_e2m3", scaling="row")
    messages = [str(w.message) for w in caught if "numscope fast path" in str(w.message)]
    assert len(messages) == 1 and "fmt=fp6_e2m3" in messages[0] and "runs eagerly" in messages[0]
    assert_bits_equal(first, expected)
    set_fast(False)
    assert_bits_equal(second, numscope.quantize(x * 2, "fp6_e2m3", scaling="row"))


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _mismatched(x: torch.Tensor) -> torch.Tensor:
    return x @ torch.ones(x.shape[1] + 1, 2)


def test_a_compile_failure_warns_once_and_runs_the_kernel_eagerly(monkeypatch) -> None:
    from torch._inductor.exc import InductorError, InvalidCxxCompiler

    calls = []

    def fails_to_compile(*args):
        calls.append(args)
        raise InductorError(InvalidCxxCompiler(), None)  # (torch 2.11's takes no compiler name)

    monkeypatch.setattr(fast.torch, "compile", lambda kernel, **options: fails_to_compile)
    kernel = fast._Kernel(_double, "a test kernel")
    x = torch.arange(6.0).reshape(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = kernel(x)
        second = kernel(x + 1)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "a test kernel" in messages[0] and "InductorError" in messages[0]
    assert "No working C++ compiler" in messages[0] and "runs eagerly" in messages[0]
    assert len(calls) == 1 and kernel.compiled is None
    assert torch.equal(first, x * 2) and torch.equal(second, (x + 1) * 2)


@pytest.mark.parametrize("error", [RuntimeError("a bug in the kernel"), KeyboardInterrupt()])
def test_an_error_that_is_not_a_compile_failure_propagates(monkeypatch, error: BaseException) -> None:
    def raises(*args):
        raise error

    monkeypatch.setattr(fast.torch, "compile", lambda kernel, **options: raises)
    kernel = fast._Kernel(_double, "a test kernel")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(type(error), match=str(error) or None):
            kernel(torch.ones(2, 3))
    assert not [w for w in caught if "numscope fast path" in str(w.message)]
    assert kernel.compiled is raises  # still compiled: the next call tries again


def test_a_shape_error_in_a_compiled_kernel_propagates() -> None:
    # dynamo traces the kernel and fails on its matmul before inductor runs (no C++ compile)
    kernel = fast._Kernel(_mismatched, "a mismatched kernel")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="a and b must have same reduction dim"):
            kernel(torch.ones(4, 3))
    assert not [w for w in caught if "numscope fast path" in str(w.message)]
    assert kernel.compiled is not None
