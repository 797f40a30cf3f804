"""Fake-quantization: ``quantize(x, fmt, scaling=...)`` returns what ``x`` becomes in ``fmt``.

The result has the shape and dtype of ``x``; computed in float32, every value is exactly one the format
holds after descaling. :func:`encode` returns the raw codes and scales instead (for storage and bit
counts); ``encode(...).decode()`` equals ``quantize(...)``.

Block formats:

* MX (OCP MX v1.0 §6.3): blocks of 32 consecutive elements along ``axis``; shared scale
  X = 2^(floor(log2 amax) − emax_elem) clamped to E8M0's [2^-127, 2^127] (``@rceil``:
  X = 2^ceil(log2(amax / max_elem)) on the float32 quotient); elements ``cast(v / X)`` with saturation.
  A block holding NaN or ±inf has a NaN scale: every element of it decodes to NaN.
* NVFP4: per-tensor encode scale S = 448·6 / amax(tensor) (1 for a zero tensor); per block of 16 the
  E4M3 decode scale s_b = e4m3(amax_b / 6 · S) (nearest, saturated); elements e2m1(v / (s_b / S)) with
  saturation; decoded value e · (s_b / S). A block whose s_b is 0 decodes to 0.

``flush_subnormals=True`` flushes the elements of a block format after the block scale, as the element cast
does: an element below its format's smallest normal becomes zero (integer elements have no subnormals).

A last axis that does not divide the block is padded with zeros (which never change an amax) and the
padding is dropped from the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from numscope.formats import fast, native
from numscope.formats.blocks import (
    axis_last_2d,
    block_parts,
    block_values,
    checked_axis,
    tile_shape,
    to_tiles,
    unblock,
)
from numscope.formats.cast import OVERFLOWS, ROUNDINGS, cast, scale_then_cast
from numscope.formats.path import Cast, QuantizerPath, native_tiles, quantizer_paths
from numscope.formats.scaling import (
    DelayedScaler,
    Scaling,
    element_scale,
    exact_pow2,
    log2_floor,
    reduce_amax_,
)
from numscope.formats.spec import BlockFormat, FloatFormat, Format, IntFormat, get_format
from numscope.vocab import Overflow, Rounding

ScalingArg = str | Scaling | DelayedScaler | dict | None


def _check_args(x: torch.Tensor, rounding: str, overflow: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got dtype {x.dtype}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; allowed: {', '.join(ROUNDINGS)}")
    if overflow not in OVERFLOWS:
        raise ValueError(f"unknown overflow {overflow!r}; allowed: {', '.join(OVERFLOWS)}")


def _resolve_scaling(scaling: ScalingArg) -> tuple[Scaling | None, DelayedScaler | None]:
    if isinstance(scaling, DelayedScaler):
        return scaling.scaling, scaling
    parsed = Scaling.parse(scaling)
    if parsed is not None and parsed.kind == "delayed":
        raise ValueError(
            "delayed scaling keeps an amax history between calls: pass a numscope.DelayedScaler "
            "(e.g. scaling=numscope.DelayedScaler(numscope.Scaling('delayed', history_len=16)))"
        )
    if parsed is not None and parsed.kind == "none":
        parsed = None
    return parsed, None


def _quantize_element(
    xf: torch.Tensor,
    fmt: FloatFormat | IntFormat,
    scaling: Scaling | None,
    delayed: DelayedScaler | None,
    rounding: str,
    overflow: str,
    flush_subnormals: bool,
    generator,
) -> torch.Tensor:
    if scaling is None:
        return cast(xf, fmt, rounding, overflow, flush_subnormals, generator)
    if scaling.kind == "block":
        return tile_quantize(xf, fmt, scaling, rounding, overflow, flush_subnormals, generator)[0]
    scale = element_scale(xf, fmt, scaling, delayed)
    return scale_then_cast(xf, fmt, scale, rounding, overflow, flush_subnormals, generator)[0]


def tile_quantize(
    xf: torch.Tensor,
    fmt: FloatFormat | IntFormat,
    scaling: Scaling,
    rounding: str = "nearest",
    overflow: str = "saturate",
    flush_subnormals: bool = False,
    generator: torch.Generator | None = None,
    factors: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A float32 tensor quantized to an element format under tile scaling (``Scaling("block",
    block_shape=...)``): ``(values, codes, decode)``, with ``factors`` also the element codes and each
    element's decode scale (``values = codes · decode``, all of ``xf``'s shape), which a GEMM that applies
    the scales at promotion needs (:func:`numscope.sites.register_factors`)."""
    tile = tile_shape(xf, fmt, scaling)
    if native_tiles(Cast(fmt, "block", rounding, overflow, flush_subnormals), xf):
        done = _tile_native(xf, fmt, scaling, tile, overflow, flush_subnormals, factors)
        if done is not None:
            return done
    tiles, (rows, cols, _, _) = to_tiles(xf, *tile)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True)
    scale, decode = _tile_scales(amax, fmt, scaling)
    codes = cast(tiles * scale, fmt, rounding, overflow, flush_subnormals, generator)  # type: ignore[arg-type]

    def untile(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(*tiles.shape[:-4], tiles.shape[-4] * tiles.shape[-3], -1)
        t = t.narrow(-2, 0, rows).narrow(-1, 0, cols)
        return t.reshape(xf.shape)

    values = untile(codes * decode)
    if not factors:
        return values, None, None
    return values, untile(codes), untile(decode.expand_as(tiles))


def _tile_scales(
    amax: torch.Tensor, fmt: FloatFormat | IntFormat, scaling: Scaling
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tile's (scale, decode) from its amax: one the reciprocal of the other, DeepGEMM's way round
    where ``scale_from_decode``."""
    if scaling.scale_from_decode:
        decode = scaling.decode(amax, fmt.max)
        return 1.0 / decode, decode
    scale = scaling.scale(amax, fmt.max)
    return scale, 1.0 / scale


def _tile_native(
    xf: torch.Tensor,
    fmt: FloatFormat | IntFormat,
    scaling: Scaling,
    tile: tuple[int, int],
    overflow: str,
    flush_subnormals: bool,
    factors: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """:func:`tile_quantize` (nearest rounding) through the native quantizers, the same bits; None where
    they do not cover the call."""
    amax = native.tile_amax(xf, *tile)
    if amax is None:
        return None
    scale, decode = _tile_scales(amax, fmt, scaling)
    done = native.tile_element(xf, fmt, overflow, flush_subnormals, tile, scale, decode, codes=factors)
    if done is None:
        return None
    values, codes = done
    if not factors:
        return values, None, None
    rows, cols = xf.shape[-2:]
    per_row = decode.repeat_interleave(tile[0], dim=1).narrow(1, 0, rows)
    per_element = per_row.repeat_interleave(tile[1], dim=2)
    return values, codes, per_element.narrow(2, 0, cols).reshape(xf.shape).contiguous()


def as_float32(x: torch.Tensor, spec: Format) -> torch.Tensor:
    """``x`` as float32 for a cast to ``spec``: float64 rounded to odd unless ``spec`` is fp32 itself.

    Rounding to odd (Boldo & Melquiond) keeps the float32 result off every midpoint of a format with at
    least two fewer significand bits than float32's 24 (every format here but fp32, at every magnitude:
    below float32's normals its grid is still finer than theirs), so rounding it to that format again
    gives the nearest-even rounding of the float64 value. fp32 takes float64's own nearest-even cast.
    """
    if x.dtype == torch.float32:
        return x
    nearest = x.float()
    if x.dtype != torch.float64 or (isinstance(spec, FloatFormat) and spec.name == "fp32"):
        return nearest
    back = nearest.double()
    inexact = (back != x) & torch.logical_not(torch.isnan(x))
    bits = nearest.view(torch.int32)
    bits = bits - (back.abs() > x.abs()).to(torch.int32)  # one step toward zero (inf: to ±max)
    bits = torch.where(inexact, bits | 1, nearest.view(torch.int32))  # the neighbour with an odd significand
    return bits.view(torch.float32)


def quantize(
    x: torch.Tensor,
    fmt: str | Format,
    *,
    scaling: ScalingArg = None,
    rounding: Rounding | str = Rounding.NEAREST,
    overflow: Overflow | str = Overflow.SATURATE,
    flush_subnormals: bool = False,
    generator: torch.Generator | None = None,
    compiled: bool | None = None,
) -> torch.Tensor:
    """Return ``x`` as it is after a round trip through ``fmt`` under ``scaling`` (same shape and dtype).

    fmt: a format name (see ``numscope formats``) or object.
    scaling: ``None``, ``"tensor"``, ``"row"``, ``"column"``, a :class:`Scaling` (e.g. ``Scaling("block",
        block_shape=(1, 128))``), or a :class:`DelayedScaler` for delayed scaling. Block formats bring their
        own block scaling; ``Scaling("block", axis=0)`` chooses the axis their blocks run along.
    rounding: ``"nearest"`` (ties to even), ``"nearest_away"`` (ties away from zero), ``"stochastic"``,
        ``"zero"``.
    overflow: ``"saturate"`` or ``"propagate"`` (the format's own inf/NaN; see :mod:`numscope.formats.cast`).
    flush_subnormals: results below the format's smallest normal become zero; for block formats the
        elements after the block scale (an element below its format's smallest normal becomes zero; no
        effect on integer elements).
    generator: the random source of stochastic rounding (reproducible runs).
    compiled: use the ``torch.compile`` kernels of :mod:`numscope.formats.fast` for what the native
        quantizers do not cover (the same bits); ``None`` (default): as :func:`numscope.formats.set_fast`
        says (``NUMSCOPE_FAST``). The native quantizers (:mod:`numscope.formats.native`, the same bits
        again) take every call they cover either way, unless :func:`numscope.formats.set_native` (or
        ``NUMSCOPE_NATIVE=0``) turns them off; with both off this is the eager reference.

    The arithmetic is float32's. float64 input is first rounded to float32 *to odd* (see
    :func:`as_float32`), so that unscaled nearest rounding to any format narrower than fp32 is that of the
    float64 value itself, without double rounding; float16 and bfloat16 input is exact in float32.
    """
    _check_args(x, rounding, overflow)
    spec = get_format(fmt)
    parsed, delayed = _resolve_scaling(scaling)
    xf = as_float32(x.detach(), spec)
    kind = None if parsed is None else parsed.kind
    if xf.numel() == 0:  # nothing to scale or round
        _check_layout(xf, spec, parsed)
        _share_empty_amax(xf, spec, parsed, delayed)
        return x.detach().clone()
    paths = quantizer_paths(Cast(spec, kind, rounding, overflow, flush_subnormals), xf, compiled=compiled)
    out = None
    if paths[0] is not QuantizerPath.EAGER:  # native, then compiled where allowed
        compile = QuantizerPath.COMPILED in paths
        out = _quantize_fast(xf, spec, parsed, delayed, overflow, flush_subnormals, compile)
    if out is None and isinstance(spec, BlockFormat):
        axis = _block_axis(spec, parsed)
        parts = block_parts(xf, spec, axis, rounding, generator, _reduces(parsed), flush_subnormals)
        out = unblock(block_values(parts.elements, parts.scales), xf.shape, axis, parts.length)
    elif out is None:
        out = _quantize_element(xf, spec, parsed, delayed, rounding, overflow, flush_subnormals, generator)
    return out.to(x.dtype)


def _check_layout(x: torch.Tensor, spec: Format, parsed: Scaling | None) -> None:
    """Raise where ``parsed`` does not fit ``spec`` and ``x``'s shape (what quantizing would check)."""
    if isinstance(spec, BlockFormat):
        axis_last_2d(x, _block_axis(spec, parsed))
    elif parsed is not None and parsed.kind == "block":
        tile_shape(x, spec, parsed)


def _share_empty_amax(
    x: torch.Tensor, spec: Format, parsed: Scaling | None, delayed: DelayedScaler | None
) -> None:
    """An empty tensor's part in the per-tensor (and per-column) amax reduction: none in one process (a
    delayed scaler records nothing), 0 (the identity of the maximum) where amaxes are reduced across ranks,
    so that a rank whose share of a batch is empty issues the collectives the others do (and records what
    they record)."""
    if delayed is not None:
        delayed.scale_for(x, spec.max)
    elif (parsed is not None and parsed.kind == "tensor") or (
        isinstance(spec, BlockFormat) and spec.tensor_scale and not spec.row_scale
    ):
        reduce_amax_(torch.zeros(1, device=x.device), _reduces(parsed))
    elif parsed is not None and parsed.kind == "column" and x.dim() >= 2:
        reduce_amax_(torch.zeros((1,) * (x.dim() - 1) + (x.shape[-1],), device=x.device), parsed.reduce_amax)


def _reduces(parsed: Scaling | None) -> bool:
    """Whether a per-tensor amax is reduced across ranks (``Scaling.reduce_amax``; default yes)."""
    return parsed is None or parsed.reduce_amax


def _block_axis(spec: BlockFormat, parsed: Scaling | None) -> int:
    """The axis the blocks of ``spec`` run along, after checking that ``parsed`` fits a block format."""
    if parsed is not None and parsed.kind != "block":
        raise ValueError(
            f"block format {spec.name!r} brings its own block scaling; "
            f"scaling {parsed.kind!r} does not apply "
            "(use scaling=None or Scaling('block', axis=...))"
        )
    if parsed is not None and parsed.block_shape is not None:
        raise ValueError(
            f"block format {spec.name!r} has a fixed block of {spec.block_size}; drop block_shape"
        )
    return parsed.axis if parsed is not None else -1


def _down_columns(shape: torch.Size, axis: int, block_size: int) -> bool:
    """Whether blocks along ``axis`` (not the last) of a contiguous tensor of ``shape`` are the column
    blocks of its 2-D view (the axes up to ``axis`` folded into rows, the later ones into columns): along
    the first axis always (a short last block is the reference's zero-padded one either way), along a later
    one when its length is a whole number of blocks, so that no block runs from one slice into the next."""
    return axis < len(shape) - 1 and (axis == 0 or shape[axis] % block_size == 0)


def _quantize_fast(
    xf: torch.Tensor,
    spec: Format,
    parsed: Scaling | None,
    delayed: DelayedScaler | None,
    overflow: str,
    flush_subnormals: bool,
    compile: bool,
) -> torch.Tensor | None:
    """Nearest rounding through :mod:`numscope.formats.fast` (same results), on the paths
    :func:`numscope.formats.path.quantizer_paths` chose: its native quantizers where they cover the call,
    else its compiled kernels, or (``compile=False``) None, which leaves the call to the eager path. With
    ``compile=False`` the native code covers the format (checked by the caller), so a delayed scaler
    records this tensor's amax only where a result comes back."""
    if isinstance(spec, BlockFormat):
        axis = checked_axis(xf, _block_axis(spec, parsed))
        if xf.dim() >= 2 and xf.is_contiguous() and _down_columns(xf.shape, axis, spec.block_size):
            # blocks down the columns of a 2-D view: (the axes up to ``axis``, the axes after it)
            split = axis + 1
            columns = xf.reshape(math.prod(xf.shape[:split]), -1)
            out = fast.block_columns(columns, spec, _reduces(parsed), flush_subnormals)
            if out is not None:
                return out.reshape(xf.shape)
        x2d, moved = axis_last_2d(xf, axis)
        out = fast.block(x2d, spec, _reduces(parsed), flush_subnormals, compile)
        if out is None:
            return None
        out = out.reshape(moved)
        return out.reshape(xf.shape) if xf.dim() == 0 else out.movedim(-1, axis)
    x2d = xf.reshape(-1, xf.shape[-1]) if xf.dim() > 0 else xf.reshape(1, 1)
    if delayed is not None:  # native (the caller checked it covers the call) or compiled: scale_for records
        scale = delayed.scale_for(xf, spec.max, amax=fast.abs_amax(x2d, "tensor"))
        out = fast.element(x2d, spec, overflow, flush_subnormals, scale=scale, compile=compile)
    else:
        out = fast.element(x2d, spec, overflow, flush_subnormals, scaling=parsed, compile=compile)
    return None if out is None else out.reshape(xf.shape)


# -- raw codes ----------------------------------------------------------------------------------------


def _float_codes(values: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Bit patterns (int32) of float32 values that lie exactly on ``fmt``'s grid (NaN/inf included)."""
    e_bits, m_bits = fmt.exponent_bits, fmt.mantissa_bits
    if fmt.special == "e8m0":
        field = (log2_floor(values) + 127).clamp(0, 254)
        return torch.where(torch.isnan(values), torch.full_like(field, 255), field)
    magnitude = values.abs()
    sign = torch.signbit(values).to(torch.int32)
    exponent = log2_floor(torch.where(magnitude > 0, magnitude, torch.ones_like(magnitude)))
    normal = magnitude >= fmt.min_normal
    biased = torch.where(normal, exponent + int(fmt.bias), torch.zeros_like(exponent))  # type: ignore[operator]
    unit = torch.where(normal, exact_pow2(exponent - m_bits), torch.full_like(magnitude, fmt.min_subnormal))
    significand = torch.where(torch.isfinite(magnitude), magnitude / unit, torch.zeros_like(magnitude))
    mantissa = significand.to(torch.int32) - torch.where(normal, 1 << m_bits, 0)
    code = (sign << (e_bits + m_bits)) | (biased << m_bits) | mantissa
    top = (1 << e_bits) - 1
    if fmt.special == "ieee":
        code = torch.where(torch.isinf(values), (sign << (e_bits + m_bits)) | (top << m_bits), code)
        code = torch.where(
            torch.isnan(values), torch.full_like(code, (top << m_bits) | (1 << max(m_bits - 1, 0))), code
        )
    elif fmt.special == "fn":
        code = torch.where(torch.isnan(values), torch.full_like(code, (1 << (e_bits + m_bits)) - 1), code)
    elif fmt.special == "fnuz":
        code = torch.where(values == 0, torch.zeros_like(code), code)
        code = torch.where(torch.isnan(values), torch.full_like(code, 1 << (e_bits + m_bits)), code)
    return code


def _float_decode(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    codes = codes.to(torch.int32)
    e_bits, m_bits = fmt.exponent_bits, fmt.mantissa_bits
    if fmt.special == "e8m0":
        value = exact_pow2(codes - 127)
        return torch.where(codes == 255, torch.full_like(value, float("nan")), value)
    sign = (codes >> (e_bits + m_bits)) & 1
    biased = (codes >> m_bits) & ((1 << e_bits) - 1)
    mantissa = codes & ((1 << m_bits) - 1)
    normal = biased > 0
    significand = torch.where(normal, mantissa + (1 << m_bits), mantissa).float()
    exponent = torch.where(normal, biased - int(fmt.bias), torch.full_like(biased, fmt.emin))  # type: ignore[operator]
    value = significand * exact_pow2(exponent - m_bits)
    value = torch.where(sign.bool(), -value, value)
    top = (1 << e_bits) - 1
    if fmt.special == "ieee":
        value = torch.where(
            (biased == top) & (mantissa == 0), torch.where(sign.bool(), -torch.inf, torch.inf), value
        )
        value = torch.where((biased == top) & (mantissa != 0), torch.full_like(value, float("nan")), value)
    elif fmt.special == "fn":
        value = torch.where(
            (biased == top) & (mantissa == (1 << m_bits) - 1), torch.full_like(value, float("nan")), value
        )
    elif fmt.special == "fnuz":
        value = torch.where(codes == (1 << (e_bits + m_bits)), torch.full_like(value, float("nan")), value)
    return value


def _element_codes(values: torch.Tensor, fmt: FloatFormat | IntFormat) -> torch.Tensor:
    if isinstance(fmt, IntFormat):
        if torch.isnan(values).any():
            raise ValueError(f"{fmt.name} has no code for NaN; the input holds NaN")
        return torch.round(values * float(2**fmt.fraction_bits)).to(
            torch.int8 if fmt.bits <= 8 else torch.int32
        )
    if fmt.special == "ieee" and fmt.mantissa_bits == 0 and torch.isnan(values).any():
        # the all-ones exponent has a single code, inf: there is none left for NaN (it would decode as inf)
        raise ValueError(f"{fmt.name} has no code for NaN (no mantissa bits); the input holds NaN")
    dtype = torch.uint8 if fmt.bits <= 8 else (torch.int16 if fmt.bits <= 16 else torch.int32)
    codes = _float_codes(values, fmt)
    return (
        codes.to(torch.int16).view(torch.uint16).to(torch.int32).to(dtype)
        if dtype == torch.int16
        else codes.to(dtype)
    )


def _element_values(codes: torch.Tensor, fmt: FloatFormat | IntFormat) -> torch.Tensor:
    if isinstance(fmt, IntFormat):
        return codes.float() * float(2.0**-fmt.fraction_bits)
    if codes.dtype == torch.int16:
        codes = codes.to(torch.int32) & 0xFFFF
    return _float_decode(codes, fmt)


@dataclass(frozen=True)
class Encoded:
    """A tensor stored in a format: element codes plus the scales needed to decode them.

    codes: element bit patterns (uint8 for formats of ≤ 8 bits; int8 two's complement for integers).
    scales: decode multipliers — per tensor/row/column/tile (float32) for scaled element formats, E8M0 or
        E4M3 *codes* per block for block formats (shape (..., nblocks, 1) with the block axis last).
    tensor_scale: NVFP4's float32 per-tensor encode scale.
    """

    fmt: Format
    codes: torch.Tensor
    scales: torch.Tensor | None
    tensor_scale: torch.Tensor | None
    shape: tuple[int, ...]
    axis: int = -1
    length: int = 0

    @property
    def bits(self) -> int:
        """Storage in bits: elements, block or tensor scales, and the per-tensor scale."""
        total = int(torch.Size(self.shape).numel()) * self.fmt.bits
        if self.scales is not None:
            scale_bits = self.fmt.scale_format.bits if isinstance(self.fmt, BlockFormat) else 32
            count = self.scales.numel()
            if isinstance(self.fmt, BlockFormat) and self.fmt.block_rows > 1:  # one scale per tile of rows
                rows, blocks = math.prod(self.scales.shape[:-2]), self.scales.shape[-2]
                count = -(-rows // self.fmt.block_rows) * blocks
            total += count * scale_bits
        if self.tensor_scale is not None:
            total += 32 * self.tensor_scale.numel()
        return total

    def decode(self) -> torch.Tensor:
        """The float32 values (equal to :func:`quantize` with the same arguments)."""
        fmt = self.fmt
        if isinstance(fmt, BlockFormat) and self.scales is None:  # a tensor without elements
            return torch.zeros(self.shape)
        if isinstance(fmt, BlockFormat):
            elements = _element_values(self.codes, fmt.element)
            scales = _float_decode(self.scales, fmt.scale_format)  # type: ignore[arg-type]
            if self.tensor_scale is not None:  # NVFP4: in the order the format's scale_math says
                divide = fmt.scale_math == "divide"
                scales = scales / self.tensor_scale if divide else scales * (1.0 / self.tensor_scale)
            return unblock(block_values(elements, scales), torch.Size(self.shape), self.axis, self.length)
        values = _element_values(self.codes, fmt)  # type: ignore[arg-type]
        if self.scales is None:
            return values.reshape(self.shape)
        return (values * (1.0 / self.scales)).reshape(self.shape)


def encode(
    x: torch.Tensor,
    fmt: str | Format,
    *,
    scaling: ScalingArg = None,
    rounding: Rounding | str = Rounding.NEAREST,
    overflow: Overflow | str = Overflow.SATURATE,
    flush_subnormals: bool = False,
    generator: torch.Generator | None = None,
) -> Encoded:
    """Like :func:`quantize`, but return the raw element codes and scales (see :class:`Encoded`).

    Supported scalings: none, tensor, row, column and delayed for element formats; block formats.
    """
    _check_args(x, rounding, overflow)
    spec = get_format(fmt)
    parsed, delayed = _resolve_scaling(scaling)
    xf = as_float32(x.detach(), spec)
    if not isinstance(spec, BlockFormat) and parsed is not None and parsed.kind == "block":
        raise ValueError(
            "encode does not support tile (block_shape) scaling of element formats; use quantize"
        )
    if xf.numel() == 0:  # no codes, no scales
        _check_layout(xf, spec, parsed)
        _share_empty_amax(xf, spec, parsed, delayed)
        element = spec.element if isinstance(spec, BlockFormat) else spec
        axis = _block_axis(spec, parsed) if isinstance(spec, BlockFormat) else -1
        return Encoded(spec, _element_codes(xf, element), None, None, tuple(x.shape), axis)
    if isinstance(spec, BlockFormat):
        axis = _block_axis(spec, parsed)
        parts = block_parts(xf, spec, axis, rounding, generator, _reduces(parsed), flush_subnormals)
        scale_codes = _float_codes(parts.stored, spec.scale_format).to(torch.uint8)
        return Encoded(
            spec,
            _element_codes(parts.elements, spec.element),
            scale_codes,
            parts.tensor_scale,
            tuple(x.shape),
            axis,
            parts.length,
        )
    if parsed is None:
        values = cast(xf, spec, rounding, overflow, flush_subnormals, generator)
        return Encoded(spec, _element_codes(values, spec), None, None, tuple(x.shape))
    scale = element_scale(xf, spec, parsed, delayed)
    values = cast(xf * scale, spec, rounding, overflow, flush_subnormals, generator)
    return Encoded(spec, _element_codes(values, spec), scale, None, tuple(x.shape))
