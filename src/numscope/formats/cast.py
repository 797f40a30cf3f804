"""Exact element casts: float32 in, float32 out, every output value one the element format holds.

Rules (the same for every element format):

* ``rounding="nearest"``: round to nearest, ties to even (IEEE 754 default).
* ``rounding="nearest_away"``: round to nearest, ties away from zero (IEEE 754's roundTiesToAway, what
  microxcaling calls "nearest").
* ``rounding="zero"``: truncate toward zero; a finite overflow gives ±max (IEEE 754's rule for this mode).
* ``rounding="stochastic"``: round up with probability equal to the distance from the lower grid point
  in units of the local spacing, so that E[q(x)] = x inside the range; reproducible with a generator.
* ``overflow="saturate"``: finite values beyond ±max become ±max.
  ``overflow="propagate"``: the format's own result — ±inf where it has inf, NaN where it has NaN but no
  inf, ±max where it has neither. With nearest rounding this is bit for bit the cast of ``ml_dtypes``.
* Non-finite inputs are never saturated: NaN stays NaN; ±inf becomes ±inf where the format has inf, NaN
  where it only has NaN, ±max where it has neither (FP6, FP4, integers).
* ``flush_subnormals=True``: results below the smallest normal become zero (sign kept where the format
  has −0).
* Formats without −0 (fnuz) return +0 for every zero.

Computation is in float32 with power-of-two scalings only, so it is exact: the spacing 2^(e−m) of the
binade that holds |x| is built from the exponent bits of x.
"""

from __future__ import annotations

import torch

from numscope._compat import COMPILED_ROUND_TRIPS
from numscope.formats.spec import FloatFormat, IntFormat
from numscope.vocab import Overflow, Rounding

ROUNDINGS: tuple[str, ...] = tuple(rounding.value for rounding in Rounding)
OVERFLOWS: tuple[str, ...] = tuple(overflow.value for overflow in Overflow)

NATIVE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_e4m3fnuz": torch.float8_e4m3fnuz,
    "fp8_e5m2fnuz": torch.float8_e5m2fnuz,
}


def native_dtype(fmt: FloatFormat) -> torch.dtype | None:
    """The torch dtype that stores ``fmt`` exactly, if torch has one."""
    return NATIVE_DTYPES.get(fmt.name)


_STOCHASTIC: list = []
"""The native stochastic rounding of small float formats, registered by :mod:`numscope.formats.native`
(which imports this module): ``kernel(x, draw, fmt, overflow, flush)`` → the tensor, or None before
calling ``draw`` (which returns the uniform noise) where it does not cover the call."""


def register_stochastic(kernel) -> None:
    """Let :func:`cast_float` round stochastically through ``kernel`` (the same bits, given the same draw)."""
    _STOCHASTIC[:] = [kernel]


def _drawn_on(x: torch.Tensor, generator: torch.Generator | None) -> torch.device:
    """Where stochastic rounding draws for ``x``: the generator's device (a CPU generator gives the same
    bits for the same seed whatever device ``x`` is on: drawn on the CPU and copied), else ``x``'s own
    (its device's default generator)."""
    return x.device if generator is None else generator.device


def _uniform_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    where = _drawn_on(x, generator)
    return torch.rand(x.shape, generator=generator, dtype=torch.float32, device=where).to(x.device)


def _random_bits(x: torch.Tensor, bits: int, generator: torch.Generator | None) -> torch.Tensor:
    """Uniform int32 integers in [0, 2^bits) shaped as ``x``, on ``x``'s device (see :func:`_drawn_on`)."""
    where = _drawn_on(x, generator)
    return torch.randint(0, 1 << bits, x.shape, generator=generator, dtype=torch.int32, device=where).to(
        x.device
    )


