"""Native quantizers: the eager reference's float32 arithmetic as a small C library, compiled on first use.

Why: inductor's CPU code for the bit reinterpretations the casts need (``Tensor.view(torch.int32)``) stores
each vector and moves its lanes one by one, so the ``torch.compile`` kernels of :mod:`numscope.formats.fast`
spend 2.5–4 ns per element where a copy takes 0.3; a C compiler vectorizes the same arithmetic directly.
``_native.c`` computes, element by element, exactly the float32 operations of
:func:`numscope.formats.cast.cast`, :func:`numscope.formats.scaling.scale_from_amax`'s users and the MX
block arithmetic of :mod:`numscope.formats.blocks` (same products, same round-to-nearest-even, same order;
built without ``-ffast-math`` and with ``-ffp-contract=off``), so it returns their bits; the tests check it
against the eager path over ties, subnormals, ±inf and NaN.

What it covers (everything else keeps the compiled or eager path): nearest rounding of float element
formats (not ``e8m0``) and integer formats, unscaled or with a per-tensor, per-row or per-column scale
(the amax is taken natively, the scale by :func:`numscope.formats.scaling.scale_from_amax`), delayed
scaling; MX block formats under every scale rule; NVFP4 with its per-tensor scale (both scale maths); and
for block formats blocks along the rows or down the columns (a tensor blocked along its first axis needs
no transposed copy). Not 2-D NVFP4 tiles, NVFP4 per-row scales or Four Over Six. Also tile scaling of
element formats (:func:`tile_amax`, :func:`tile_element`), stochastic rounding of FP8/FP6/FP4 elements
given the eager path's uniform draw (:func:`stochastic`, which :func:`numscope.formats.cast.cast_float`
calls), and the promoted accumulation of DeepSeek-V3's FP8 GEMMs (:func:`promoted_sum`). For
``numscope.convert``'s fp8 operands it also writes the codes in torch's float8 dtypes beside the values
(:func:`element_codes`: a site keeps them for backward, 1 byte instead of 4) and decodes them
(:func:`decode`; torch converts float8 to float32 one element at a time); and for the observer's metrics
each block's scale beside the values (:func:`block_with_scales`).

Built once per machine and source: the library is cached under ``$NUMSCOPE_CACHE`` (default
``~/.cache/numscope``, else a folder in the temp dir) by a hash of the source, the compiler's version and
the CPU's flags (it is built with ``-march=native``), written atomically. No C compiler, or a failed
build: one warning, and quantizing goes on eagerly (or compiled, where that is on) with the same results.
``NUMSCOPE_NATIVE=0`` (or :func:`set_native`) turns it off; the eager path stays the reference it is
tested against. ``benchmarks/bench_train_step.py`` times it against the compiled kernels and eagerly.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from numscope.formats.blocks import element_mantissa_bits
from numscope.formats.cast import NATIVE_DTYPES, register_stochastic
from numscope.formats.scaling import scale_from_amax
from numscope.formats.spec import BlockFormat, FloatFormat, IntFormat, get_format

_SOURCE = Path(__file__).with_name("_native.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fPIC", "-shared", "-std=c11"]
_enabled = os.environ.get("NUMSCOPE_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def set_native(enabled: bool) -> None:
    """Turn the native quantizers on or off (process-wide); off, quantizing is eager (or torch.compile'd
    where the fast path is on): the same bits, slower."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_native expects True or False, got {enabled!r}")
    _enabled = enabled


def native_enabled() -> bool:
    """Whether the native quantizers are switched on (:func:`available` also builds and loads them)."""
    return _enabled


class _Format(ctypes.Structure):
    """``numscope_format`` of ``_native.c``: an element format and the cast's options, as numbers."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("mantissa_bits", ctypes.c_int32),
        ("emin", ctypes.c_int32),
        ("overflow", ctypes.c_int32),
        ("nonfinite", ctypes.c_int32),
        ("flush", ctypes.c_int32),
        ("zero_add", ctypes.c_float),
        ("max", ctypes.c_float),
        ("min_normal", ctypes.c_float),
        ("to_units", ctypes.c_float),
        ("from_units", ctypes.c_float),
        ("min_code", ctypes.c_float),
        ("max_code", ctypes.c_float),
    ]


class _Blocks(ctypes.Structure):
    """``numscope_blocks`` of ``_native.c``: how a block's scale follows from its amax."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("rule", ctypes.c_int32),
        ("emax", ctypes.c_int32),
        ("half", ctypes.c_uint32),
        ("element_max", ctypes.c_float),
        ("encode", ctypes.c_float),
        ("inverse_encode", ctypes.c_float),
        ("target", ctypes.c_float),
        ("inverse_target", ctypes.c_float),
        ("scale_format", _Format),
    ]


