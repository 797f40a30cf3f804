"""``flush_subnormals`` on block formats: the elements are flushed after the block scale, as the element
cast flushes them; eager, through ``encode`` and through the compiled fast path.

The reference is written here: quantize without flushing, take the block scale by hand (MX: 2^(floor(log2
amax) − emax_elem); NVFP4: e4m3(amax_b / 6 · S) / S with S = 448·6 / amax), check that the unflushed
result is element × scale, then zero (keeping the sign) every element whose scaled value lies below the
element format's smallest normal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import numscope
from bits import assert_bits_equal
from numscope.formats import fast, native, set_fast

CASES = ["mxfp8_e4m3", "mxfp4_e2m1", "nvfp4"]


@pytest.fixture(autouse=True)
def restore_fast():
    before = fast.fast_enabled()
    set_fast(False)
    yield
    set_fast(before)


def data(name: str, rows: int = 24, seed: int = 0) -> torch.Tensor:
    """Rows of blocks whose elements spread over 2^-24..1 of their block's amax (subnormal elements in
    every format), plus elements at and around the element format's smallest normal after the scale, a
    zero block, and a last axis that does not divide the block."""
    fmt = numscope.get_format(name)
    block = fmt.block_size
    rng = np.random.default_rng(seed)
    length = 3 * block + 5
    magnitude = 2.0 ** rng.uniform(-24, 0, size=(rows, length))
    x = (np.sign(rng.uniform(-1, 1, size=(rows, length))) * magnitude).astype(np.float32)
    x[:, ::block] = 1.0  # each block's amax: 1
    element = fmt.element
    # scaled by 2^emax_elem (MX) the row below puts elements exactly around the element's min normal
    unit = np.float32(element.min_normal * 2.0**-element.emax)
    edge = unit * np.array([1.0, 0.99, 0.75, 0.5, 0.25, 1.01, -1.0, -0.9, -0.6], np.float32)
    x[0, 1 : 1 + edge.size] = edge
    x[1, :block] = 0.0  # a zero block
    return torch.from_numpy(x)


def block_scales(x: torch.Tensor, name: str) -> torch.Tensor:
    """Each block's decode scale, repeated over the block's elements (shape of ``x``), by hand."""
    fmt = numscope.get_format(name)
    block = fmt.block_size
    pad = (-x.shape[-1]) % block
    blocks = torch.nn.functional.pad(x, (0, pad)).reshape(x.shape[0], -1, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    if fmt.tensor_scale:
        encode = torch.tensor(448.0 * 6.0) / x.abs().amax()
        stored = numscope.quantize(amax / 6.0 * encode, "fp8_e4m3")
        scale = stored / encode
    else:
        exponent = torch.frexp(amax).exponent - 1 - fmt.element.emax  # floor(log2 amax) - emax_elem
        scale = torch.ldexp(torch.ones_like(amax), exponent.clamp(-127, 127))
        scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    return scale.expand_as(blocks).reshape(x.shape[0], -1)[:, : x.shape[-1]]


def flushed_reference(x: torch.Tensor, name: str) -> torch.Tensor:
    fmt = numscope.get_format(name)
    plain = numscope.quantize(x, name)
    scale = block_scales(x, name)
    usable = scale > 0
    safe = torch.where(usable, scale, torch.ones_like(scale))
    elements = numscope.quantize(x / safe, fmt.element.name)
    elements = torch.where(usable, elements, elements * 0.0)  # NVFP4: a scale of 0 decodes to 0
    assert torch.equal(elements * scale, plain), "the hand-made block scale must reproduce quantize"
    subnormal = elements.abs() < fmt.element.min_normal
    assert subnormal[elements != 0].any(), "the data must hold subnormal elements"
    return torch.where(subnormal, plain * 0.0, plain)


@pytest.mark.parametrize("name", CASES)
def test_block_formats_flush_their_elements_subnormals(name: str) -> None:
    x = data(name)
    expected = flushed_reference(x, name)
    assert not torch.equal(expected, numscope.quantize(x, name)), "flushing must change something here"
    assert_bits_equal(numscope.quantize(x, name, flush_subnormals=True), expected)
    # along another axis: the same blocks, transposed
    actual = numscope.quantize(
        x.T.contiguous(), name, flush_subnormals=True, scaling=numscope.Scaling("block", axis=0)
    )
    assert_bits_equal(actual.T.contiguous(), expected)


@pytest.mark.parametrize("name", CASES)
def test_encode_flushes_block_elements_too(name: str) -> None:
    x = data(name)
    encoded = numscope.encode(x, name, flush_subnormals=True)
    assert_bits_equal(encoded.decode(), flushed_reference(x, name))
    plain = numscope.encode(x, name)
    assert torch.equal(encoded.scales, plain.scales)  # flushing touches elements only


def test_the_audit_example_flushes() -> None:
    x = torch.tensor([[1.0] + [2.0**-16] * 31])
    assert numscope.quantize(x, "mxfp8_e4m3")[0, 1] == 2.0**-16  # an E4M3 subnormal (2^-8) after X = 2^-8
    assert numscope.quantize(x, "mxfp8_e4m3", flush_subnormals=True).tolist() == [[1.0] + [0.0] * 31]


def test_integer_elements_have_no_subnormals_to_flush() -> None:
    x = data("mxint8")
    flushed = numscope.quantize(x, "mxint8", flush_subnormals=True)
    assert_bits_equal(flushed, numscope.quantize(x, "mxint8"))
    codes = numscope.encode(x, "mxint8", flush_subnormals=True).codes
    assert torch.equal(codes, numscope.encode(x, "mxint8").codes)


def test_non_finite_blocks_stay_nan_under_flush() -> None:
    x = torch.full((1, 32), 2.0**-20)
    x[0, 0] = float("inf")
    assert torch.isnan(numscope.quantize(x, "mxfp8_e4m3", flush_subnormals=True)).all()


def test_the_fast_path_flushes_block_elements(monkeypatch) -> None:
    """One small compiled case per format (each compiles once: a few seconds), native quantizers off."""
    monkeypatch.setattr(native, "_enabled", False)
    for name in CASES:
        x = data(name, rows=4, seed=1)
        expected = flushed_reference(x, name)
        set_fast(True)
        assert_bits_equal(numscope.quantize(x, name, flush_subnormals=True), expected)
        set_fast(False)
        assert ("block", {"fmt": numscope.get_format(name), "flush": True}) in fast.compiled_configurations()
