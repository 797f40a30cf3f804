"""What a format does to a tensor: quantization error metrics (the backward error of a quantized GEMM is
:mod:`numscope.metrics.backward_error`).

Pure tensor functions (no modules, no I/O). ``x`` is the high-precision tensor, ``q`` what it becomes in
a format (``numscope.quantize``). Fractions are returned as fractions in [0, 1] by the functions named
``*_fraction``; :func:`operand_metrics` reports the same quantities in percent under keys ending in ``%``
(``underflow%``), as logs and tables show them.

Scaling arguments take what ``numscope.quantize`` takes, plus the default ``"auto"``: per-tensor current
scaling (``Scaling("tensor")``) for element formats, the format's own block scaling for block formats
(blocks along the last axis, or along the contraction axis in :func:`backward_error`). ``None`` means no
scaling at all, as in ``quantize``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from numscope.formats import native
from numscope.formats.blocks import block_parts_2d, block_values
from numscope.formats.cast import scale_then_cast
from numscope.formats.path import Cast, QuantizerPath, quantizer_paths
from numscope.formats.quantize import ScalingArg, quantize
from numscope.formats.scaling import DelayedScaler, Scaling, element_scale, tensor_amax
from numscope.formats.spec import BlockFormat, FloatFormat, Format, IntFormat, get_format

AUTO = "auto"
"""The default scaling: per-tensor current scaling for element formats, own blocks for block formats."""

ScalingChoice = ScalingArg | str


def _flat_pair(x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(x, torch.Tensor) or not isinstance(q, torch.Tensor):
        raise TypeError(f"expected two torch.Tensors, got {type(x).__name__} and {type(q).__name__}")
    if x.shape != q.shape:
        raise ValueError(f"x and q must have the same shape, got {tuple(x.shape)} and {tuple(q.shape)}")
    dtype = torch.float64 if torch.float64 in (x.dtype, q.dtype) else torch.float32
    return x.detach().reshape(-1).to(dtype), q.detach().reshape(-1).to(dtype)


def _sums(x: torch.Tensor, q: torch.Tensor) -> tuple[float, float, float, float]:
    """(Σx², Σ(x−q)², Σx·q, Σq²) computed on values divided by a common power of two (no overflow)."""
    x, q = _flat_pair(x, q)
    amax = float(torch.maximum(x.abs().max(), q.abs().max())) if x.numel() else 0.0
    if not math.isfinite(amax):
        raise ValueError("x and q must be finite (the error of an inf or NaN is undefined)")
    exponent = math.frexp(amax)[1] if amax > 0 else 0
    x, q = torch.ldexp(x, torch.tensor(-exponent)), torch.ldexp(q, torch.tensor(-exponent))
    error = x - q
    scale = 4.0**exponent
    return (
        float((x * x).sum()) * scale,
        float((error * error).sum()) * scale,
        float((x * q).sum()) * scale,
        float((q * q).sum()) * scale,
    )


def sqnr_db(x: torch.Tensor, q: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10·log10(Σx² / Σ(x−q)²), in dB; +inf when q equals x.

    −inf when x is all zero and q is not.
    """
    signal, noise, _, _ = _sums(x, q)
    return _sqnr(signal, noise)


