"""Which quantizer computes a cast: one decision for :func:`numscope.quantize`, ``convert`` and the metrics.

Four paths give the same bits (the tests compare them bit for bit); they differ only in time and memory:

* ``native`` — :mod:`numscope.formats.native`, the small C library (on by default; ``NUMSCOPE_NATIVE=0``
  or :func:`numscope.formats.set_native` turns it off): nearest rounding of CPU float32 tensors to float
  and integer element formats (unscaled, per tensor, row, column, delayed, tiles) and to MX and plain NVFP4
  blocks; stochastic rounding to FP8/FP6/FP4 elements (from the eager path's own draw, inside its cast);
* ``dtype`` — torch's own conversion to ``float16``/``bfloat16``/``float8_*``, for a caller that keeps the
  codes in that dtype (``convert``'s operands): nearest rounding, no flushing, unscaled or one scale per
  tensor (current or delayed), as :mod:`numscope.formats.cast` rounds;
* ``compiled`` — :mod:`numscope.formats.fast`'s ``torch.compile`` kernels (off by default: ``compiled=``,
  :func:`numscope.formats.set_fast` or ``NUMSCOPE_FAST``): nearest rounding of every element format but
  E8M0 and of every block layout (2-D NVFP4 tiles and Four Over Six included);
* ``eager`` — the reference arithmetic, which covers everything (toward-zero rounding, stochastic rounding
  of formats with 8 exponent bits and of integers, E8M0).

:func:`quantizer_paths` gives the paths that may compute a :class:`Cast` of a tensor in the order to try
them: a later one takes what an earlier one turns out not to cover (the native code checks a tensor's
layout only when called), and the last always covers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from numscope.formats import fast, native
from numscope.formats.cast import native_dtype
from numscope.formats.spec import BlockFormat, FloatFormat, Format, IntFormat
from numscope.vocab import Overflow, Rounding, ScalingKind


class QuantizerPath(StrEnum):
    """One way of computing a cast; every path gives the same bits (see the module's docstring)."""

    NATIVE = "native"
    DTYPE = "dtype"
    COMPILED = "compiled"
    EAGER = "eager"


_PROPAGATING_CASTS = ("fp16", "bf16", "fp8_e5m2")
"""Formats whose torch conversion overflows to inf exactly as ``overflow="propagate"`` does."""


@dataclass(frozen=True)
class Cast:
    """What a quantizer is asked to do, without the tensor: the format, the kind of scaling (``None``,
    ``"tensor"``, ``"row"``, ``"column"``, ``"delayed"`` or ``"block"``: a block format's own blocks, or
    tiles of an element format), the rounding, the overflow rule and whether subnormals are flushed."""

    format: Format
    scaling: ScalingKind | None = None
    rounding: Rounding = Rounding.NEAREST
    overflow: Overflow = Overflow.SATURATE
    flush_subnormals: bool = False

    def __post_init__(self) -> None:  # names given as strings become the vocabulary's words
        if self.scaling is not None:
            object.__setattr__(self, "scaling", ScalingKind(self.scaling))
        object.__setattr__(self, "rounding", Rounding(self.rounding))
        object.__setattr__(self, "overflow", Overflow(self.overflow))

    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype whose conversion (with a clamp that leaves ±inf alone, for ``saturate``) equals
        this cast, where there is one: nearest rounding, no flushing, unscaled or one scale per tensor, a
        float format narrower than fp32 that torch has; ``propagate`` only for the formats whose torch
        conversion overflows to inf as that rule does (fp16, bf16, fp8_e5m2)."""
        fmt = self.format
        if self.rounding != "nearest" or self.flush_subnormals:
            return None
        if self.scaling not in (None, "tensor", "delayed"):
            return None
        if not isinstance(fmt, FloatFormat) or fmt.name == "fp32":
            return None
        if self.overflow == "propagate" and not (fmt.has_inf and fmt.name in _PROPAGATING_CASTS):
            return None
        if self.overflow not in ("saturate", "propagate"):
            return None
        return native_dtype(fmt)


def host_path(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the CPU's path: a CPU tensor with the native quantizers on.

    The CPU's path may read a value back to the host to save a pass over memory (the native code's own
    choices, a bound that lets a cast skip its clamp). Everywhere else (a GPU, or the CPU with
    :func:`numscope.formats.set_native` off) numscope takes the *device path*: torch operations and
    compiled kernels only, with no host synchronisation and no tensor on another device, and the same
    bits (the tests run the device path on the CPU and compare it with the CPU's path bit for bit)."""
    return x.device.type == "cpu" and native.native_enabled()


def compiled_wanted(compiled: bool | None) -> bool:
    """Whether the compiled kernels may be used: ``compiled`` where given, else as
    :func:`numscope.formats.set_fast` (``NUMSCOPE_FAST``) says."""
    return fast.fast_enabled() if compiled is None else compiled


def native_covers(cast: Cast, x: torch.Tensor) -> bool:
    """Whether the native quantizers are on and cover ``cast`` of ``x`` by format and tensor (a CPU float32
    tensor; for block formats, blocks of one row): the layout of a particular call is checked when made."""
    if cast.rounding != "nearest":
        return False
    fmt = cast.format
    if isinstance(fmt, BlockFormat):
        return cast.scaling in (None, "block") and native.covers_block(fmt, x)
    if cast.scaling not in (None, "tensor", "row", "column", "delayed"):
        return False
    return native.covers(fmt, cast.overflow, cast.flush_subnormals, x)  # type: ignore[arg-type]


def native_tiles(cast: Cast, x: torch.Tensor) -> bool:
    """Whether the native quantizers take ``cast``, tile scaling of an element format (TE's block recipe,
    DeepSeek-V3's 1×128 and 128×128 tiles), of ``x``: nearest rounding, a tensor of at least 2 dims."""
    fmt = cast.format
    return (
        cast.rounding == "nearest"
        and cast.scaling == "block"
        and isinstance(fmt, FloatFormat | IntFormat)
        and x.dim() >= 2
        and native.covers(fmt, cast.overflow, cast.flush_subnormals, x)
    )


def packs_block_codes(cast: Cast) -> bool:
    """Whether the native quantizers can keep a 2-D tensor in ``cast``'s block format as element and
    scale codes, quantized down its columns (``convert``'s wgrad inputs): MX and plain NVFP4 with float
    elements, nearest rounding, no flushing, the native code on."""
    fmt = cast.format
    return (
        isinstance(fmt, BlockFormat)
        and cast.rounding == "nearest"
        and not cast.flush_subnormals
        and native.native_enabled()
        and native.packs_columns(fmt)
    )


def quantizer_paths(
    cast: Cast, x: torch.Tensor, *, compiled: bool | None = None, codes: bool = False
) -> tuple[QuantizerPath, ...]:
    """The paths that may compute ``cast`` of ``x``, in the order to try them (see the module's docstring).

    compiled: whether the compiled kernels may be used (``None``: :func:`compiled_wanted`).
    codes: the caller keeps the result as codes in a torch dtype where the cast has one
        (:meth:`Cast.torch_dtype`) and the compiled kernels are not asked for: then the native code writes
        one-byte codes where it covers them, torch's conversion the rest.
    """
    use_compiled = compiled_wanted(compiled)
    covered = native_covers(cast, x)
    dtype = cast.torch_dtype() if codes and not use_compiled else None
    if dtype is not None:
        one_byte = dtype.itemsize == 1 and covered
        return (QuantizerPath.NATIVE, QuantizerPath.DTYPE) if one_byte else (QuantizerPath.DTYPE,)
    paths = [QuantizerPath.NATIVE] if covered else []
    if use_compiled and fast.supports(cast.format, cast.scaling, cast.rounding):
        paths.append(QuantizerPath.COMPILED)
    return (*paths, QuantizerPath.EAGER)