def _round_scaled(t: torch.Tensor, rounding: str, generator: torch.Generator | None) -> torch.Tensor:
    """Round values already expressed in units of their grid spacing to integers."""
    if rounding == "nearest":
        return torch.round(t)
    if rounding == "nearest_away":
        # not floor(|t| + 0.5): that sum rounds up for the largest float32 below a midpoint (0.49999997 + 0.5
        # is 1.0 in float32); |t| - trunc(|t|) is exact, so comparing it with 0.5 decides the tie exactly
        magnitude = t.abs()
        whole = torch.trunc(magnitude)
        return torch.copysign(whole + (magnitude - whole >= 0.5).to(t.dtype), t)
    if rounding == "zero":
        return torch.trunc(t)
    return torch.floor(t + _uniform_like(t, generator))


def _grid_e8(
    x: torch.Tensor, mantissa_bits: int, rounding: str, generator: torch.Generator | None
) -> torch.Tensor:
    """Round finite float32 to an 8-exponent-bit IEEE-like format (bf16, tf32, e8mY) on the bit pattern.

    Such a format shares float32's exponent range, so dropping the low 23 − m bits of the pattern rounds
    normals and subnormals alike; a carry into the exponent field gives the next binade or inf.
    """
    drop = 23 - mantissa_bits
    if drop == 0:
        return x
    bits = x.view(torch.int32)
    magnitude = bits & 0x7FFFFFFF
    sign = bits & ~0x7FFFFFFF
    if rounding == "nearest":
        half = (1 << (drop - 1)) - 1
        magnitude = magnitude + half + ((magnitude >> drop) & 1)
    elif rounding == "nearest_away":
        magnitude = magnitude + (1 << (drop - 1))
    elif rounding == "stochastic":
        magnitude = magnitude + _random_bits(x, drop, generator)
    magnitude = magnitude & ~((1 << drop) - 1)
    return (sign | magnitude).view(torch.float32)


def _grid_small(
    x: torch.Tensor, fmt: FloatFormat, rounding: str, generator: torch.Generator | None
) -> torch.Tensor:
    """Round finite float32 to a float format with fewer than 8 exponent bits, ignoring its max.

    The spacing's exponent is capped at 126: ``inverse`` is built from an exponent field, and 2^-127 (the
    inverse of a spacing 2^127, which a format without mantissa bits would give |x| >= 2^127) is a float32
    subnormal that field cannot hold (it would read 0 and round every such x to 0). Only |x| >= 2^127
    reaches the cap, far beyond the max of any format here (< 2^64), so a finer spacing changes nothing:
    the result still lies beyond max and overflows as it must.
    """
    exponent = ((x.view(torch.int32) >> 23) & 0xFF) - 127  # floor(log2|x|) for normal x; -127 for 0/subnormal
    exponent = torch.clamp(exponent, min=fmt.emin) - fmt.mantissa_bits  # exponent of the local spacing
    exponent = torch.clamp(exponent, max=126)  # keeps inverse a normal float32 (mantissa_bits == 0)
    spacing = ((exponent + 127) << 23).view(torch.float32)
    inverse = ((127 - exponent) << 23).view(torch.float32)
    return _round_scaled(x * inverse, rounding, generator) * spacing