class _Codes(ctypes.Structure):
    """``numscope_codes`` of ``_native.c``: the bit layout of a torch float8/float16/bfloat16 dtype."""

    _fields_ = [
        ("e8", ctypes.c_int32),
        ("mantissa_bits", ctypes.c_int32),
        ("bias", ctypes.c_int32),
        ("emin", ctypes.c_int32),
        ("sign_bit", ctypes.c_uint32),
        ("exponent_ones", ctypes.c_uint32),
        ("nan_code", ctypes.c_uint32),
        ("subnormal_units", ctypes.c_float),
    ]


_SCALE_RULES = {"floor": 0, "ceil": 1, "even": 2, "rceil": 3}
_SCALE_MODES = {None: 0, "tensor": 1, "row": 2, "column": 3}


def _folders() -> list[Path]:
    """Where the library is cached: ``$NUMSCOPE_CACHE`` or ``~/.cache/numscope``, else (not writable) a
    folder of this user's in the temp dir."""
    root = os.environ.get("NUMSCOPE_CACHE")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    user = os.getuid() if hasattr(os, "getuid") else 0
    return [Path(root) if root else Path(base) / "numscope", Path(tempfile.gettempdir()) / f"numscope-{user}"]


def _ours(folder: Path) -> bool:
    """Whether ``folder`` is absent or this user's own: a library is loaded and run from it, so a folder in
    a shared temp dir that someone else made first is never used."""
    if not hasattr(os, "getuid"):
        return True
    try:
        return folder.stat().st_uid == os.getuid()
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build() -> Path:
    """The compiled library's path, building it first where the cache lacks it (atomically)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (cc, gcc, clang or $CC)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [
                source,
                " ".join(_FLAGS).encode(),
                version.encode(),
                _cpu_flags().encode(),
                platform.machine().encode(),
            ]
        )
    ).hexdigest()[:16]
    name = f"numscope_native_{key}{'.dll' if sys.platform == 'win32' else '.so'}"
    folders = [folder for folder in _folders() if _ours(folder)]
    for folder in folders:
        if (folder / name).exists():
            return folder / name
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(prefix=name, suffix=".part", dir=folder)
        except OSError:
            continue
        target = folder / name
        break
    else:
        raise RuntimeError(
            f"no writable folder for the compiled library (tried {', '.join(map(str, _folders()))})"
        )
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", partial, "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[:500]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError) as error:
        warnings.warn(
            f"numscope: the native quantizers are unavailable ({error}); quantizing eagerly (or with "
            "torch.compile where that is on) instead: the same results, slower",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    library.numscope_element.argtypes = [pointer, pointer, i64, i64, _Format, pointer, i32]
    library.numscope_element.restype = None
    library.numscope_blocks_quantize.argtypes = [
        pointer,
        pointer,
        i64,
        i64,
        i32,
        i32,
        _Format,
        _Blocks,
        pointer,
    ]
    library.numscope_blocks_quantize.restype = ctypes.c_int
    both = [pointer, pointer, pointer, i64, i64, i32, _Format, _Blocks]
    library.numscope_blocks_quantize_both.argtypes = both
    library.numscope_blocks_quantize_both.restype = ctypes.c_int
    library.numscope_element_codes.argtypes = [pointer, pointer, pointer, i64, i32, _Format, _Codes, pointer]
    library.numscope_element_codes.restype = ctypes.c_int
    library.numscope_decode8.argtypes = [pointer, pointer, i64, _Codes, pointer]
    library.numscope_decode8.restype = None
    library.numscope_block_pack_columns.argtypes = [
        pointer,
        pointer,
        pointer,
        i64,
        i64,
        i32,
        _Format,
        _Blocks,
        _Codes,
        _Codes,
    ]
    library.numscope_block_pack_columns.restype = ctypes.c_int
    library.numscope_block_unpack_columns.argtypes = [
        pointer,
        pointer,
        pointer,
        i64,
        i64,
        i32,
        _Codes,
        _Codes,
        _Blocks,
    ]
    library.numscope_block_unpack_columns.restype = ctypes.c_int
    library.numscope_abs_amax.argtypes = [pointer, pointer, i64, i64, i32]
    library.numscope_abs_amax.restype = None
    library.numscope_rounded_sum.argtypes = [pointer, pointer, i64, i64, i64, i64, _Format]
    library.numscope_rounded_sum.restype = ctypes.c_int
    library.numscope_tile_amax.argtypes = [pointer, pointer, i64, i64, i64, i64, i64]
    library.numscope_tile_amax.restype = ctypes.c_int
    library.numscope_tile_element.argtypes = [pointer, pointer, pointer, i64, i64, i64, i64, i64, _Format]
    library.numscope_tile_element.argtypes += [pointer, pointer]
    library.numscope_tile_element.restype = ctypes.c_int
    library.numscope_promoted_sum.argtypes = [pointer, pointer, pointer, pointer, i64, i64, i64, i64, i64]
    library.numscope_promoted_sum.argtypes += [_Format]
    library.numscope_promoted_sum.restype = ctypes.c_int
    library.numscope_element_stochastic.argtypes = [pointer, pointer, pointer, i64, _Format]
    library.numscope_element_stochastic.restype = ctypes.c_int
    return library


def available() -> bool:
    """Whether the native quantizers are on and built (building them on the first call)."""
    return _enabled and _library() is not None


@functools.lru_cache(maxsize=512)
def _format(fmt: FloatFormat | IntFormat, overflow: str, flush: bool) -> _Format | None:
    """The C description of an element format, or None where the native code does not cover it (built
    once per format and options: every call passes it by value, so the cached structure is never changed)."""
    if isinstance(fmt, IntFormat):
        if not 0 <= fmt.fraction_bits < 100:
            return None
        return _Format(
            kind=2,
            to_units=float(2**fmt.fraction_bits),
            from_units=2.0**-fmt.fraction_bits,
            min_code=float(fmt.min_code),
            max_code=float(fmt.max_code),
        )
    if fmt.special == "e8m0" or (fmt.exponent_bits == 8 and fmt.mantissa_bits == 23):
        return None  # e8m0 has its own rounding; float32 itself has nothing to round
    if fmt.exponent_bits < 8 and fmt.emin - fmt.mantissa_bits < -126:
        return None  # the spacing would be a float32 subnormal, which _grid_small's bit pattern cannot build
    # beyond max: ±max (saturate, or a format with neither inf nor NaN), else ±inf, or NaN
    beyond = 0 if overflow == "saturate" or not (fmt.has_inf or fmt.has_nan) else 1 if fmt.has_inf else 2
    return _Format(
        kind=1 if fmt.exponent_bits == 8 else 0,
        mantissa_bits=fmt.mantissa_bits,
        emin=fmt.emin,
        overflow=beyond,
        nonfinite=0 if fmt.has_inf else (1 if fmt.has_nan else 2),
        flush=int(flush),
        zero_add=-0.0 if fmt.has_negative_zero else 0.0,
        max=fmt.max,
        min_normal=fmt.min_normal,
    )


def covers(fmt: FloatFormat | IntFormat, overflow: str, flush: bool, x: torch.Tensor) -> bool:
    """Whether the native quantizers are on and cover nearest rounding of ``x`` (a CPU float32 tensor) to
    the element format ``fmt``."""
    return available() and _cpu_float(x) and _format(fmt, overflow, flush) is not None


def _block_layout_covered(fmt: BlockFormat) -> bool:
    """Blocks of one row with one scale each (not 2-D NVFP4 tiles, NVFP4 per-row scales, Four Over Six)."""
    return fmt.block_rows == 1 and not fmt.row_scale and not fmt.four_over_six


def covers_block(fmt: BlockFormat, x: torch.Tensor) -> bool:
    """Whether the native quantizers are on and cover the block format ``fmt`` for ``x`` (CPU float32)."""
    return _block_layout_covered(fmt) and available() and _cpu_float(x)


def _cpu_float(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad


def _ready(x: torch.Tensor) -> bool:
    return _cpu_float(x) and x.dim() == 2


@functools.lru_cache(maxsize=64)
def _layout(fmt: FloatFormat, dtype: torch.dtype | None) -> _Codes | None:
    """How ``dtype`` (torch's storage of ``fmt``; None: the format's own bits, in a byte) lays out ``fmt``'s
    values, or None for another dtype."""
    width = 1 + fmt.exponent_bits + fmt.mantissa_bits
    if dtype == torch.bfloat16 and fmt.exponent_bits == 8 and fmt.mantissa_bits == 7:
        return _Codes(e8=1, nan_code=0x7FC0)
    if dtype is not None and width != dtype.itemsize * 8:
        return None
    if fmt.exponent_bits >= 8 or width > 8 + 8 * (dtype is not None) or fmt.mantissa_bits == 0:
        return None
    sign = 1 << (width - 1)
    ones = ((1 << fmt.exponent_bits) - 1) << fmt.mantissa_bits
    nan = {"ieee": ones | (1 << (fmt.mantissa_bits - 1)), "fn": sign - 1, "fnuz": sign, "finite": 0}.get(
        fmt.special
    )
    if nan is None:
        return None
    return _Codes(
        mantissa_bits=fmt.mantissa_bits,
        bias=1 - fmt.emin,
        emin=fmt.emin,
        sign_bit=sign,
        exponent_ones=ones,
        nan_code=nan,
        subnormal_units=2.0 ** (fmt.mantissa_bits - fmt.emin),
    )


def element_codes(
    x: torch.Tensor, fmt: FloatFormat, overflow: str, dtype: torch.dtype, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``cast(x · s) · (1 / s)`` (or ``cast(x)``) of a float32 tensor under nearest rounding, with one
    scale ``s`` for the tensor, and the codes of ``cast(x · s)`` in ``dtype`` (torch's float8, float16 or
    bfloat16 storage of ``fmt``: ``codes.float() · (1 / s)`` gives the values back bit for bit); None
    where the native code does not cover it."""
    if not (available() and _cpu_float(x)):
        return None
    spec, layout = _format(fmt, overflow, False), _layout(fmt, dtype)
    if spec is None or layout is None or (scale is not None and scale.numel() != 1):
        return None
    x = x.contiguous()
    values, codes = _empty(x.shape), _empty(x.shape, dtype)
    pointer = None
    if scale is not None:
        scale = scale.detach().to(torch.float32).reshape(1).contiguous()
        pointer = scale.data_ptr()
    if x.numel():
        done = _library().numscope_element_codes(  # type: ignore[union-attr]
            x.data_ptr(),
            values.data_ptr(),
            codes.data_ptr(),
            x.numel(),
            codes.element_size(),
            spec,
            layout,
            pointer,
        )
        if done != 0:
            return None
    return values, codes


