"""The one decision of which quantizer computes a cast (:mod:`numscope.formats.path`), and that every path
it offers gives the bits of the eager reference."""

from __future__ import annotations

import pytest
import torch
from tests.bits import assert_bits_equal

from numscope.formats import native, set_native
from numscope.formats.path import Cast, QuantizerPath, quantizer_paths
from numscope.formats.quantize import quantize
from numscope.formats.scaling import Scaling
from numscope.formats.spec import get_format

NATIVE, DTYPE, COMPILED, EAGER = (
    QuantizerPath.NATIVE,
    QuantizerPath.DTYPE,
    QuantizerPath.COMPILED,
    QuantizerPath.EAGER,
)

needs_native = pytest.mark.skipif(not native.available(), reason="the native quantizers could not be built")


@pytest.fixture
def native_off():
    before = native.native_enabled()
    set_native(False)
    yield
    set_native(before)


def _cast(name: str, scaling: str | None = None, **options) -> Cast:
    return Cast(get_format(name), scaling, **options)


X = torch.randn(8, 64)


@needs_native
@pytest.mark.parametrize(
    ("cast", "compiled", "codes", "expected"),
    [
        # convert's codes: fp8 written natively (torch's scalar conversion behind it), fp16/bf16 by torch
        (_cast("fp8_e4m3", "tensor"), False, True, (NATIVE, DTYPE)),
        (_cast("fp8_e5m2", "delayed"), False, True, (NATIVE, DTYPE)),
        (_cast("bf16"), False, True, (DTYPE,)),
        (_cast("fp16", overflow="propagate"), False, True, (DTYPE,)),
        # no torch dtype equals these: the value paths
        (_cast("fp8_e4m3", "row"), False, True, (NATIVE, EAGER)),
        (_cast("fp8_e4m3", overflow="propagate"), False, True, (NATIVE, EAGER)),
        (_cast("fp8_e4m3", flush_subnormals=True), False, True, (NATIVE, EAGER)),
        # the compiled kernels asked for: no torch-dtype codes, compiled behind the native code
        (_cast("fp8_e4m3", "tensor"), True, True, (NATIVE, COMPILED, EAGER)),
        (_cast("int8", "tensor"), False, False, (NATIVE, EAGER)),
        (_cast("mxfp8_e4m3"), False, False, (NATIVE, EAGER)),
        (_cast("mxfp4_e2m1", "block"), True, False, (NATIVE, COMPILED, EAGER)),
        # layouts the native code leaves to the compiled kernels
        (_cast("nvfp4@2d"), True, False, (COMPILED, EAGER)),
        (_cast("nvfp4@2d"), False, False, (EAGER,)),
        # only the eager reference: other roundings, tiles of an element format, E8M0
        (_cast("fp8_e4m3", "tensor", rounding="stochastic"), True, True, (EAGER,)),
        (_cast("mxfp8_e4m3", rounding="zero"), True, False, (EAGER,)),
        (_cast("fp8_e4m3", "block"), True, False, (EAGER,)),
        (_cast("e8m0"), True, False, (EAGER,)),
    ],
    ids=repr,
)
def test_paths_in_the_order_to_try(cast: Cast, compiled: bool, codes: bool, expected: tuple) -> None:
    assert quantizer_paths(cast, X, compiled=compiled, codes=codes) == expected


@needs_native
def test_the_native_code_takes_only_cpu_float32_tensors_it_may_write() -> None:
    cast = _cast("fp8_e4m3", "tensor")
    assert quantizer_paths(cast, X.double(), compiled=False) == (EAGER,)
    assert quantizer_paths(cast, X.clone().requires_grad_(), compiled=False) == (EAGER,)


def test_the_native_code_turned_off_leaves_compiled_and_eager(native_off) -> None:
    assert quantizer_paths(_cast("mxfp8_e4m3"), X, compiled=False) == (EAGER,)
    assert quantizer_paths(_cast("mxfp8_e4m3"), X, compiled=True) == (COMPILED, EAGER)
    assert quantizer_paths(_cast("fp8_e4m3", "tensor"), X, compiled=False, codes=True) == (DTYPE,)


@pytest.mark.parametrize(
    ("cast", "dtype"),
    [
        (_cast("fp8_e4m3"), torch.float8_e4m3fn),
        (_cast("fp8_e5m2", "delayed", overflow="propagate"), torch.float8_e5m2),
        (_cast("bf16", "tensor"), torch.bfloat16),
        (_cast("fp8_e4m3", overflow="propagate"), None),  # torch's e4m3fn conversion saturates
        (_cast("fp8_e4m3", "column"), None),
        (_cast("fp32"), None),
        (_cast("fp8_e4m3", rounding="nearest_away"), None),
        (_cast("mxfp8_e4m3"), None),
        (_cast("fp6_e3m2"), None),  # no torch dtype
    ],
    ids=repr,
)
def test_the_torch_dtype_of_a_cast(cast: Cast, dtype: torch.dtype | None) -> None:
    assert cast.torch_dtype() == dtype


@pytest.mark.parametrize(
    ("name", "scaling"),
    [("fp8_e4m3", "tensor"), ("fp8_e5m2", None), ("int8", "row"), ("mxfp8_e4m3", None), ("nvfp4", None)],
)
def test_every_path_offered_gives_the_eager_bits(name: str, scaling: str | None) -> None:
    """quantize on the first path offered (native where built), with the compiled kernels allowed, and with
    both turned off (the eager reference) agree bit for bit, NaN and ±inf included."""
    x = torch.randn(16, 96) * torch.logspace(-6, 6, 96)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    first = quantize(x, name, scaling=scaling, compiled=False)
    compiled = quantize(x, name, scaling=scaling, compiled=True)
    before = native.native_enabled()
    set_native(False)
    try:
        eager = quantize(x, name, scaling=scaling, compiled=False)
    finally:
        set_native(before)
    assert_bits_equal(first, eager)
    assert_bits_equal(compiled, eager)


@pytest.mark.parametrize("native_on", [True, False])
def test_a_delayed_scaler_records_each_call_once_whichever_path_computes(native_on: bool) -> None:
    """The fast path is entered only where it computes, so a delayed scaler records one amax per call."""
    from numscope.formats.scaling import DelayedScaler

    before = native.native_enabled()
    set_native(native_on)
    try:
        scaler = DelayedScaler(Scaling("delayed", history_len=4))
        for _ in range(3):
            quantize(X, "fp8_e4m3", scaling=scaler, compiled=False)
    finally:
        set_native(before)
    assert scaler.steps == 3
