"""The fast path of :func:`numscope.quantize`: the eager reference, fused by ``torch.compile``.

Off by default; turn it on with :func:`set_fast` (``numscope.formats.set_fast(True)``) or the environment
variable ``NUMSCOPE_FAST=1``. It covers nearest rounding of element formats (no scaling, tensor, row,
column and delayed scaling) and of the block formats (MX, NVFP4); everything else (stochastic and
toward-zero rounding, tile scaling, ``e8m0``) runs eagerly.

The compiled kernels call the very functions the eager path calls (:func:`numscope.formats.cast.cast`,
the MX and NVFP4 block arithmetic), so they compute the same float32 operations; the tests check the
two agree bit for bit. Amaxes are taken by a compiled reduction, then reduced across ranks eagerly
(:func:`numscope.formats.scaling.reduce_amax_`), so distributed runs stay identical across ranks.

Each configuration (format, overflow rule, scaling kind) gets its own compiled function with dynamic
tensor sizes, so new shapes do not recompile; compiling one takes a few seconds of CPU (the
benchmark reports it). Tensors are flattened to two dimensions first, so that tensors of different
rank share one compiled kernel.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable
from typing import Any

import torch

from numscope.formats.cast import cast
from numscope.formats.spec import BlockFormat, FloatFormat, Format, IntFormat

_enabled = os.environ.get("NUMSCOPE_FAST", "0").strip().lower() not in ("", "0", "false", "no", "off")


def set_fast(enabled: bool) -> None:
    """Turn the ``torch.compile`` fast path of :func:`numscope.quantize` on or off (process-wide)."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_fast expects True or False, got {enabled!r}")
    _enabled = enabled


def fast_enabled() -> bool:
    """Whether :func:`numscope.quantize` uses the compiled fast path where it applies."""
    return _enabled


def supports(fmt: Format, scaling_kind: str | None, rounding: str) -> bool:
    """Whether the fast path covers this format, scaling kind (``None`` for no scaling) and rounding."""
    if rounding != "nearest":
        return False
    if isinstance(fmt, BlockFormat):
        return scaling_kind in (None, "block")
    if isinstance(fmt, FloatFormat) and fmt.special == "e8m0":
        return False
    return scaling_kind in (None, "tensor", "row", "column", "delayed")


def _own_copy(function: Callable[..., Any], tag: str, static: dict[str, Any]) -> Callable[..., Any]:
    """A copy of ``function`` with its own code object and ``static`` as its keyword-only defaults.

    ``torch.compile`` keeps one cache (with a recompile limit) per code object; one code object per
    configuration keeps many formats from evicting each other, and the configuration is a constant.
    """
    code = function.__code__.replace(co_name=f"{function.__name__}_{tag}")
    copy = types.FunctionType(code, function.__globals__, code.co_name)
    copy.__kwdefaults__ = dict(static)
    return copy


@functools.cache
def _compiled(kernel_name: str, **static: Any) -> Callable[..., torch.Tensor]:
    tag = f"{len(_COMPILED_TAGS)}"
    _COMPILED_TAGS.append((kernel_name, static))
    # emulate_precision_casts: keep x.to(bfloat16).float() a rounding (inductor drops it otherwise)
    return torch.compile(
        _own_copy(_KERNELS[kernel_name], tag, static), options={"emulate_precision_casts": True}
    )


def _dynamic(*tensors: torch.Tensor | None) -> None:
    """Mark every dimension dynamic, so that new shapes reuse the compiled kernel.

    (``dynamic=True`` would also make the formats' integer fields symbolic; marking only tensor sizes
    keeps those constants.)
    """
    for tensor in tensors:
        if tensor is not None:
            for dim in range(tensor.dim()):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)


def compiled_configurations() -> list[tuple[str, dict[str, Any]]]:
    """The (kernel, configuration) pairs compiled so far in this process (each one compiles once)."""
    return list(_COMPILED_TAGS)


_COMPILED_TAGS: list[tuple[str, dict[str, Any]]] = []


# -- kernels (plain tensor code; compiled per configuration) --------------------------------------------


def _abs_amax_kernel(x: torch.Tensor, *, mode: str) -> torch.Tensor:
    if mode == "tensor":
        return x.abs().amax()
    if mode == "row":
        return x.abs().amax(dim=-1, keepdim=True)
    return x.abs().amax(dim=0, keepdim=True)


def _element_kernel(
    x: torch.Tensor, scale: torch.Tensor | None, *, fmt: FloatFormat | IntFormat, overflow: str, flush: bool
) -> torch.Tensor:
    if scale is None:
        return cast(x, fmt, "nearest", overflow, flush)
    return cast(x * scale, fmt, "nearest", overflow, flush) * (1.0 / scale)


def _block_kernel(x: torch.Tensor, tensor_amax: torch.Tensor | None, *, fmt: BlockFormat) -> torch.Tensor:
    from numscope.formats.quantize import block_parts_2d

    parts = block_parts_2d(x, fmt, tensor_amax, "nearest", None)
    return (parts.elements * parts.scales).reshape(x.shape[0], -1)[:, : x.shape[1]]


_KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "amax": _abs_amax_kernel,
    "element": _element_kernel,
    "block": _block_kernel,
}


# -- entry points used by numscope.formats.quantize -------------------------------------------------------


def abs_amax(x: torch.Tensor, mode: str) -> torch.Tensor:
    """amax(|x|) of a 2-D float32 tensor: ``tensor`` (0-d), ``row`` (R, 1) or ``column`` (1, C)."""
    _dynamic(x)
    return _compiled("amax", mode=mode)(x)


def element(
    x: torch.Tensor, scale: torch.Tensor | None, fmt: FloatFormat | IntFormat, overflow: str, flush: bool
) -> torch.Tensor:
    """Nearest-rounded ``cast(x · scale) / scale`` of a 2-D float32 tensor (``scale`` broadcastable)."""
    _dynamic(x, scale)
    return _compiled("element", fmt=fmt, overflow=overflow, flush=flush)(x, scale)


def block(x: torch.Tensor, tensor_amax: torch.Tensor | None, fmt: BlockFormat) -> torch.Tensor:
    """A 2-D float32 tensor (blocks along its last axis) quantized to the block format ``fmt``."""
    _dynamic(x)
    return _compiled("block", fmt=fmt)(x, tensor_amax)
