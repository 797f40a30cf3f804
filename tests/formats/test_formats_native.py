"""The native quantizers (numscope.formats.native, a C library built on first use) against the eager
reference, bit for bit: every element format family and scaling they cover, MX blocks under every scale
rule, NVFP4 (both scale maths), blocks along rows and down columns, over values across many binades, exact
ties, zeros, float32 subnormals, ±inf and NaN; and what happens without a C compiler."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from tests.formats.test_formats_fast import assert_bits_equal, specials, spread

import numscope
from numscope.formats import native, set_native


@pytest.fixture(autouse=True)
def native_on():
    before = native.native_enabled()
    set_native(True)
    yield
    set_native(before)


def native_and_eager(x: torch.Tensor, name: str, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(native, eager) results of the same call; checks the native code took the call."""
    calls = []
    element, block = native.element, native.block

    def spy(function):
        def wrapped(*args, **kw):
            result = function(*args, **kw)
            calls.append(result is not None)
            return result

        return wrapped

    native.element, native.block = spy(element), spy(block)
    try:
        fast = numscope.quantize(x, name, compiled=False, **kwargs)
    finally:
        native.element, native.block = element, block
    assert calls and all(calls), f"{name} {kwargs}: the native code did not take the call"
    set_native(False)
    eager = numscope.quantize(x, name, compiled=False, **kwargs)
    set_native(True)
    return fast, eager


def inputs(name: str) -> list[np.ndarray]:
    return [spread((37, 70), seed=1), spread((3, 5, 64), seed=2), specials(name, 64), spread((2, 96), seed=3)]


ELEMENT_CASES = [
    ("fp8_e4m3", {"scaling": "tensor"}),
    ("fp8_e4m3", {"scaling": "tensor", "overflow": "propagate"}),
    ("fp8_e5m2", {"scaling": "row", "overflow": "propagate"}),
    ("fp8_e5m2", {"scaling": "column"}),
    ("fp8_e4m3fnuz", {"scaling": "tensor"}),
    ("fp8_e5m2fnuz", {"scaling": "tensor", "overflow": "propagate"}),
    ("fp8_e4m3", {"scaling": numscope.Scaling("tensor", margin=1, power_of_two=True, amax_epsilon=1e-3)}),
    ("fp8_e4m3", {}),
    ("fp6_e2m3", {"scaling": "row", "flush_subnormals": True}),
    ("fp6_e3m2", {"overflow": "propagate"}),
    ("fp4_e2m1", {"flush_subnormals": True}),
    ("bf16", {}),
    ("bf16", {"overflow": "propagate", "flush_subnormals": True}),
    ("tf32", {}),
    ("fp16", {}),
    ("fp16", {"overflow": "propagate"}),
    ("e5m6", {"scaling": "tensor"}),
    ("int8", {"scaling": "tensor"}),
    ("int4", {"scaling": "row"}),
]


@pytest.mark.parametrize(("name", "kwargs"), ELEMENT_CASES)
def test_element_formats_equal_the_eager_reference(name: str, kwargs: dict) -> None:
    for values in inputs(name):
        assert_bits_equal(*native_and_eager(torch.from_numpy(values), name, **kwargs))
    for row in specials(name, 64):  # each edge row alone: a non-finite value poisons a tensor scale
        assert_bits_equal(*native_and_eager(torch.from_numpy(row).reshape(2, 32), name, **kwargs))


BLOCK_CASES = [
    "mxfp8_e4m3",
    "mxfp8_e5m2",
    "mxfp6_e2m3",
    "mxfp6_e3m2",
    "mxfp4_e2m1",
    "mxint8",
    "mxfp8_e4m3@ceil",
    "mxfp4_e2m1@even",
    "mxfp8_e5m2@rceil",
    "nvfp4",
    "nvfp4@divide",
]


@pytest.mark.parametrize("name", BLOCK_CASES)
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("flush", [False, True])
def test_block_formats_equal_the_eager_reference(name: str, axis: int, flush: bool) -> None:
    scaling = numscope.Scaling("block", axis=axis)
    for values in [*inputs(name), spread((70, 37), seed=4), spread((33, 9), seed=5)]:
        if axis == -1 and values.shape[-1] % numscope.get_format(name).block_size:
            continue  # rows the native code leaves to the other paths (a short last block)
        x = torch.from_numpy(values)
        assert_bits_equal(*native_and_eager(x, name, scaling=scaling, flush_subnormals=flush))
    edges = torch.from_numpy(specials(name, 64))
    assert_bits_equal(*native_and_eager(edges.T.contiguous() if axis == 0 else edges, name, scaling=scaling))


