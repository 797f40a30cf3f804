"""Block arithmetic shared by the eager and compiled quantizers: a tensor as 2-D rows of blocks along one
axis, the shared scales of MX (E8M0, the OCP rule) and NVFP4 (E4M3 block scale under an fp32 tensor scale),
and the tiles of an element format's block scaling (1×128, 128×128)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from numscope.formats.cast import cast, cast_float
from numscope.formats.scaling import (
    FLOAT32_MAX,
    Scaling,
    exact_pow2,
    log2_floor,
    scale_from_amax,
)
from numscope.formats.scaling import tensor_amax as whole_tensor_amax  # block_parts_2d's argument is named so
from numscope.formats.spec import BlockFormat, FloatFormat, Format, IntFormat


def checked_axis(x: torch.Tensor, axis: int) -> int:
    """``axis`` as an index in ``0 .. x.dim() - 1`` (a scalar counts as one axis); ValueError if outside."""
    dim = max(x.dim(), 1)
    if not isinstance(axis, int) or isinstance(axis, bool) or not -dim <= axis < dim:
        raise ValueError(f"block axis {axis!r} is out of range for a tensor of shape {tuple(x.shape)}")
    return axis % dim


def axis_last_2d(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Size]:
    """``x`` with ``axis`` moved last and the other axes flattened: (rows, length), plus the moved shape."""
    axis = checked_axis(x, axis)
    if x.dim() == 0:
        x = x.reshape(1)
    moved = x.movedim(axis, -1)
    return moved.reshape(math.prod(moved.shape[:-1]), moved.shape[-1]), moved.shape


def unblock(blocks: torch.Tensor, shape: torch.Size, axis: int, length: int) -> torch.Tensor:
    flat = blocks.reshape(*blocks.shape[:-2], -1).narrow(-1, 0, length)
    if len(shape) == 0:
        return flat.reshape(shape)
    return flat.movedim(-1, axis)


@dataclass(frozen=True)
class BlockParts:
    """A block-format tensor taken apart: element values and per-block scales, blocks along the last axis."""

    elements: torch.Tensor  # float32 element values, (..., nblocks, block)
    scales: torch.Tensor  # float32 decode scale per block, (..., nblocks, 1)
    stored: torch.Tensor  # the scale as the scale format holds it (E8M0 X, or NVFP4's E4M3 s_b)
    tensor_scale: torch.Tensor | None  # NVFP4's per-tensor encode scale S
    length: int


def block_values(elements: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A block format's float32 values: elements times their block's decode scale, a product past float32's
    range saturated to ±FLT_MAX. An MX value can lie beyond float32: E4M3's 256 (a block amax of 3.4e38
    rounds up to it) under the scale 2^120 is 2^128. Block formats saturate, so a finite input never
    decodes to inf; the codes (:func:`numscope.encode`) stay the spec's. NaN (a block with a non-finite
    element has a NaN scale) stays NaN."""
    return (elements * scales).clamp_(-FLOAT32_MAX, FLOAT32_MAX)


def element_mantissa_bits(element: FloatFormat | IntFormat) -> int:
    """Significand bits below the leading one: a float's mantissa bits; an integer's bits less sign and
    leading bit (MXINT8's 1.xxxxxx·2^0 has 6)."""
    return element.mantissa_bits if isinstance(element, FloatFormat) else element.int_bits - 2