def _e8m0(
    x: torch.Tensor, rounding: str, generator: torch.Generator | None, overflow: str = "saturate"
) -> torch.Tensor:
    """Round to E8M0 (powers of two 2^-127..2^127). Zero, negative and non-finite inputs give NaN; a
    finite value that rounds past 2^127 gives 2^127 under ``overflow="saturate"``, NaN (the format's only
    special, as ``ml_dtypes``) under ``"propagate"``.

    The OCP MX v1.0 spec defines E8M0 (bias 127, exponents -127..127, 0xFF NaN, no zero, no inf) but no
    rule for rounding an arbitrary float to it: its MX scale is built from an exponent
    (2^(floor(log2 amax) - emax_elem)), never rounded from a value. numscope's rule for the ``e8m0``
    element format is therefore plain round-to-nearest by value with ties upward, the same in every
    binade: x in [2^k, 2^(k+1)) goes up from 1.5 * 2^k on. E8M0's field has float32's bias, so for
    normal float32 that is adding half the mantissa range to the bit pattern. Below 2^-126 float32 is
    subnormal and 2^-127 (field 0) is the mantissa 0x400000, so the midpoint to 2^-126 is 0x600000;
    everything below 2^-127 gives 2^-127 (there is no zero). This is ``ml_dtypes`` >= 0.7.0's cast;
    0.6.0 rounded every value strictly between 2^-127 and 1.5 * 2^-127 up to 2^-126, which is not
    nearest (``tests/formats/test_formats_exact.py`` checks both the rule and ml_dtypes).
    Stochastic rounding there rounds up with probability (x - 2^-127) / 2^-127.
    """
    bits = x.view(torch.int32)
    subnormal = (bits > 0) & (bits < 0x800000)
    if rounding in ("nearest", "nearest_away"):  # ties go up: away from zero too
        bits = bits + 0x400000 - (subnormal.to(torch.int32) << 21)  # half a binade; 0x200000 below 2^-126
    elif rounding == "stochastic":
        noise = _random_bits(x, 23, generator)
        above = ((bits - 0x400000) * 2).clamp(min=0)  # the position between 2^-127 and 2^-126, in 2^-23 units
        bits = torch.where(subnormal, above, bits) + noise
    field = bits >> 23
    field = field.clamp(min=0)
    result = (field.clamp(min=1, max=254) << 23).view(torch.float32)
    result = torch.where(field == 0, torch.full_like(result, 2.0**-127), result)
    invalid = (x <= 0) | torch.logical_not(torch.isfinite(x))
    if overflow != "saturate":
        invalid = invalid | (field >= 255)  # else clamped to 254 above: 2^127
    return torch.where(invalid, torch.full_like(result, float("nan")), result)


def _is_inf(x: torch.Tensor) -> torch.Tensor:
    """``torch.isinf``; under ``torch.compile`` written as a comparison, which inductor vectorizes."""
    return x.abs() == float("inf") if torch.compiler.is_compiling() else torch.isinf(x)