MIDDLE_AXES = [((3, 64, 5), 1), ((2, 3, 32, 7), -2), ((3, 40, 5), 1), ((4, 2, 96), 0)]


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp4_e2m1@even", "nvfp4", "nvfp4@divide"])
@pytest.mark.parametrize(("shape", "axis"), MIDDLE_AXES)
def test_blocks_along_a_middle_axis_equal_the_eager_reference(name: str, shape: tuple, axis: int) -> None:
    """Blocks along an axis that is neither first nor last: down the columns of a 2-D view where the axis is
    a whole number of blocks long (no transposed copy), else through a moved copy; the same bits."""
    x = torch.from_numpy(spread((int(np.prod(shape[:-1])), shape[-1]), seed=7)).reshape(shape).contiguous()
    down_columns = []
    block = native.block

    def recording(matrix, *args, along_columns=False, **kwargs):
        down_columns.append(along_columns and matrix.numel() == x.numel())
        return block(matrix, *args, along_columns=along_columns, **kwargs)

    native.block = recording
    try:
        assert_bits_equal(*native_and_eager(x, name, scaling=numscope.Scaling("block", axis=axis)))
    finally:
        native.block = block
    # the first axis always, a middle one when it holds whole blocks (the first call is the native one)
    first, whole = axis % len(shape) == 0, shape[axis] % numscope.get_format(name).block_size == 0
    assert down_columns[0] == (first or whole)


def test_delayed_scaling_records_the_same_history() -> None:
    x = torch.from_numpy(spread((16, 64), seed=6))
    scalers = [numscope.DelayedScaler(numscope.Scaling("delayed", history_len=4)) for _ in range(2)]
    for step in range(3):
        fast = numscope.quantize(x * 2.0**step, "fp8_e4m3", scaling=scalers[0], compiled=False)
        set_native(False)
        eager = numscope.quantize(x * 2.0**step, "fp8_e4m3", scaling=scalers[1], compiled=False)
        set_native(True)
        assert_bits_equal(fast, eager)
    assert torch.equal(scalers[0].amax_history, scalers[1].amax_history)


def test_uncovered_calls_fall_back_to_the_same_results() -> None:
    """2-D NVFP4 tiles, Four Over Six, e8m0 and stochastic rounding are not native: the eager path runs."""
    x = torch.from_numpy(spread((32, 64), seed=7))
    for name, kwargs in [("nvfp4@2d", {}), ("nvfp4@4over6", {}), ("e8m0", {})]:
        set_native(False)
        expected = numscope.quantize(x.abs() + 1e-3, name, **kwargs)
        set_native(True)
        assert_bits_equal(numscope.quantize(x.abs() + 1e-3, name, **kwargs), expected)
    assert native.block(x, numscope.get_format("nvfp4@2d"), False) is None


def test_without_a_c_compiler_it_warns_once_and_quantizes_eagerly(monkeypatch, tmp_path) -> None:
    x = torch.from_numpy(spread((8, 64), seed=8))
    set_native(False)
    expected = numscope.quantize(x, "mxfp8_e4m3")
    set_native(True)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.setenv("NUMSCOPE_CACHE", str(tmp_path))
    native._library.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = numscope.quantize(x, "mxfp8_e4m3")
            second = numscope.quantize(x, "mxfp8_e4m3")
        messages = [str(w.message) for w in caught if "native quantizers are unavailable" in str(w.message)]
        assert len(messages) == 1 and "no C compiler found" in messages[0]
        assert_bits_equal(first, expected)
        assert_bits_equal(second, expected)
        assert not native.available()
    finally:
        native._library.cache_clear()


def _small_source(monkeypatch, tmp_path) -> None:
    """A tiny C source in place of the real one (which takes seconds to compile), and a private temp dir."""
    source = tmp_path / "probe.c"
    source.write_text("int numscope_probe(void) { return 1; }\n")
    monkeypatch.setattr(native, "_SOURCE", source)
    monkeypatch.setattr(native.tempfile, "tempdir", str(tmp_path / "temp"))  # the fallback folder's parent