HUGE_PAGE = 2 * 2**20
"""A transparent huge page on x86-64 (and arm64 with 4 KiB base pages), 2 MiB."""
LARGE_OUTPUT = 32 * 2**20
"""Outputs of this many bytes or more are advised into huge pages: glibc maps every allocation above 32 MiB
(its mmap threshold's ceiling on 64-bit systems) afresh, so each such output is faulted in page by page.
Measured here (one thread): the fp8 cast of a 4096 × 8192 float32 gradient, values and codes, 78 ms into
fresh 4 KiB pages, 44 ms advised, 27 ms into buffers already faulted in."""
_MADV_HUGEPAGE = 14
_huge_pages = os.environ.get("NUMSCOPE_HUGE_PAGES", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=1)
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def _empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` for a quantizer's output, which it writes whole; a large one is
    advised into transparent huge pages (``madvise(MADV_HUGEPAGE)`` on the 2 MiB pages inside it), so that
    writing it takes one page fault per 2 MiB instead of one per 4 KiB. Only a hint: the values are the
    same, the kernel may ignore it (``/sys/kernel/mm/transparent_hugepage/enabled`` set to ``never``), and
    ``NUMSCOPE_HUGE_PAGES=0`` turns it off (where the kernel's ``defrag`` setting makes a fault in an
    advised range compact memory, a machine short of free 2 MiB pages may do better without it)."""
    out = torch.empty(shape, dtype=dtype)
    size = out.numel() * out.element_size()
    madvise = _madvise() if _huge_pages and size >= LARGE_OUTPUT else None
    if madvise is not None:
        start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (out.data_ptr() + size) // HUGE_PAGE * HUGE_PAGE
        madvise(start, end - start, _MADV_HUGEPAGE)  # refused (EINVAL: no THP here): no change
    return out


#: the one-byte torch dtypes and their formats (from the casts' own table), whose codes :func:`decode` reads
_FP8_FORMATS = {dtype: name for name, dtype in NATIVE_DTYPES.items() if dtype.itemsize == 1}


def packs_columns(fmt: BlockFormat) -> bool:
    """Whether :func:`block_pack_columns` covers ``fmt`` (MX and NVFP4 with float elements, 1-D blocks)."""
    return (
        isinstance(fmt, BlockFormat) and isinstance(fmt.element, FloatFormat) and _block_layout_covered(fmt)
    )


def block_pack_columns(
    x: torch.Tensor, fmt: BlockFormat, tensor_amax: torch.Tensor | None = None
) -> tuple[tuple[torch.Tensor, torch.Tensor], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] | None:
    """A 2-D float32 tensor quantized to ``fmt`` with blocks down its columns and kept compactly: element
    codes (uint8, the shape of ``x``) and scale codes (uint8, one row per block of rows: MX's E8M0 codes,
    255 marking a block with a non-finite element; NVFP4's E4M3 codes of its stored block scales, its NaN
    code marking such a block), 1 + 1/32 (MX) or 1 + 1/16 (NVFP4) bytes per element; with the function
    that unpacks them to exactly what :func:`block` along the columns gives. ``tensor_amax``: NVFP4's amax
    where it was reduced across ranks. None where not covered (integer elements, 2-D tiles, per-row
    scales, Four Over Six)."""
    if not (packs_columns(fmt) and available() and _ready(x)):
        return None
    x = x.contiguous()
    arguments = _blocks(fmt, False, tensor_amax, x)
    layout = _layout(fmt.element, None)
    scale_layout = _Codes(nan_code=255) if not fmt.tensor_scale else _layout(fmt.scale_format, None)
    if arguments is None or layout is None or scale_layout is None:
        return None
    rows, cols = x.shape
    codes = _empty((rows, cols), torch.uint8)
    scale_codes = torch.empty((-(-rows // fmt.block_size), cols), dtype=torch.uint8)
    if x.numel():
        done = _library().numscope_block_pack_columns(  # type: ignore[union-attr]
            x.data_ptr(),
            codes.data_ptr(),
            scale_codes.data_ptr(),
            rows,
            cols,
            fmt.block_size,
            *arguments,
            layout,
            scale_layout,
        )
        if done == -1:
            raise MemoryError(f"numscope native quantizer: no memory for {cols} column scales")
        if done != 0:
            return None
    unpack = functools.partial(
        _block_unpack_columns,
        block_size=fmt.block_size,
        layout=layout,
        scale_layout=scale_layout,
        params=arguments[1],
    )
    return (codes, scale_codes), unpack


def _block_unpack_columns(
    codes: torch.Tensor,
    scale_codes: torch.Tensor,
    *,
    block_size: int,
    layout: _Codes,
    scale_layout: _Codes,
    params: _Blocks,
) -> torch.Tensor:
    rows, cols = codes.shape
    out = _empty((rows, cols))
    if codes.numel():
        done = _library().numscope_block_unpack_columns(  # type: ignore[union-attr]
            codes.contiguous().data_ptr(),
            scale_codes.contiguous().data_ptr(),
            out.data_ptr(),
            rows,
            cols,
            block_size,
            layout,
            scale_layout,
            params,
        )
        if done != 0:
            raise MemoryError(f"numscope native quantizer: no memory for {cols} column scales")
    return out


def decode(codes: torch.Tensor, descale: torch.Tensor | None = None) -> torch.Tensor | None:
    """float32 ``codes.float() · descale`` (``descale`` one float32 value, or None) of torch fp8 codes, bit
    for bit (torch converts fp8 to float32 one element at a time); None where not covered."""
    name = _FP8_FORMATS.get(codes.dtype)
    if name is None or not available() or codes.device.type != "cpu":
        return None
    layout = _layout(get_format(name), codes.dtype)  # type: ignore[arg-type]
    if layout is None or (descale is not None and descale.numel() != 1):
        return None
    codes = codes.contiguous()
    out = _empty(codes.shape)
    pointer = None
    if descale is not None:
        descale = descale.detach().to(torch.float32).reshape(1).contiguous()
        pointer = descale.data_ptr()
    if codes.numel():
        _library().numscope_decode8(codes.data_ptr(), out.data_ptr(), codes.numel(), layout, pointer)  # type: ignore[union-attr]
    return out


def abs_amax(x: torch.Tensor, mode: str) -> torch.Tensor | None:
    """max |x| of a 2-D float32 tensor: ``tensor`` (shape ()), ``row`` (R, 1) or ``column`` (1, C), as
    ``x.abs().amax(...)`` (NaN where an element is NaN); None where the native code does not cover it."""
    if not (available() and _ready(x)) or mode not in ("tensor", "row", "column") or not x.numel():
        return None
    x = x.contiguous()
    shape = {"tensor": (), "row": (x.shape[0], 1), "column": (1, x.shape[1])}[mode]
    out = torch.empty(shape, dtype=torch.float32)
    _library().numscope_abs_amax(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], _SCALE_MODES[mode])  # type: ignore[union-attr]
    return out


def element(
    x: torch.Tensor,
    fmt: FloatFormat | IntFormat,
    overflow: str,
    flush: bool,
    scale: torch.Tensor | None = None,
    mode: str | None = None,
) -> torch.Tensor | None:
    """Nearest-rounded ``cast(x · s) · (1 / s)`` of a 2-D float32 tensor (``s``: ``scale``, of shape ``()``
    for ``mode="tensor"``, (R, 1) for ``"row"``, (1, C) for ``"column"``), or ``cast(x)`` without a scale;
    None where the native code does not cover the call (the caller then takes another path)."""
    if not (available() and _ready(x)) or mode not in _SCALE_MODES or (mode is None) != (scale is None):
        return None
    spec = _format(fmt, overflow, flush)
    if spec is None:
        return None
    x = x.contiguous()
    out = _empty(x.shape)
    pointer = None
    if scale is not None:
        scale = scale.detach().to(torch.float32).contiguous()
        expected = {"tensor": 1, "row": x.shape[0], "column": x.shape[1]}[mode]  # type: ignore[index]
        if scale.numel() != expected:
            return None
        pointer = scale.data_ptr()
    if x.numel():
        _library().numscope_element(  # type: ignore[union-attr]
            x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], spec, pointer, _SCALE_MODES[mode]
        )
    return out


def _blocks(
    fmt: BlockFormat, flush: bool, tensor_amax: torch.Tensor | None, x: torch.Tensor
) -> tuple[_Format, _Blocks] | None:
    """The element format and block parameters of ``fmt`` for numscope_blocks_quantize, or None where the
    native code does not cover it (2-D NVFP4 tiles, NVFP4 per-row scales, Four Over Six)."""
    if not _block_layout_covered(fmt):
        return None
    element_fmt = fmt.element
    spec = _format(element_fmt, "saturate", flush)
    if spec is None:
        return None
    if not fmt.tensor_scale:
        half = 1 << (22 - element_mantissa_bits(element_fmt)) if fmt.scale_rule == "even" else 0
        params = _Blocks(
            kind=0,
            rule=_SCALE_RULES[fmt.scale_rule],
            emax=element_fmt.emax,
            half=half,
            element_max=float(element_fmt.max),
        )
        return spec, params
    scale_spec = _format(fmt.scale_format, "saturate", False)
    if scale_spec is None or scale_spec.kind != 0 or (fmt.scale_math == "divide" and spec.kind != 0):
        return None
    if tensor_amax is None:
        tensor_amax = abs_amax(x, "tensor") if x.numel() else torch.zeros(())
        if tensor_amax is None:
            return None
    if fmt.nan_scale and bool(torch.isnan(tensor_amax).any()):
        return None  # '@nan': the whole tensor NaN, as the eager path gives it
    target = 6.0
    encode = scale_from_amax(tensor_amax.reshape(()), fmt.scale_format.max * element_fmt.max)
    params = _Blocks(
        kind=2 if fmt.scale_math == "divide" else 1,
        encode=encode.item(),
        inverse_encode=(1.0 / encode).item(),  # float32, as the reference's 1.0 / encode_scale
        target=target,
        inverse_target=torch.tensor(1.0 / target, dtype=torch.float32).item(),
        scale_format=scale_spec,
    )
    return spec, params


def block(
    x: torch.Tensor,
    fmt: BlockFormat,
    flush: bool,
    along_columns: bool = False,
    tensor_amax: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A 2-D float32 tensor quantized to the block format ``fmt`` (nearest), blocks along its rows (the last
    axis, a whole number of blocks long) or, ``along_columns``, down its columns (any number of rows: a
    short last block is the reference's zero-padded one). ``tensor_amax``: NVFP4's amax of the whole tensor
    where it was reduced across ranks (else taken here). None where the native code does not cover it."""
    done = _blocks_quantize(x, fmt, flush, along_columns, tensor_amax, False)
    return None if done is None else done[0]


def block_both(
    x: torch.Tensor, fmt: BlockFormat, tensor_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`block` along the rows and down the columns of one 2-D float32 tensor, from one read of it (a
    gradient that dgrad takes in blocks along its rows and wgrad down its columns): ``(rows, columns)``,
    each bit for bit what :func:`block` gives in that direction. The rows must be a whole number of blocks
    long. None where the native code does not cover it."""
    if not (available() and _ready(x)) or x.shape[1] % fmt.block_size:
        return None
    x = x.contiguous()
    arguments = _blocks(fmt, False, tensor_amax, x)
    if arguments is None:
        return None
    along_rows, along_columns = _empty(x.shape), _empty(x.shape)
    if x.numel():
        rows, cols = x.shape
        outputs = (along_rows.data_ptr(), along_columns.data_ptr())
        done = _library().numscope_blocks_quantize_both(  # type: ignore[union-attr]
            x.data_ptr(), *outputs, rows, cols, fmt.block_size, *arguments
        )
        if done == -1:
            raise MemoryError(f"numscope native quantizer: no memory for {cols} column scales")
        if done != 0:
            return None
    return along_rows, along_columns


def block_with_scales(
    x: torch.Tensor, fmt: BlockFormat, tensor_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`block` along the rows, and each block's decode scale (what multiplies its elements; NaN for a
    block with a non-finite element) as a (blocks, 1) tensor in row order, as
    :func:`numscope.formats.blocks.block_parts_2d` gives ``scales``; None where not covered."""
    return _blocks_quantize(x, fmt, False, False, tensor_amax, True)


def _blocks_quantize(
    x: torch.Tensor,
    fmt: BlockFormat,
    flush: bool,
    along_columns: bool,
    tensor_amax: torch.Tensor | None,
    with_scales: bool,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if not (available() and _ready(x)):
        return None
    if not along_columns and x.shape[1] % fmt.block_size:
        return None
    x = x.contiguous()
    arguments = _blocks(fmt, flush, tensor_amax, x)
    if arguments is None:
        return None
    out = _empty(x.shape)
    scales = torch.empty((x.numel() // fmt.block_size, 1), dtype=torch.float32) if with_scales else None
    if x.numel():
        rows, cols = x.shape
        done = _library().numscope_blocks_quantize(  # type: ignore[union-attr]
            x.data_ptr(),
            out.data_ptr(),
            rows,
            cols,
            int(along_columns),
            fmt.block_size,
            *arguments,
            None if scales is None else scales.data_ptr(),
        )
        if done == -1:
            raise MemoryError(f"numscope native quantizer: no memory for {x.shape[1]} column scales")
        if done != 0:
            return None
    return out, scales


def rounded_sum(partials: torch.Tensor, fmt: FloatFormat, per_group: int) -> torch.Tensor | None:
    """:func:`numscope.sites.gemm.accumulate_matmul`'s narrow accumulation of ``partials`` (shape
    ``(..., chunks, M, N)``: each run of ``chunks`` products' float32 sum), in one pass: each partial rounded
    to ``fmt`` (nearest, overflow propagated), added in order with a rounding after every addition, and every
    ``per_group`` partials' sum added in float32 to the total; returns ``(..., M, N)``. None where the native
    code does not cover it (the caller loops eagerly: the same bits)."""
    if not (available() and _cpu_float(partials)) or partials.dim() < 3:
        return None
    spec = _format(fmt, "propagate", False)
    if spec is None or spec.kind != 1:
        return None
    partials = partials.contiguous()
    chunks, rows, cols = partials.shape[-3:]
    batch = partials.numel() // max(1, chunks * rows * cols)
    out = _empty((*partials.shape[:-3], rows, cols))
    if out.numel() == 0 or chunks == 0:
        return None
    done = _library().numscope_rounded_sum(  # type: ignore[union-attr]
        partials.data_ptr(), out.data_ptr(), batch, chunks, rows * cols, per_group, spec
    )
    return out if done == 0 else None


def tile_amax(x: torch.Tensor, rows_per: int, cols_per: int) -> torch.Tensor | None:
    """max |x| over each ``rows_per`` × ``cols_per`` tile of the last two axes of a float32 tensor (short
    last tiles as the reference's zero-padded ones): shape ``(batch, ceil(rows / rows_per), ceil(cols /
    cols_per))`` with ``batch`` the product of the leading axes, as :func:`numscope.formats.quantize.
    tile_quantize`'s amax; None where the native code is off or ``x`` is not a CPU float32 tensor of ≥ 2
    dims."""
    if not (available() and _ready(x)) or x.dim() < 2:
        return None
    rows, cols = x.shape[-2:]
    batch = x.numel() // max(1, rows * cols)
    x = x.contiguous()
    out = torch.empty((batch, -(-rows // rows_per), -(-cols // cols_per)), dtype=torch.float32)
    if x.numel():
        done = _library().numscope_tile_amax(
            x.data_ptr(), out.data_ptr(), batch, rows, cols, rows_per, cols_per
        )  # type: ignore[union-attr]
        if done == -1:
            raise MemoryError(f"numscope native quantizer: no memory for {cols} column maxima")
    return out


def tile_element(
    x: torch.Tensor,
    fmt: FloatFormat | IntFormat,
    overflow: str,
    flush: bool,
    tile: tuple[int, int],
    scale: torch.Tensor,
    decode: torch.Tensor,
    codes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Nearest-rounded tile scaling of a float32 tensor of ≥ 2 dims: ``codes = cast(x · scale_t)`` and
    ``values = codes · decode_t`` with one ``scale`` and ``decode`` per tile (laid out as :func:`tile_amax`
    gives the amax); ``(values, codes if codes else None)``, or None where the native code does not cover
    the format."""
    if not (available() and _ready(x)) or x.dim() < 2:
        return None
    spec = _format(fmt, overflow, flush)
    if spec is None:
        return None
    rows, cols = x.shape[-2:]
    batch = x.numel() // max(1, rows * cols)
    shape = (batch, -(-rows // tile[0]), -(-cols // tile[1]))
    scale = scale.detach().to(torch.float32).reshape(shape).contiguous()
    decode = decode.detach().to(torch.float32).reshape(shape).contiguous()
    x = x.contiguous()
    out = _empty(x.shape)
    kept = _empty(x.shape) if codes else None
    if x.numel():
        done = _library().numscope_tile_element(  # type: ignore[union-attr]
            x.data_ptr(),
            out.data_ptr(),
            None if kept is None else kept.data_ptr(),
            batch,
            rows,
            cols,
            *tile,
            spec,
            scale.data_ptr(),
            decode.data_ptr(),
        )
        if done == -1:
            raise MemoryError(f"numscope native quantizer: no memory for {cols} tile scales")
    return out, kept


def promoted_sum(
    partials: torch.Tensor,
    row_scales: torch.Tensor,
    column_scales: torch.Tensor,
    fmt: FloatFormat,
    per_run: int,
) -> torch.Tensor | None:
    """:func:`numscope.sites.gemm.accumulate_matmul`'s promoted FP8 GEMM after its exact products, in one
    pass: ``partials`` (float64, ``(..., runs · per_run, M, N)``: each chunk's exact sum of code products)
    each rounded to the accumulator ``fmt`` and added within each run of ``per_run`` with a rounding after
    every addition, then ``total = fma(row_scales[..., i, run] · column_scales[..., run, j], run_sum, total)``
    in float32; ``row_scales`` ``(..., M, runs)`` and ``column_scales`` ``(..., runs, N)`` broadcast to the
    partials' batch axes. Returns ``(..., M, N)`` float32, or None where the native code does not cover it
    (the caller loops eagerly: the same bits)."""
    if (
        not available()
        or partials.dtype != torch.float64
        or partials.device.type != "cpu"
        or partials.dim() < 3
    ):
        return None
    spec = _format(fmt, "propagate", False)
    if spec is None or spec.kind != 1:
        return None
    chunks, rows, cols = partials.shape[-3:]
    if per_run < 1 or chunks % per_run:
        return None
    runs = chunks // per_run
    lead = partials.shape[:-3]
    row_scales = torch.broadcast_to(row_scales.float(), (*lead, rows, runs)).contiguous()
    column_scales = torch.broadcast_to(column_scales.float(), (*lead, runs, cols)).contiguous()
    partials = partials.contiguous()
    batch = partials.numel() // max(1, chunks * rows * cols)
    out = _empty((*lead, rows, cols))
    if out.numel() == 0 or runs == 0:
        return None
    done = _library().numscope_promoted_sum(  # type: ignore[union-attr]
        partials.data_ptr(),
        out.data_ptr(),
        row_scales.data_ptr(),
        column_scales.data_ptr(),
        batch,
        runs,
        per_run,
        rows,
        cols,
        spec,
    )
    return out if done == 0 else None


def stochastic(
    x: torch.Tensor, draw: Callable[[], torch.Tensor], fmt: FloatFormat, overflow: str, flush: bool
) -> torch.Tensor | None:
    """Stochastic rounding of float32 ``x`` to a float format with fewer than 8 exponent bits (FP8, FP6,
    FP4): ``floor(x / spacing + u) · spacing`` with ``u = draw()``, the uniform draw of ``x``'s shape that
    :func:`numscope.formats.cast.cast_float` takes from its generator, then the nearest casts' rules for
    overflow, flushing, zeros and non-finite inputs: that function's bits. None, before drawing, where the
    native code does not cover the call (so the caller's own draw is the same)."""
    if not (available() and _cpu_float(x)):
        return None
    spec = _format(fmt, overflow, flush)
    if spec is None or spec.kind != 0:
        return None
    noise = draw()
    if noise.shape != x.shape or noise.dtype != torch.float32:
        raise ValueError(
            f"stochastic: a draw of shape {tuple(x.shape)} in float32 expected, got {noise.shape}"
        )
    x, noise = x.contiguous(), noise.contiguous()
    out = _empty(x.shape)
    if x.numel():
        _library().numscope_element_stochastic(
            x.data_ptr(), noise.data_ptr(), out.data_ptr(), x.numel(), spec
        )  # type: ignore[union-attr]
    return out


register_stochastic(stochastic)
