"""The fast paths of :func:`numscope.quantize`: native quantizers first, then the eager reference fused
by ``torch.compile``.

**Native quantizers** (:mod:`numscope.formats.native`, on by default): a small C library, built once per
machine on first use, that computes the eager path's float32 arithmetic element by element, vectorized
by the C compiler. Every entry point here tries it first; :func:`numscope.quantize` uses it by default
wherever it covers a call (nearest rounding of float and integer element formats, unscaled or per tensor,
row, column or delayed; MX blocks; plain NVFP4), because it costs no compilation and returns the same
bits. ``NUMSCOPE_NATIVE=0`` or :func:`numscope.formats.set_native` turns it off.

**Compiled kernels** (``torch.compile``): off by default; turn them on with :func:`set_fast`
(``numscope.formats.set_fast(True)``), ``NUMSCOPE_FAST=1`` or ``quantize(..., compiled=True)``. They cover
nearest rounding of element formats (no scaling, tensor, row, column and delayed scaling) and of the
block formats (MX, NVFP4, also 2-D tiles and Four Over Six, which the native code leaves to them);
everything else (stochastic and toward-zero rounding, tile scaling, ``e8m0``) runs eagerly. With the
native quantizers in front they only take what those do not cover.

Why off by default: the results are the same bits either way, so the choice is only about time, and the
first call of each configuration compiles: seconds per configuration (less from inductor's on-disk cache),
after a one-time inductor set-up per machine; ``benchmarks/bench_quantize.py`` reports each fast row's
first call, compile included. It also needs a C++ compiler at run time. Inductor's CPU code for the bit
reinterpretations the casts need (``Tensor.view(torch.int32)``) moves vector lanes one by one through
memory, which is why the native code is faster on every format it covers.

The compiled kernels call the very functions the eager path calls (:func:`numscope.formats.cast.cast`,
:func:`numscope.formats.scaling.scale_from_amax`, the MX and NVFP4 block arithmetic), so they compute the
same float32 operations; the tests check the two agree bit for bit. One compiled function does the whole
job of one call: the amax reduction, the scale and the cast, so a per-tensor scaled cast is two passes
over memory (amax, then cast) and a block format one pass (each block's amax is taken where its elements
are cast). Only where an amax must first be reduced across ``torch.distributed`` ranks is it taken by its
own compiled reduction and reduced eagerly (:func:`numscope.formats.scaling.reduce_amax_`), so that every
rank quantizes identically.

Each configuration (format, overflow rule, scaling) gets its own compiled function with dynamic tensor
sizes, so new shapes do not recompile (only sizes 1 are specialised; block formats see whole blocks, padded
before the kernel). Compiling one takes seconds of CPU (the benchmark
reports the first call). Tensors are flattened to two dimensions first, so that tensors of different rank
share one compiled kernel. Should compiling fail (no C++ compiler, say), the configuration warns once and
runs the same kernel eagerly, with the same results; any other error (one in the kernel's own code, an
interrupt) propagates.
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from numscope.formats import native
from numscope.formats.blocks import block_parts_2d, block_values
from numscope.formats.cast import cast, scale_then_cast
from numscope.formats.scaling import Scaling, reduce_amax_, reduces_across_ranks, scale_from_amax
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
def _compile_failures() -> tuple[type[BaseException], ...]:
    """The exceptions that mean ``torch.compile`` could not build a kernel, unlike a kernel's own error.

    Inductor wraps what goes wrong in it (no working C++ compiler, a C++ compile error, a lowering it
    lacks) in ``BackendCompilerFailed`` (``InductorError``); the two compiler errors are also listed for
    the paths that raise them unwrapped, and ``InternalTorchDynamoError`` is a bug in dynamo itself. An
    error of the kernel's code (a shape mismatch while tracing is ``TorchRuntimeError``, a Python error is
    itself) is none of these and propagates, as it would eagerly. Imported here, on a failure, because
    importing ``torch._dynamo`` is slow (``python -X importtime -c "import torch._dynamo"``).
    """
    from torch._dynamo.exc import BackendCompilerFailed, InternalTorchDynamoError
    from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

    return (BackendCompilerFailed, InternalTorchDynamoError, InvalidCxxCompiler, CppCompileError)


class _Kernel:
    """One configuration's kernel: compiled, or run eagerly after compiling it failed (same results).

    Only a failure to compile (:func:`_compile_failures`) switches the configuration to eager, with one
    warning that gives the reason; any other error, the kernel's own included, propagates.
    """

    def __init__(self, kernel: Callable[..., torch.Tensor], description: str) -> None:
        self.kernel = kernel
        self.description = description
        # emulate_precision_casts: keep x.to(bfloat16).float() a rounding (inductor drops it otherwise)
        self.compiled: Callable[..., torch.Tensor] | None = torch.compile(
            kernel, options={"emulate_precision_casts": True, "cpp.dynamic_threads": True}
        )

    def __call__(self, *args: torch.Tensor | None) -> torch.Tensor:
        if self.compiled is not None:
            try:
                # a kernel is pure tensor arithmetic: no torch-function mode of the caller's (a recipe's
                # fp32 ops) applies to it, and dynamo cannot trace under one
                with torch._C.DisableTorchFunction():
                    return self.compiled(*args)
            except _compile_failures() as error:  # this configuration runs eagerly from now on
                self.compiled = None
                reason = str(error).strip().splitlines()
                warnings.warn(
                    f"numscope fast path: compiling {self.description} failed ({type(error).__name__}"
                    f"{': ' + reason[0] if reason else ''}); it runs eagerly instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return self.kernel(*args)


@functools.cache
def _compiled(kernel_name: str, **static: Any) -> _Kernel:
    tag = f"{len(_COMPILED_TAGS)}"
    _COMPILED_TAGS.append((kernel_name, static))
    settings = ", ".join(f"{key}={getattr(value, 'name', value)}" for key, value in static.items())
    description = f"the {kernel_name} kernel ({settings})"
    return _Kernel(_own_copy(_KERNELS[kernel_name], tag, static), description)


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
    x: torch.Tensor,
    amax: torch.Tensor | None,
    scale: torch.Tensor | None,
    *,
    fmt: FloatFormat | IntFormat,
    overflow: str,
    flush: bool,
    mode: str | None,
    margin: int,
    power_of_two: bool,
    amax_epsilon: float,
) -> torch.Tensor:
    if scale is None and mode is not None:
        if amax is None:
            amax = _abs_amax_kernel(x, mode=mode)
        scale = scale_from_amax(amax, fmt.max, margin, power_of_two, amax_epsilon)
    if scale is None:
        return cast(x, fmt, "nearest", overflow, flush)
    return scale_then_cast(x, fmt, scale, "nearest", overflow, flush)[0]


def _block_kernel(
    x: torch.Tensor, tensor_amax: torch.Tensor | None, *, fmt: BlockFormat, flush: bool
) -> torch.Tensor:
    if fmt.tensor_scale and not fmt.row_scale and tensor_amax is None:
        tensor_amax = x.abs().amax()
    parts = block_parts_2d(x, fmt, tensor_amax, "nearest", None, flush)
    return block_values(parts.elements, parts.scales).reshape(x.shape[0], -1)


_KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "amax": _abs_amax_kernel,
    "element": _element_kernel,
    "block": _block_kernel,
}


# -- entry points used by numscope.formats.quantize -------------------------------------------------------


def abs_amax(x: torch.Tensor, mode: str) -> torch.Tensor:
    """amax(|x|) of a 2-D float32 tensor: ``tensor`` (0-d), ``row`` (R, 1) or ``column`` (1, C)."""
    result = native.abs_amax(x, mode) if native.available() else None
    if result is not None:
        return result
    _dynamic(x)
    return _compiled("amax", mode=mode)(x)


def element(
    x: torch.Tensor,
    fmt: FloatFormat | IntFormat,
    overflow: str,
    flush: bool,
    scaling: Scaling | None = None,
    scale: torch.Tensor | None = None,
    compile: bool = True,
) -> torch.Tensor | None:
    """Nearest-rounded ``cast(x · s) / s`` of a 2-D float32 tensor.

    ``s`` is ``scale`` where given (delayed scaling), else the scale of ``scaling`` (``tensor``, ``row`` or
    ``column``: computed in the same compiled function as the cast), else no scaling at all. By the native
    quantizers where they cover the call, else by the compiled kernel; ``compile=False``: None instead.
    """
    mode = None if scale is not None or scaling is None else scaling.kind
    by_library = native.covers(fmt, overflow, flush, x)
    if not (by_library or compile):
        return None  # decided before any amax is reduced across ranks: the caller's path reduces its own
    amax = None
    if mode in ("tensor", "column") and reduces_across_ranks(scaling.reduce_amax):  # type: ignore[union-attr]
        # amaxes that span the rows, which data parallelism splits over the ranks
        amax = reduce_amax_(abs_amax(x, mode).reshape(1, -1)).reshape(() if mode == "tensor" else (1, -1))
    if by_library:
        result = _native_element(x, fmt, overflow, flush, scaling, scale, mode, amax)
        if result is not None:
            return result
    if not compile:
        return None
    _dynamic(x, scale)
    margin, power_of_two, epsilon = (
        (scaling.margin, scaling.power_of_two, scaling.amax_epsilon) if mode is not None else (0, False, 0.0)  # type: ignore[union-attr]
    )
    kernel = _compiled(
        "element",
        fmt=fmt,
        overflow=overflow,
        flush=flush,
        mode=mode,
        margin=margin,
        power_of_two=power_of_two,
        amax_epsilon=epsilon,
    )
    return kernel(x, amax, scale)


def _native_element(
    x: torch.Tensor,
    fmt: FloatFormat | IntFormat,
    overflow: str,
    flush: bool,
    scaling: Scaling | None,
    scale: torch.Tensor | None,
    mode: str | None,
    amax: torch.Tensor | None,
) -> torch.Tensor | None:
    """:func:`element` by the native quantizers (None where they do not cover it): the amax and the scale
    are taken here, eagerly (a reduction and a few scalar or per-row operations), the cast natively."""
    if scale is not None:
        if scale.numel() != 1:
            return None
        return native.element(x, fmt, overflow, flush, scale.reshape(()), "tensor")
    if mode is None:
        return native.element(x, fmt, overflow, flush)
    if amax is None:
        amax = native.abs_amax(x, mode)
        if amax is None:
            return None
    return native.element(x, fmt, overflow, flush, scaling.scale(amax, fmt.max), mode)  # type: ignore[union-attr]


def reduced_tensor_amax(x: torch.Tensor, fmt: BlockFormat, reduce_amax: bool = True) -> torch.Tensor | None:
    """The per-tensor amax of a 2-D float32 tensor under a block format with a tensor scale (NVFP4),
    reduced across the ranks where they split the tensor (an empty share takes part with 0, the maximum's
    identity); None where there is nothing to reduce (the quantizer then takes its own, local amax)."""
    if not (fmt.tensor_scale and not fmt.row_scale and reduces_across_ranks(reduce_amax)):
        return None
    local = abs_amax(x, "tensor") if x.numel() else torch.zeros((), device=x.device)
    return reduce_amax_(local.reshape(1)).reshape(())


def block_columns(
    x: torch.Tensor, fmt: BlockFormat, reduce_amax: bool = True, flush: bool = False
) -> torch.Tensor | None:
    """A 2-D float32 tensor with blocks down its columns (along its first axis) quantized to ``fmt``
    without a transposed copy, by the native quantizers; None where they do not cover it (the caller then
    moves the axis last and calls :func:`block`)."""
    if not native.covers_block(fmt, x):
        return None  # before the amax is reduced across ranks: the caller's path reduces its own
    tensor_amax = reduced_tensor_amax(x, fmt, reduce_amax)
    return native.block(x, fmt, flush, along_columns=True, tensor_amax=tensor_amax)


def block(
    x: torch.Tensor, fmt: BlockFormat, reduce_amax: bool = True, flush: bool = False, compile: bool = True
) -> torch.Tensor | None:
    """A 2-D float32 tensor (blocks along its last axis) quantized to the block format ``fmt``.

    ``flush`` flushes the elements' subnormals after the block scale (``quantize``'s ``flush_subnormals``).
    By the native quantizers where they cover ``fmt``, else by the compiled kernel; ``compile=False``: None
    instead.

    A last axis that does not divide the block is zero-padded here, before the compiled kernel, so that
    one kernel (which sees whole blocks only) serves every shape; the result is a view without the padding.
    """
    length = x.shape[1]
    pad = (-length) % fmt.block_size
    padded = F.pad(x, (0, pad)) if pad else x
    if not (compile or native.covers_block(fmt, padded)):
        return None  # before the amax is reduced across ranks: the caller's path reduces its own
    tensor_amax = reduced_tensor_amax(padded, fmt, reduce_amax)
    out = native.block(padded, fmt, flush, tensor_amax=tensor_amax) if native.available() else None
    if out is None:
        if not compile:
            return None
        _dynamic(padded)
        out = _compiled("block", fmt=fmt, flush=flush)(padded, tensor_amax)
    return out.narrow(1, 0, length) if pad else out