def test_the_library_is_built_once_per_source_into_the_cache(monkeypatch, tmp_path) -> None:
    _small_source(monkeypatch, tmp_path)
    monkeypatch.setenv("NUMSCOPE_CACHE", str(tmp_path / "cache"))
    run = native.subprocess.run
    compiles = []

    def counting(command, *args, **kwargs):
        compiles.extend([command] if "-shared" in command else [])
        return run(command, *args, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", counting)
    first = native._build()
    assert first.parent == tmp_path / "cache" and first.exists() and len(compiles) == 1
    assert not list(first.parent.glob("*.part")), "the partial file of the atomic write is left behind"
    assert native._build() == first and len(compiles) == 1, "a cached library was compiled again"


def test_set_native_takes_only_a_bool() -> None:
    with pytest.raises(TypeError, match="set_native expects True or False, got 'yes'"):
        set_native("yes")  # type: ignore[arg-type]


def test_convert_quantizes_block_formats_natively_by_default() -> None:
    """A converted layer's MX and NVFP4 operands go through the native code (without torch.compile), and
    train to the same bits as the eager reference."""
    results = []
    for on in (True, False):
        set_native(on)
        calls: list[int] = []
        block = native.block

        def counting(*args, block=block, calls=calls, **kwargs):
            calls.append(1)
            return block(*args, **kwargs)

        native.block = counting
        try:
            torch.manual_seed(0)
            layer = torch.nn.Linear(64, 32)
            numscope.convert(layer, numscope.Plan.uniform("nvfp4"), compiled=False)
            out = layer(torch.randn(8, 64, generator=torch.Generator().manual_seed(1)))
            out.sum().backward()
        finally:
            native.block = block
        assert bool(calls) is on
        results.append((out.detach(), layer.weight.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
)
def test_fp8_codes_decode_as_torch_converts_them(dtype: torch.dtype) -> None:
    """Every code of the dtype (subnormals, ±0, ±inf, NaNs), times descales down to float32's subnormals."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).reshape(16, 16)
    for descale in (None, torch.tensor(0.375), torch.tensor(2.0**-130), torch.tensor(3.0e30)):
        expected = codes.float() if descale is None else codes.float() * descale
        assert_bits_equal(native.decode(codes, descale), expected)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz"])
@pytest.mark.parametrize("overflow", ["saturate", "propagate"])
def test_fp8_codes_are_the_rounded_values(fmt: str, overflow: str) -> None:
    """element_codes' codes decode to cast(x · s) and its values are that times 1 / s, as the eager path."""
    from numscope.formats.cast import native_dtype

    spec = numscope.get_format(fmt)
    for values in [spread((37, 70), seed=9), specials(fmt, 64)]:
        x = torch.from_numpy(values)
        for scale in (None, torch.tensor(3.0), torch.tensor(2.0**-20)):
            result = native.element_codes(x, spec, overflow, native_dtype(spec), scale)
            assert result is not None
            got, codes = result
            set_native(False)
            rounded = numscope.quantize(x if scale is None else x * scale, fmt, overflow=overflow)
            set_native(True)
            assert_bits_equal(codes.float(), rounded)
            assert_bits_equal(got, rounded if scale is None else rounded * (1.0 / scale))


@pytest.mark.skipif(not hasattr(os, "chown") or os.geteuid() != 0, reason="needs root to give a folder away")
def test_a_cache_folder_of_another_user_is_never_loaded_from(monkeypatch, tmp_path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 12345, -1)
    _small_source(monkeypatch, tmp_path)
    monkeypatch.setenv("NUMSCOPE_CACHE", str(foreign))
    built = native._build()
    assert built.parent.parent == tmp_path / "temp" and not list(foreign.iterdir())


@pytest.mark.parametrize(
    ("name", "scaling"),
    [
        ("mxfp8_e4m3", None),
        ("mxfp4_e2m1", numscope.Scaling("block", axis=0)),
        ("nvfp4", None),
        ("fp8_e4m3", "tensor"),
        ("fp8_e5m2", "row"),
        ("int8", "column"),
    ],
)
def test_the_metrics_kept_quantization_is_the_same_natively(name: str, scaling) -> None:
    """What the observer's metrics read (values, what the cast saw, block scales) with native on and off."""
    from numscope.metrics.errors import quantize_kept

    spec = numscope.get_format(name)
    results = []
    for on in (True, False):
        set_native(on)
        for values in (spread((3, 10, 70), seed=11), specials(name, 64)):
            kept = quantize_kept(torch.from_numpy(values), spec, scaling, "nearest", None, amax=None)
            results.append(kept)
    half = len(results) // 2
    for fast, eager in zip(results[:half], results[half:], strict=True):
        assert_bits_equal(fast.q, eager.q)
        if eager.scaled is not None:
            assert_bits_equal(fast.scaled, eager.scaled)
        if eager.blocks is not None:
            assert_bits_equal(fast.blocks.scales, eager.blocks.scales)
            assert_bits_equal(fast.blocks.x, eager.blocks.x)


@pytest.mark.parametrize(
    "name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp4_e2m1@even", "nvfp4", "nvfp4@divide"]
)
def test_block_codes_down_the_columns_unpack_to_the_quantized_values(name: str) -> None:
    """What convert keeps of an MX or NVFP4 wgrad input (element and scale codes) gives back the eager
    quantization along the first axis, bit for bit, NaN blocks and short last blocks included."""
    fmt = numscope.get_format(name)
    for values in [spread((70, 37), seed=12), spread((33, 9), seed=13), specials(name, 64).T.copy()]:
        x = torch.from_numpy(values)
        packed = native.block_pack_columns(x, fmt)
        assert packed is not None
        (codes, scale_codes), unpack = packed
        assert codes.dtype == scale_codes.dtype == torch.uint8
        assert scale_codes.shape == (-(-x.shape[0] // fmt.block_size), x.shape[1])
        set_native(False)
        expected = numscope.quantize(x, fmt, scaling=numscope.Scaling("block", axis=0))
        set_native(True)
        assert_bits_equal(unpack(codes, scale_codes), expected)
    assert native.block_pack_columns(x, numscope.get_format("mxint8")) is None  # integer elements: not here


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding ``address`` in this process (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"), reason="no transparent huge pages here"
)
def test_large_outputs_are_advised_into_huge_pages_and_hold_the_same_bits(monkeypatch) -> None:
    monkeypatch.setattr(native, "LARGE_OUTPUT", 4 * 2**20)  # 1 Mi float32 elements, not 32 MiB's 8 Mi
    x = torch.from_numpy(spread((1024, 1024), seed=4))
    advised = []
    empty = native._empty

    def recording(shape, dtype=torch.float32):
        out = empty(shape, dtype)
        advised.append((out, "hg" in _vm_flags(out.data_ptr() + out.numel() * out.element_size() // 2)))
        return out

    monkeypatch.setattr(native, "_empty", recording)
    for name, kwargs in (("fp8_e5m2", {"scaling": "tensor"}), ("mxfp8_e4m3", {})):
        fast, eager = native_and_eager(x, name, **kwargs)
        assert_bits_equal(fast, eager)
    large = [flag for out, flag in advised if out.numel() * out.element_size() >= native.LARGE_OUTPUT]
    assert large and all(large), "a large output was not advised into huge pages"


def test_only_the_whole_huge_pages_inside_a_large_output_are_advised(monkeypatch) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(native, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    monkeypatch.setattr(native, "_huge_pages", True)
    small = native._empty((native.LARGE_OUTPUT // 4 - 1,))
    assert not calls
    out = native._empty((native.LARGE_OUTPUT // 4 + 3,))
    ((start, length, advice),) = calls
    begin, end = out.data_ptr(), out.data_ptr() + out.numel() * 4
    assert advice == 14 and start % native.HUGE_PAGE == 0 and length % native.HUGE_PAGE == 0
    assert begin <= start < start + length <= end and start - begin < native.HUGE_PAGE
    assert end - (start + length) < native.HUGE_PAGE
    calls.clear()
    monkeypatch.setattr(native, "_huge_pages", False)  # NUMSCOPE_HUGE_PAGES=0
    native._empty((native.LARGE_OUTPUT // 4 + 3,))
    assert not calls and small.numel()


BOTH_CASES = ["mxfp8_e4m3", "mxfp8_e5m2@rceil", "mxfp6_e3m2", "mxfp4_e2m1@even", "mxint8"]


@pytest.mark.parametrize("name", BOTH_CASES)
def test_both_block_directions_in_one_pass_equal_each_direction_alone(name: str) -> None:
    """native.block_both: blocks along the rows and down the columns from one read, each bit for bit what
    native.block gives in that direction: across binades, with specials, and a short last column block."""
    fmt = numscope.get_format(name)
    for values in (spread((70, 64), seed=8), spread((64, 96), seed=9), specials(name, 64)):
        x = torch.from_numpy(values).reshape(-1, values.shape[-1])
        x = x if x.shape[1] % 32 == 0 else x.reshape(-1, 32)
        rows, columns = native.block_both(x, fmt)
        assert_bits_equal(rows, native.block(x, fmt, False))
        assert_bits_equal(columns, native.block(x, fmt, False, along_columns=True))
    assert native.block_both(torch.ones(4, 40), fmt) is None  # rows of a block and a part


TILE_CASES = [
    ("fp8_e4m3", numscope.Scaling("block", block_shape=(1, 128))),
    ("fp8_e4m3", numscope.Scaling("block", block_shape=(128, 128), power_of_two=True)),
    ("fp8_e4m3", numscope.Scaling("block", block_shape=(1, 16), scale_from_decode=True)),
    ("fp8_e5m2", numscope.Scaling("block", block_shape=(4, 32), amax_epsilon=1e-3)),
    ("int8", numscope.Scaling("block", block_shape=(2, 8))),
]


@pytest.mark.parametrize(("name", "scaling"), TILE_CASES)
@pytest.mark.parametrize("overflow", ["saturate", "propagate"])
def test_tile_scaling_of_element_formats_equals_the_eager_reference(
    name: str, scaling, overflow: str
) -> None:
    """Tile scaling (TE's block recipe, DeepSeek-V3's 1x128 and 128x128) natively: values, and the codes and
    per-element decode scales a promoted GEMM takes, bit for bit the eager ones; short last tiles, batch
    axes, and tiles holding inf, NaN, zeros and subnormals included."""
    from numscope.formats.quantize import tile_quantize

    cases = [spread((37, 300), seed=1), spread((3, 130, 64), seed=2), spread((2, 96), seed=3)]
    cases.append(np.stack([specials(name, 256)[i % 7] for i in range(9)]))  # rows 5 and 6 hold inf, NaN
    calls = []
    tile_element = native.tile_element

    def spy(*args, **kw):
        result = tile_element(*args, **kw)
        calls.append(result is not None)
        return result

    for values in cases:
        x = torch.from_numpy(values)
        native.tile_element = spy
        try:
            fast = tile_quantize(x, numscope.get_format(name), scaling, overflow=overflow, factors=True)
        finally:
            native.tile_element = tile_element
        set_native(False)
        eager = tile_quantize(x, numscope.get_format(name), scaling, overflow=overflow, factors=True)
        set_native(True)
        for one, other in zip(fast, eager, strict=True):
            assert one.shape == other.shape
            assert_bits_equal(one, other)
    assert calls and all(calls), "the native code did not take the tile calls"


STOCHASTIC_CASES = [
    ("fp4_e2m1", {}),
    ("fp4_e2m1", {"flush_subnormals": True}),
    ("fp8_e4m3", {"scaling": "tensor"}),
    ("fp8_e4m3", {"overflow": "propagate"}),
    ("fp8_e5m2", {"overflow": "propagate"}),
    ("fp8_e5m2fnuz", {"overflow": "propagate", "flush_subnormals": True}),
    ("fp6_e3m2", {"scaling": "row"}),
    ("mxfp4_e2m1", {}),
    ("mxfp8_e4m3", {}),
    ("nvfp4", {}),
]


@pytest.mark.parametrize(("name", "kwargs"), STOCHASTIC_CASES)
def test_stochastic_rounding_equals_the_eager_reference(name: str, kwargs: dict) -> None:
    """Stochastic rounding of FP8, FP6 and FP4 (alone and as MX/NVFP4 elements) through the native code, from
    the same generator state: the eager path's bits, and the generator left in the same state."""
    from numscope.formats import cast as cast_module

    calls = []
    stochastic = native.stochastic

    def spy(*args, **kw):
        result = stochastic(*args, **kw)
        calls.append(result is not None)
        return result

    for values in [*inputs(name), *specials(name, 64)]:
        flat = np.ascontiguousarray(values).reshape(-1)
        x = torch.from_numpy(flat[: flat.size - flat.size % 32]).reshape(-1, 32)
        generators = [torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)]
        cast_module._STOCHASTIC[:] = [spy]
        try:
            fast = numscope.quantize(
                x, name, rounding="stochastic", generator=generators[0], compiled=False, **kwargs
            )
        finally:
            cast_module._STOCHASTIC[:] = [stochastic]
        set_native(False)
        eager = numscope.quantize(
            x, name, rounding="stochastic", generator=generators[1], compiled=False, **kwargs
        )
        set_native(True)
        assert_bits_equal(fast, eager)
        assert torch.equal(generators[0].get_state(), generators[1].get_state())
    assert calls and all(calls), "the native code did not take the stochastic casts"