def _mx_shared_exponent(amax: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The unclamped exponent of the E8M0 scale of each block under ``fmt.scale_rule`` (int32).

    floor: floor(log2 amax) − emax; ceil: ceil(log2 amax) − emax; even: floor(log2 ρ(amax)) − emax, ρ
    rounding amax half up to the element's mantissa bits on its bit pattern (torchao's EVEN); rceil:
    ceil(log2(amax / max_elem)) on the float32 quotient, −127 where the quotient underflows to 0.
    """
    element = fmt.element
    if fmt.scale_rule == "rceil":
        ratio = amax / element.max
        below = log2_floor(ratio)
        shared = below + (exact_pow2(below) != ratio).to(torch.int32)  # ceil(log2 ratio)
        # an amax so small that amax / max underflows: the true exponent lies below -149, E8M0's floor
        return torch.where(ratio > 0, shared, torch.full_like(shared, -127))
    if fmt.scale_rule == "ceil":
        below = log2_floor(amax)
        return below + (exact_pow2(below) != amax).to(torch.int32) - element.emax
    if fmt.scale_rule == "even":
        half = 1 << (22 - element_mantissa_bits(element))
        rounded = ((amax.view(torch.int32) + half) & 0x7F800000).view(torch.float32)
        return log2_floor(rounded) - element.emax
    return log2_floor(amax) - element.emax


def _mx_parts(
    blocks: torch.Tensor, fmt: BlockFormat, rounding: str, generator, flush_subnormals: bool = False
) -> tuple[torch.Tensor, ...]:
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    shared = _mx_shared_exponent(amax, fmt).clamp(-127, 127)
    scale = exact_pow2(shared)
    elements = cast(
        blocks * exact_pow2(-shared), fmt.element, rounding, "saturate", flush_subnormals, generator
    )
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))
    return elements, scale, scale


def _nvfp4_candidate(
    blocks: torch.Tensor,
    amax: torch.Tensor,
    fmt: BlockFormat,
    encode_scale: torch.Tensor,
    target: float,
    rounding: str,
    generator,
    flush_subnormals: bool,
) -> tuple[torch.Tensor, ...]:
    """Elements, decode scale and stored E4M3 scale of NVFP4 blocks whose amax maps to ``target`` (6, or 4
    for Four Over Six), in the arithmetic order of ``fmt.scale_math`` (see :class:`BlockFormat`)."""
    element, scale_format = fmt.element, fmt.scale_format
    if fmt.scale_math == "divide":
        wanted = amax / target * encode_scale
    else:  # Transformer Engine: amax_b · (S · (1/6)); elements times 1 / (s_b · (1/S))
        inverse_target = torch.full((), 1.0 / target, dtype=torch.float32, device=blocks.device)
        wanted = amax * (encode_scale * inverse_target)
    stored = cast_float(wanted.clamp(max=FLOAT32_MAX), scale_format, "nearest", "saturate")  # type: ignore[arg-type]
    if fmt.scale_math == "divide":
        decode = stored / encode_scale
        safe = torch.where(decode > 0, decode, torch.ones_like(decode))
        scaled = blocks / safe
    else:
        decode = stored * (1.0 / encode_scale)
        scaled = blocks * torch.clamp(1.0 / decode, max=FLOAT32_MAX)
    elements = cast(scaled, element, rounding, "saturate", flush_subnormals, generator)
    elements = torch.where(stored > 0, elements, elements * 0.0)  # a block whose scale underflows: zeros
    decode = torch.where(torch.isfinite(amax), decode, torch.full_like(decode, float("nan")))
    return elements, decode, stored


def _nvfp4_parts(
    blocks: torch.Tensor,
    fmt: BlockFormat,
    encode_scale: torch.Tensor,
    rounding: str,
    generator,
    flush_subnormals: bool = False,
    amax: torch.Tensor | None = None,
    tile_rows: int = 1,
    tensor_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """NVFP4 block parts; ``amax``: each block's amax where it is not its own (2-D tiles); ``tile_rows``:
    rows that share a scale, over which Four Over Six sums a tile's error; ``tensor_amax``: the amax the
    tensor scale came from (TE's Four Over Six measures its errors with it)."""
    if amax is None:
        amax = blocks.abs().amax(dim=-1, keepdim=True)
    if fmt.four_over_six_mae:
        assert tensor_amax is not None
        return _te_four_over_six(
            blocks, amax, fmt, encode_scale, tensor_amax, rounding, generator, flush_subnormals, tile_rows
        )
    six = _nvfp4_candidate(blocks, amax, fmt, encode_scale, 6.0, rounding, generator, flush_subnormals)
    if not fmt.four_over_six:
        return six
    four = _nvfp4_candidate(blocks, amax, fmt, encode_scale, 4.0, rounding, generator, flush_subnormals)

    def error(candidate: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # in float64, so that the choice does not hang on float32's summation order
        squared = ((candidate[0] * candidate[1]).double() - blocks.double()).square().sum(-1, keepdim=True)
        if tile_rows == 1:
            return squared
        tiles = squared.reshape(-1, tile_rows, *squared.shape[1:]).sum(dim=1, keepdim=True)
        return tiles.expand(-1, tile_rows, *squared.shape[1:]).reshape(squared.shape)

    pick_four = error(four) < error(six)  # ties keep 6, the plain NVFP4 choice
    return tuple(torch.where(pick_four, f, s) for f, s in zip(four, six, strict=True))


def _te_four_over_six(
    blocks: torch.Tensor,
    amax: torch.Tensor,
    fmt: BlockFormat,
    encode_scale: torch.Tensor,
    tensor_amax: torch.Tensor,
    rounding: str,
    generator,
    flush_subnormals: bool,
    tile_rows: int,
) -> tuple[torch.Tensor, ...]:
    """Four Over Six as Transformer Engine's NVFP4 reference computes it (``nvfp4_4over6`` with
    ``nvfp4_4over6_err_mode='MAE'``, ``_quantize_blockwise_4over6_reference`` in
    transformer_engine/pytorch/custom_recipes/reference_nvfp4.py at d0067d0): the map-to-6 E4M3 scale is
    e4m3((amax_b / 6) · S), the map-to-4 one e4m3((amax_b / 6) · S · 1.5); each candidate's error is the sum
    over the block, element by element in float32, of |e · s_b · amax / (6 · 256) − v|; a 2-D tile sums its
    16 rows' errors in TE's tree order; ties keep 6."""
    element, scale_format = fmt.element, fmt.scale_format
    base = amax / 6.0 * encode_scale
    decode_global = 1.0 / encode_scale
    denom = torch.full((), 6.0 * 256.0, dtype=torch.float32, device=blocks.device)
    candidates, errors = [], []
    for factor in (1.5, 1.0):  # map to 4, map to 6
        wanted = base * factor if factor != 1.0 else base
        stored = cast_float(wanted.clamp(-448.0, 448.0), scale_format, "nearest", "saturate")
        scale = torch.clamp(1.0 / (stored * decode_global), max=FLOAT32_MAX)
        elements = cast(blocks * scale, element, rounding, "saturate", flush_subnormals, generator)
        error = torch.zeros_like(amax)  # TE's order: element by element, in float32
        for index in range(blocks.shape[-1]):
            value = elements.narrow(-1, index, 1) * stored * tensor_amax / denom
            error = error + (value - blocks.narrow(-1, index, 1)).abs()
        decode = stored * decode_global
        decode = torch.where(torch.isfinite(amax), decode, torch.full_like(decode, float("nan")))
        elements = torch.where(stored > 0, elements, elements * 0.0)  # as _nvfp4_candidate: same values
        candidates.append((elements, decode, stored))
        errors.append(error)
    four, six = errors
    if tile_rows > 1:  # TE's warp reduction over the tile's 16 rows: halves, quarters, ...
        tiles = []
        for err in (four, six):
            rows = err.reshape(-1, tile_rows, *err.shape[1:])
            width = tile_rows
            while width > 1:
                width //= 2
                rows = rows.narrow(1, 0, width) + rows.narrow(1, width, width)
            tiles.append(rows.expand(-1, tile_rows, *err.shape[1:]).reshape(err.shape))
        four, six = tiles
    pick_four = four < six
    return tuple(torch.where(pick_four, f, s) for f, s in zip(*candidates, strict=True))


def block_parts_2d(
    x: torch.Tensor,
    fmt: BlockFormat,
    tensor_amax: torch.Tensor | None,
    rounding: str,
    generator,
    flush_subnormals: bool = False,
) -> BlockParts:
    """Quantize a 2-D float32 tensor to ``fmt`` with blocks along its last axis (zero-padded to whole blocks).

    ``tensor_amax`` is NVFP4's amax of the whole tensor (already reduced across ranks); ignored for MX and
    for NVFP4 with a per-row scale (each row's own amax). 2-D NVFP4 blocks (``@2d``) are 16 × 16 tiles of
    ``x``: rows are zero-padded to whole tiles for the amax, and each row keeps its tile's scale.
    ``flush_subnormals`` flushes the elements as the element cast does, after the block scale: an element
    whose scaled value rounds below the element format's smallest normal becomes zero (integer elements
    have no subnormals: no effect).
    Shared by the eager path and the compiled fast path (:mod:`numscope.formats.fast`).
    """
    length = x.shape[-1]
    pad = (-length) % fmt.block_size
    if pad:
        x = F.pad(x, (0, pad))
    blocks = x.reshape(x.shape[0], -1, fmt.block_size)
    if not fmt.tensor_scale:
        elements, scales, stored = _mx_parts(blocks, fmt, rounding, generator, flush_subnormals)
        return BlockParts(elements, scales, stored, None, length)
    target = (256.0 if fmt.four_over_six else fmt.scale_format.max) * fmt.element.max
    if fmt.row_scale:
        encode_scale = scale_from_amax(blocks.abs().amax(dim=(-2, -1), keepdim=True), target)
    else:
        assert tensor_amax is not None
        encode_scale = scale_from_amax(tensor_amax, target)
        if fmt.nan_scale:  # TE: a NaN amax gives a NaN tensor scale, and every element NaN
            encode_scale = torch.where(torch.isnan(tensor_amax), tensor_amax, encode_scale)
    amax, tile_rows = None, fmt.block_rows
    rows = blocks.shape[0]
    if tile_rows > 1:  # one amax per tile of block_rows x block_size, repeated for each of its rows
        padded = F.pad(blocks, (0, 0, 0, 0, 0, (-rows) % tile_rows))
        tiles = padded.reshape(-1, tile_rows, *blocks.shape[1:]).abs().amax(dim=(1, -1), keepdim=True)
        amax = tiles.expand(-1, tile_rows, -1, -1).reshape(padded.shape[0], -1, 1)
        blocks = padded
    elements, scales, stored = _nvfp4_parts(
        blocks, fmt, encode_scale, rounding, generator, flush_subnormals, amax, tile_rows, tensor_amax
    )
    if tile_rows > 1:
        elements, scales, stored = (part.narrow(0, 0, rows) for part in (elements, scales, stored))
    return BlockParts(elements, scales, stored, encode_scale, length)


def block_parts(
    x: torch.Tensor,
    fmt: BlockFormat,
    axis: int,
    rounding: str,
    generator,
    reduce_amax: bool = True,
    flush_subnormals: bool = False,
) -> BlockParts:
    """Block parts of ``x`` with blocks along ``axis``, shaped (..., nblocks, block) with that axis last.

    reduce_amax: NVFP4's per-tensor amax is taken over the default process group (as ``Scaling``'s).
    """
    x2d, moved = axis_last_2d(x, axis)
    whole_amax = whole_tensor_amax(x, reduce=reduce_amax) if fmt.tensor_scale and not fmt.row_scale else None
    parts = block_parts_2d(x2d, fmt, whole_amax, rounding, generator, flush_subnormals)
    lead = tuple(moved[:-1])
    tensor_scale = parts.tensor_scale
    if fmt.row_scale:
        tensor_scale = tensor_scale.reshape(*lead, 1, 1)  # type: ignore[union-attr]
    return BlockParts(
        parts.elements.reshape(*lead, -1, fmt.block_size),
        parts.scales.reshape(*lead, -1, 1),
        parts.stored.reshape(*lead, -1, 1),
        tensor_scale,
        parts.length,
    )


def tile_shape(x: torch.Tensor, fmt: Format, scaling: Scaling) -> tuple[int, int]:
    """The (rows, columns) tile of an element format's block scaling, checked against ``x``'s rank."""
    if scaling.block_shape is None:
        raise ValueError(
            f"block scaling of the element format {fmt.name!r} needs block_shape, e.g. (1, 128) or (128, 128)"
        )
    block_shape = scaling.block_shape
    rows_per, cols_per = (1, block_shape[0]) if len(block_shape) == 1 else block_shape
    if x.dim() < 2 and rows_per != 1:
        raise ValueError(f"block_shape {block_shape} needs a tensor of >= 2 dims, got shape {tuple(x.shape)}")
    return rows_per, cols_per


def to_tiles(x: torch.Tensor, rows_per: int, cols_per: int) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """View float32 ``x`` as (..., rows/M, M, cols/N, N) tiles over its last two axes, zero-padded."""
    if x.dim() < 2:
        x = x.reshape(1, -1)
    rows, cols = x.shape[-2], x.shape[-1]
    pad_rows, pad_cols = (-rows) % rows_per, (-cols) % cols_per
    if pad_rows or pad_cols:
        x = F.pad(x, (0, pad_cols, 0, pad_rows))
    tiles = x.reshape(*x.shape[:-2], x.shape[-2] // rows_per, rows_per, x.shape[-1] // cols_per, cols_per)
    return tiles, (rows, cols, rows_per, cols_per)