def _is_finite(x: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite``; under ``torch.compile`` written as a comparison (NaN compares false)."""
    return x.abs() < float("inf") if torch.compiler.is_compiling() else torch.isfinite(x)


def _is_nan(x: torch.Tensor) -> torch.Tensor:
    """``torch.isnan``; under ``torch.compile`` written as a comparison."""
    return x != x if torch.compiler.is_compiling() else torch.isnan(x)


def native_nearest(x: torch.Tensor, fmt: FloatFormat, dtype: torch.dtype, overflow: str) -> torch.Tensor:
    """Nearest rounding of float32 ``x`` via torch's own cast to ``dtype``, fixed up to the module's rules.

    Torch's casts round to nearest even exactly (subnormals included) and agree with ``ml_dtypes`` inside
    the range; they differ beyond it: torch saturates E4M3FN, even ±inf to ±448. Saturation is therefore
    done by clamping first (which also sends ±inf to ±max, so infinities are restored afterwards) and the
    E4M3FN overflow of ``propagate`` is set to NaN explicitly. Written in plain tensor ops so that
    ``torch.compile`` fuses it (see :mod:`numscope.formats.fast`).
    """
    if overflow == "saturate":
        y = x.clamp(-fmt.max, fmt.max).to(dtype).float()
        return torch.where(_is_inf(x), x if fmt.has_inf else torch.full_like(x, float("nan")), y)
    y = x.to(dtype).float()
    if fmt.special == "fn":
        y = torch.where(x.abs() > fmt.overflow_threshold, torch.full_like(y, float("nan")), y)
    return y


def cast_float(
    x: torch.Tensor,
    fmt: FloatFormat,
    rounding: str = "nearest",
    overflow: str = "saturate",
    flush_subnormals: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Return float32 ``x`` rounded to ``fmt`` (see the module docstring for the rules)."""
    if fmt.special == "e8m0":
        return _e8m0(x, rounding, generator, overflow)
    if fmt.name == "fp32":
        return x.clone()
    dtype = native_dtype(fmt)
    # Compiled, the grid arithmetic below is cheaper than torch's vectorized fp8 conversion (the same
    # values: both round to nearest even exactly); fp16 and bf16 conversions are single instructions, where
    # inductor keeps them (numscope._compat.COMPILED_ROUND_TRIPS)
    grid_compiled = torch.compiler.is_compiling() and (fmt.bits == 8 or not COMPILED_ROUND_TRIPS)
    if dtype is not None and rounding == "nearest" and not flush_subnormals and not grid_compiled:
        return native_nearest(x, fmt, dtype, overflow)
    if (
        rounding == "stochastic"
        and fmt.exponent_bits < 8
        and _STOCHASTIC
        and not torch.compiler.is_compiling()
    ):
        # the draw _grid_small would take, in the same order: the same bits in one pass of C
        done = _STOCHASTIC[0](x, lambda: _uniform_like(x, generator), fmt, overflow, flush_subnormals)
        if done is not None:
            return done
    finite = _is_finite(x)
    safe = torch.where(finite, x, torch.zeros_like(x))
    if fmt.exponent_bits == 8:
        y = _grid_e8(safe, fmt.mantissa_bits, rounding, generator)
    else:
        y = _grid_small(safe, fmt, rounding, generator)
    limit = fmt.max
    beyond = y.abs() > limit
    if overflow == "saturate" or rounding == "zero" or not (fmt.has_inf or fmt.has_nan):
        y = torch.where(beyond, torch.copysign(torch.full_like(y, limit), y), y)
    elif fmt.has_inf:
        y = torch.where(beyond, torch.copysign(torch.full_like(y, float("inf")), y), y)
    else:
        y = torch.where(beyond, torch.full_like(y, float("nan")), y)
    if flush_subnormals:
        y = torch.where(y.abs() < fmt.min_normal, y * 0.0, y)
    if not fmt.has_negative_zero:
        y = y + 0.0  # -0 + 0 = +0 under round-to-nearest
    if fmt.has_inf:
        nonfinite = x
    elif fmt.has_nan:
        nonfinite = torch.full_like(x, float("nan"))
    else:
        nonfinite = torch.where(_is_nan(x), x, torch.copysign(torch.full_like(x, limit), x))
    return torch.where(finite, y, nonfinite)


def cast_int(
    x: torch.Tensor,
    fmt: IntFormat,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Round float32 ``x`` to the symmetric integer grid of ``fmt`` (scaled by 2^-fraction_bits), saturating.

    Integers have no inf or NaN: ±inf saturate to ±max (to the most negative code with ``full_range``) and
    NaN stays NaN in the float32 result (it has no code; :func:`numscope.encode` rejects it). Nor have they
    −0: a negative value that rounds to zero gives +0, as decoding its code does.
    """
    t = x * float(2**fmt.fraction_bits)
    code = _round_scaled(t, rounding, generator).clamp(fmt.min_code, fmt.max_code)
    code = torch.where(code == 0, torch.zeros_like(code), code)  # the codes have no -0
    return code * float(2.0**-fmt.fraction_bits)


def cast(
    x: torch.Tensor,
    fmt: FloatFormat | IntFormat,
    rounding: str = "nearest",
    overflow: str = "saturate",
    flush_subnormals: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Cast float32 ``x`` to an element format; returns float32 values the format holds exactly."""
    if isinstance(fmt, IntFormat):
        return cast_int(x, fmt, rounding, generator)
    return cast_float(x, fmt, rounding, overflow, flush_subnormals, generator)


def scale_then_cast(
    x: torch.Tensor,
    fmt: FloatFormat | IntFormat,
    scale: torch.Tensor,
    rounding: str = "nearest",
    overflow: str = "saturate",
    flush_subnormals: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cast(x · scale) · (1 / scale)``, and ``x · scale`` (what the cast saw, where overflow and rounding
    are told apart): the arithmetic of every scaled quantization to an element format here."""
    scaled = x * scale
    return cast(scaled, fmt, rounding, overflow, flush_subnormals, generator) * (1.0 / scale), scaled