def _sqnr(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def relative_error(x: torch.Tensor, q: torch.Tensor) -> float:
    """‖x − q‖₂ / ‖x‖₂ (dimensionless); 0 when q equals x, inf when x is all zero and q is not."""
    signal, noise, _, _ = _sums(x, q)
    return _relative(signal, noise)


def _relative(signal: float, noise: float) -> float:
    if noise == 0:
        return 0.0
    if signal == 0:
        return math.inf
    return math.sqrt(noise / signal)


def cosine_similarity(x: torch.Tensor, q: torch.Tensor) -> float:
    """x·q / (‖x‖‖q‖) over the flattened tensors; 1.0 when both are all zero, 0.0 when only one is."""
    signal, _, dot, power = _sums(x, q)
    return _cosine(signal, dot, power)


def _cosine(signal: float, dot: float, power: float) -> float:
    if signal == 0 or power == 0:
        return 1.0 if signal == power else 0.0
    return dot / math.sqrt(signal * power)


def underflow_fraction(x: torch.Tensor, q: torch.Tensor) -> float:
    """Fraction (0–1) of the nonzero finite elements of x that q holds as zero; 0.0 when x has none."""
    x, q = _flat_pair(x, q)
    nonzero = (x != 0) & torch.isfinite(x)
    count = int(nonzero.sum())
    if count == 0:
        return 0.0
    return int((nonzero & (q == 0)).sum()) / count


# -- quantization with the scaled values kept -----------------------------------------------------------


def resolve_scaling(spec: Format, scaling: ScalingChoice, axis: int) -> ScalingArg:
    """``scaling`` as ``quantize`` takes it for ``spec``: ``"auto"`` becomes per-tensor current scaling for an
    element format, blocks along ``axis`` for a block format (which refuses any other scaling)."""
    if isinstance(scaling, str) and scaling == AUTO:
        if isinstance(spec, BlockFormat):
            return Scaling("block", axis=axis)
        return Scaling("tensor")
    if isinstance(spec, BlockFormat) and not isinstance(scaling, DelayedScaler):
        parsed = Scaling.parse(scaling)  # type: ignore[arg-type]
        if parsed is not None and parsed.kind != "block":
            raise ValueError(
                f"block format {spec.name!r} brings its own block scaling; scaling {parsed.kind!r} "
                "does not apply (use scaling='auto' or Scaling('block', axis=...))"
            )
    return scaling  # type: ignore[return-value]


@dataclass(frozen=True)
class Blocked:
    """A block format's view of x: its blocks as the cast saw them (what :func:`quantize_kept` keeps)."""

    x: torch.Tensor  # x's blocks, (blocks, block) float32, each row zero-padded to whole blocks
    scales: torch.Tensor  # each block's decode scale, (blocks, 1): x / scales is what the cast sees

    def overflows(self, element: FloatFormat | IntFormat) -> torch.Tensor:
        """(blocks, block) bool: where the scaled finite element lies past the element format's max."""
        return _overflows(self.x / self.scales, element) & torch.isfinite(self.x)


@dataclass(frozen=True)
class Quantized:
    """A tensor quantized, with what the cast saw (see :func:`quantize_kept`)."""

    q: torch.Tensor  # what x becomes (float32, shape of x)
    scaled: torch.Tensor | None  # element formats: x in the format's units (what the cast sees), or None
    blocks: Blocked | None  # block formats (kept): the blocks and their scales
    spec: Format
    axis: int


def quantize_kept(
    x: torch.Tensor,
    spec: Format,
    scaling: ScalingArg,
    rounding: str,
    generator: torch.Generator | None,
    amax: torch.Tensor | float | None = None,
    keep: bool = True,
) -> Quantized:
    """Quantize ``x`` and keep what the cast saw, to tell rounding from overflow.

    ``q`` equals ``numscope.quantize(x, spec, scaling=...)`` bit for bit. ``amax``: the max|·| that
    per-tensor scales (and NVFP4's tensor scale) derive from, already reduced across ranks; ``None``: x's
    own, reduced as ``quantize`` reduces it. Block formats keep x's blocks and scales in the blocked layout
    (:class:`Blocked`), where the block metrics read them; ``keep=False`` skips that (only ``q`` is
    wanted).
    """
    delayed = scaling if isinstance(scaling, DelayedScaler) else None
    parsed = delayed.scaling if delayed is not None else Scaling.parse(scaling)  # type: ignore[arg-type]
    if parsed is not None and parsed.kind == "none":
        parsed = None
    axis = parsed.axis if parsed is not None else -1
    xf = x.detach().float()
    if isinstance(spec, BlockFormat):
        return _quantize_blocks(xf, spec, parsed, rounding, generator, amax, keep)
    if parsed is None:
        q = quantize(xf, spec, rounding=rounding, generator=generator)
        return Quantized(q, xf, None, spec, axis)
    if delayed is None and parsed.kind == "block":  # tile scaling: scales are not exposed
        q = quantize(xf, spec, scaling=scaling, rounding=rounding, generator=generator)
        return Quantized(q, None, None, spec, axis)
    # the sample's amax stands for the whole tensor's under per-tensor scaling only
    scale = element_scale(xf, spec, parsed, delayed, amax=amax if parsed.kind == "tensor" else None)
    native_first = quantizer_paths(Cast(spec, parsed.kind, rounding), xf, compiled=False)[0]
    q = _native_scaled_cast(xf, spec, scale) if native_first is QuantizerPath.NATIVE else None
    if q is not None:
        return Quantized(q, xf * scale, None, spec, axis)
    q, scaled = scale_then_cast(xf, spec, scale, rounding, generator=generator)
    return Quantized(q, scaled, None, spec, axis)


def _native_scaled_cast(
    xf: torch.Tensor, spec: FloatFormat | IntFormat, scale: torch.Tensor
) -> torch.Tensor | None:
    """``scale_then_cast``'s values (nearest, saturating) by the native quantizers, for a scale per tensor,
    per row (..., 1) or per column (1, ..., C), where they cover the format (the caller asked
    :func:`numscope.formats.path.quantizer_paths`); None where they do not cover this layout."""
    if xf.dim() == 0:
        return None
    x2d = xf.reshape(-1, xf.shape[-1])
    if scale.numel() == 1:
        q = native.element(x2d, spec, "saturate", False, scale.reshape(()), "tensor")
    elif scale.dim() == xf.dim() and scale.shape[-1] == 1:
        q = native.element(x2d, spec, "saturate", False, scale.reshape(-1, 1), "row")
    elif scale.dim() == xf.dim() and scale.numel() == xf.shape[-1]:
        q = native.element(x2d, spec, "saturate", False, scale.reshape(1, -1), "column")
    else:
        return None
    return None if q is None else q.reshape(xf.shape)


def _quantize_blocks(
    xf: torch.Tensor,
    spec: BlockFormat,
    parsed: Scaling | None,
    rounding: str,
    generator: torch.Generator | None,
    amax: torch.Tensor | float | None,
    keep: bool,
) -> Quantized:
    if parsed is not None and (parsed.kind != "block" or parsed.block_shape is not None):
        raise ValueError(
            f"block format {spec.name!r} brings its own block scaling of {spec.block_size}; use "
            "scaling='auto' or Scaling('block', axis=...) without block_shape"
        )
    axis = parsed.axis if parsed is not None else -1
    whole = xf.reshape(1) if xf.dim() == 0 else xf
    if not -whole.dim() <= axis < whole.dim():
        raise ValueError(f"block axis {axis!r} is out of range for a tensor of shape {tuple(xf.shape)}")
    moved = whole.movedim(axis, -1)
    length = moved.shape[-1]
    rows = moved.reshape(-1, length)
    whole_amax = tensor_amax(xf, amax) if spec.tensor_scale and not spec.row_scale else None
    padded = F.pad(rows, (0, (-length) % spec.block_size))
    # the native quantizers where they cover it (the same bits and scales as the block arithmetic)
    paths = quantizer_paths(Cast(spec, "block", rounding), padded, compiled=False)
    fast = native.block_with_scales(padded, spec, whole_amax) if paths[0] is QuantizerPath.NATIVE else None
    if fast is not None:
        values, scales = fast
    else:
        parts = block_parts_2d(rows, spec, whole_amax, rounding, generator)
        values, scales = block_values(parts.elements, parts.scales), parts.scales

    def back(blocked: torch.Tensor) -> torch.Tensor:
        flat = blocked.reshape(rows.shape[0], -1)[:, :length]
        return flat.reshape(moved.shape).movedim(-1, axis).reshape(xf.shape)

    q = back(values)
    if not keep:
        return Quantized(q, None, None, spec, axis)
    return Quantized(q, None, Blocked(padded.reshape(-1, spec.block_size), scales.reshape(-1, 1)), spec, axis)


def _overflows(scaled: torch.Tensor, element: FloatFormat | IntFormat) -> torch.Tensor:
    """Where nearest rounding would carry the scaled value past the element format's max."""
    if isinstance(element, IntFormat):
        threshold, tie_overflows = element.max + 0.5 * element.min_normal, True
    else:
        threshold, tie_overflows = element.overflow_threshold, element.max_mantissa_is_odd
    magnitude = scaled.abs()
    return magnitude >= threshold if tie_overflows else magnitude > threshold


def _element_of(spec: Format) -> FloatFormat | IntFormat:
    return spec.element if isinstance(spec, BlockFormat) else spec


def _overflow_of(x: torch.Tensor, kept: Quantized) -> float:
    finite = torch.isfinite(x)
    count = int(finite.sum())
    if count == 0:
        return 0.0
    if kept.blocks is not None:
        return int(kept.blocks.overflows(_element_of(kept.spec)).sum()) / count
    if kept.scaled is None:
        return math.nan
    return int((_overflows(kept.scaled, _element_of(kept.spec)) & finite).sum()) / count


def overflow_fraction(
    x: torch.Tensor, fmt: str | Format, *, scaling: ScalingChoice = AUTO, rounding: str = "nearest"
) -> float:
    """Fraction (0–1) of the finite elements of x that overflow ``fmt`` under ``scaling``.

    An element overflows when its scaled value |x·scale| lies beyond the format's overflow threshold (the
    midpoint between max and the next grid step; ties counted where round-to-even goes up): these are
    the values saturation clips to ±max and that ``overflow="propagate"`` turns into inf or NaN. With
    per-tensor current scaling nothing overflows; it matters without scaling, with delayed scaling and
    inside blocks (MX's floor scale rule lets a block's amax exceed the element max). NaN for tile
    scaling (``Scaling("block", block_shape=...)``) of element formats, whose scales are not exposed.
    """
    spec = get_format(fmt)
    kept = quantize_kept(x, spec, resolve_scaling(spec, scaling, -1), rounding, None)
    return _overflow_of(x, kept)


# -- block formats --------------------------------------------------------------------------------------


def _require_block(spec: Format) -> BlockFormat:
    if not isinstance(spec, BlockFormat):
        raise ValueError(
            f"{spec.name!r} is an element format; block metrics need a block format (mxfp8_e4m3, nvfp4, …)"
        )
    return spec


def _saturated_blocks_of(kept: Quantized) -> float:
    spec = _require_block(kept.spec)
    assert kept.blocks is not None
    over = kept.blocks.overflows(spec.element)
    return float(over.any(dim=-1).float().mean()) if over.shape[0] else 0.0


def saturated_block_fraction(x: torch.Tensor, fmt: str | Format, *, axis: int = -1) -> float:
    """Fraction (0–1) of the blocks of x (along ``axis``) in which some element overflows the block format.

    Overflow as in :func:`overflow_fraction`, measured on the element values after the block scale.
    """
    spec = _require_block(get_format(fmt))
    kept = quantize_kept(x, spec, Scaling("block", axis=axis), "nearest", None)
    return _saturated_blocks_of(kept)


@dataclass(frozen=True)
class BlockScaleSpread:
    """How far apart the block scales of a tensor lie.

    range_binades: max − min of log2(block scale) over the nonzero blocks, in binades.
    std_binades: standard deviation (population) of log2(block scale), in binades.
    blocks: nonzero blocks measured. flushed: nonzero blocks whose scale decoded to 0 (every element
    lost; NVFP4's E4M3 scale can underflow) or NaN (a non-finite element), left out of the spread.
    """

    range_binades: float
    std_binades: float
    blocks: int
    flushed: int

    @property
    def flushed_fraction(self) -> float:
        """Fraction (0–1) of the nonzero blocks that were flushed."""
        total = self.blocks + self.flushed
        return self.flushed / total if total else 0.0


def _spread_of(kept: Quantized) -> BlockScaleSpread:
    _require_block(kept.spec)
    assert kept.blocks is not None
    amax = kept.blocks.x.abs().amax(dim=-1)
    scale = kept.blocks.scales[:, 0]
    nonzero = amax > 0
    usable = nonzero & (scale > 0) & torch.isfinite(scale)
    count = int(usable.sum())
    flushed = int(nonzero.sum()) - count
    if count == 0:
        return BlockScaleSpread(0.0, 0.0, 0, flushed)
    exponents = torch.log2(scale[usable].double())
    return BlockScaleSpread(
        float(exponents.max() - exponents.min()), float(exponents.std(correction=0)), count, flushed
    )


def block_scale_spread(x: torch.Tensor, fmt: str | Format, *, axis: int = -1) -> BlockScaleSpread:
    """The spread of the decode scales of a block format over the blocks of x along ``axis``."""
    spec = _require_block(get_format(fmt))
    kept = quantize_kept(x, spec, Scaling("block", axis=axis), "nearest", None)
    return _spread_of(kept)


def operand_metrics(
    x: torch.Tensor,
    fmt: str | Format,
    scaling: ScalingChoice = AUTO,
    *,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    amax: torch.Tensor | float | None = None,
) -> dict[str, float]:
    """Every quantization metric of ``x`` in ``fmt`` from one quantization, keyed by legible names.

    Keys: ``sqnr_db`` (dB), ``rel_error``, ``cosine``, ``mse`` (units of x²), ``underflow%``, ``overflow%``;
    for block formats also ``saturated_blocks%``, ``flushed_blocks%`` and ``block_scale_range`` /
    ``block_scale_std`` (binades; see :class:`BlockScaleSpread`). Percentages are of the finite elements
    (of the nonzero ones for underflow, of the blocks for the block keys). Non-finite elements of x are
    set to zero first (count them with ``tensor_stats``'s ``nonfinite%``). A :class:`DelayedScaler`
    passed as ``scaling`` records this tensor's amax, as it would in training. ``amax``: see
    :func:`candidate_metrics`.
    """
    return candidate_metrics(x, {"": (fmt, scaling)}, rounding=rounding, generator=generator, amax=amax)[""]


def candidate_metrics(
    x: torch.Tensor,
    candidates: Mapping[str, tuple[str | Format, ScalingChoice]],
    *,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    amax: torch.Tensor | float | None = None,
) -> dict[str, dict[str, float]]:
    """:func:`operand_metrics` of ``x`` for several candidates at once: label → (format, scaling).

    The same numbers as one ``operand_metrics`` call per candidate, computed in a few batched reductions
    over all candidates and brought to the host in one transfer (what an observer measuring many formats
    on every operand needs).

    amax: for ``x`` a sample of a larger tensor, that tensor's max|·| (already reduced across ranks): per-
    tensor scales and NVFP4's tensor scale derive from it, as they would when the whole tensor is
    quantized, so the metrics of the sample estimate the whole tensor's without bias. ``None``: x's own
    max|·|, reduced across ranks as :func:`numscope.quantize` reduces it.
    """
    clean = finite_or_zero(x)
    kept: dict[str, Quantized] = {}
    for label, (fmt, scaling) in candidates.items():
        spec = get_format(fmt)
        kept[label] = quantize_kept(
            clean, spec, resolve_scaling(spec, scaling, -1), rounding, generator, amax
        )
    return metrics_of_quantized(clean, kept)


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached with its non-finite elements set to zero (what the metrics measure)."""
    return torch.nan_to_num(x.detach(), nan=0.0, posinf=0.0, neginf=0.0)


def metrics_of_quantized(clean: torch.Tensor, kept: Mapping[str, Quantized]) -> dict[str, dict[str, float]]:
    """The metrics of :func:`candidate_metrics` from quantizations already made with
    :func:`quantize_kept` (``keep=True``) of ``clean`` (finite: see :func:`finite_or_zero`)."""
    if not kept:
        return {}
    count = max(clean.numel(), 1)
    labels = list(kept)
    # float64 sums of float32 values: products exact, no overflow, 1 − cosine resolved near 1
    values = clean.reshape(-1).double()
    quantized = values.new_empty((len(labels), values.numel()))
    for row, label in zip(quantized, labels, strict=True):
        row.copy_(kept[label].q.reshape(-1))
    parts = [
        (values @ values).reshape(1),
        torch.count_nonzero(values).reshape(1),
        torch.linalg.vector_norm(quantized - values, dim=1) ** 2,
        quantized @ values,
        torch.linalg.vector_norm(quantized, dim=1) ** 2,
        torch.count_nonzero(quantized, dim=1),  # zero stays zero: the underflows are nnz(x) − nnz(q)
    ]
    block_labels = [label for label in labels if isinstance(kept[label].spec, BlockFormat)]
    summaries = {label: _block_summary(kept[label]) for label in block_labels}  # overflow count first
    for label in labels:
        item = kept[label]
        if label in summaries:
            parts.append(summaries[label][:1])
        elif item.scaled is None:
            parts.append(values.new_full((1,), math.nan))
        else:
            parts.append(torch.count_nonzero(_overflows(item.scaled, _element_of(item.spec))).reshape(1))
    parts.extend(summaries[label][1:] for label in block_labels)
    numbers = torch.cat(parts).tolist()  # one host transfer (cat promotes the counts to float64)
    signal, nonzeros = numbers[0], numbers[1]
    size = len(labels)
    noise, dot, power, nonzero_q, overflows = (numbers[2 + i * size : 2 + (i + 1) * size] for i in range(5))
    out: dict[str, dict[str, float]] = {}
    for index, label in enumerate(labels):
        noise_value, dot_value, power_value = noise[index], dot[index], power[index]
        out[label] = {
            "sqnr_db": _sqnr(signal, noise_value),
            "rel_error": _relative(signal, noise_value),
            "cosine": _cosine(signal, dot_value, power_value),
            "mse": noise_value / count,
            "underflow%": 100.0 * (nonzeros - nonzero_q[index]) / nonzeros if nonzeros else 0.0,
            "overflow%": 100.0 * overflows[index] / clean.numel() if clean.numel() else 0.0,
        }
    offset = 2 + 5 * size
    for label in block_labels:
        saturated, usable, flushed, high, low, _, variance = numbers[offset : offset + 7]
        offset += 7
        total = usable + flushed
        spread_range = high - low if usable else 0.0
        spread_std = math.sqrt(variance) if usable else 0.0
        out[label].update(
            {
                "saturated_blocks%": 100.0 * saturated,
                "flushed_blocks%": 100.0 * flushed / total if total else 0.0,
                "block_scale_range": spread_range,
                "block_scale_std": spread_std,
            }
        )
    return out


def _block_summary(kept: Quantized) -> torch.Tensor:
    """(overflowing elements, saturated fraction, usable blocks, flushed blocks, max, min, mean and
    variance of log2 scale) as one float64 tensor, without host transfers (see :func:`overflow_fraction`,
    :func:`saturated_block_fraction`, :class:`BlockScaleSpread`), read in the blocked layout."""
    spec = _require_block(kept.spec)
    blocks = kept.blocks
    assert blocks is not None
    if blocks.x.numel() == 0:
        return torch.zeros(8, dtype=torch.float64, device=blocks.x.device)
    over = blocks.overflows(spec.element)
    saturated = over.any(dim=-1).double().mean()
    amax = blocks.x.abs().amax(dim=-1)
    scale = blocks.scales[:, 0].double()
    nonzero = amax > 0
    usable = nonzero & (scale > 0) & torch.isfinite(scale)
    exponents = torch.log2(torch.where(usable, scale, torch.ones_like(scale)))
    count = usable.sum()
    divisor = count.clamp_min(1).double()
    mean = exponents.sum() / divisor  # zeros where not usable
    centred = torch.where(usable, exponents - mean, torch.zeros_like(exponents))
    variance = (centred * centred).sum() / divisor
    high = torch.where(usable, exponents, torch.full_like(exponents, -math.inf)).amax()
    low = torch.where(usable, exponents, torch.full_like(exponents, math.inf)).amin()
    return torch.stack(
        [
            over.sum().double(),
            saturated,
            count.double(),
            (nonzero.sum() - count).double(),
            high,
            low,
            mean,
            variance,
        ]
    )


def quantize_sample(
    x: torch.Tensor,
    fmt: str | Format,
    scaling: ScalingChoice = AUTO,
    *,
    amax: torch.Tensor | float | None = None,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``x`` quantized as ``numscope.quantize`` would, except that per-tensor scales (and NVFP4's tensor
    scale) derive from ``amax``: for ``x`` a sample (rows, blocks) of a larger tensor whose max|·| is
    ``amax``, the sample is quantized exactly as it is inside the whole tensor. Block formats need whole
    blocks along the scaling's axis (``"auto"``: the last)."""
    spec = get_format(fmt)
    kept = quantize_kept(x, spec, resolve_scaling(spec, scaling, -1), rounding, generator, amax, keep=False)
    return kept.q.to(x.dtype)
