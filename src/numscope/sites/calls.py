"""The per-op adapters of the interception: which torch functions are GEMMs, and how a call's arguments are
read as torch reads them — the layout of a matmul (``mm``, ``fold``, ``batched``), ``addmm``/``baddbmm``
with their keywords and scalings, a two-operand ``einsum`` as the matmul it amounts to, autocast's and the
fp32 mode's working dtype, the composite functions run unfused, and the GEMMs that are not intercepted
(each warned about)."""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from numscope.sites.conv import _CONV_FUNCS
from numscope.sites.gemm import _LOW

_LINEAR_FUNCS = {F.linear}


def _accumulate_text(accumulate: tuple[str, ...]) -> str:
    """``'bf16'``, or ``'fp22/fp32/fp32' (fprop/dgrad/wgrad)`` where the GEMMs differ."""
    if len(set(accumulate)) == 1:
        return repr(accumulate[0])
    return f"{'/'.join(accumulate)!r} (fprop/dgrad/wgrad)"


_MM_FUNCS = {torch.mm, torch.Tensor.mm}
_ADDMM_FUNCS = {torch.addmm, torch.Tensor.addmm}
_BADDBMM_FUNCS = {torch.baddbmm, torch.Tensor.baddbmm}
_MATMUL_FUNCS = {torch.matmul, torch.Tensor.matmul, torch.linalg.matmul, torch.bmm, torch.Tensor.bmm}
_RMATMUL_FUNCS = {torch.Tensor.__rmatmul__}
_SDPA_FUNCS = {F.scaled_dot_product_attention}
_GEMM_FUNCS = (
    _LINEAR_FUNCS
    | _MM_FUNCS
    | _ADDMM_FUNCS
    | _BADDBMM_FUNCS
    | _MATMUL_FUNCS
    | _RMATMUL_FUNCS
    | _SDPA_FUNCS
    | set(_CONV_FUNCS)
)
_SOFTMAX_FUNCS = {torch.softmax, torch.Tensor.softmax, F.softmax, torch._softmax}


#: GEMMs numscope does not intercept: running one inside an attached model's forward warns, once per module
#: and op, that it stays unquantized and unobserved (never silently)
_UNINTERCEPTED: dict[Callable[..., Any], str] = {
    torch.einsum: "an einsum that is not one matmul",
    torch.bilinear: "a bilinear product",
    F.bilinear: "a bilinear product",
    torch.tensordot: "a tensordot",
    torch.addbmm: "an addbmm (a sum of batched products)",
    torch.Tensor.addbmm: "an addbmm (a sum of batched products)",
    torch.linalg.multi_dot: "a multi_dot chain",
    torch.chain_matmul: "a chain_matmul",
    torch.mv: "a matrix-vector product",
    torch.Tensor.mv: "a matrix-vector product",
    torch.addmv: "a matrix-vector product",
    torch.Tensor.addmv: "a matrix-vector product",
    torch.inner: "an inner product",
}
#: grouped GEMMs (mixture-of-experts experts): a 2-D input whose rows are sorted by expert times a 3-D
#: stack of expert weights, ``offs`` the cumulative row counts; each expert is a site of its own
_GROUPED_FUNCS = {
    func for func in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if func is not None
}

_WEIGHT_AXES: dict[tuple[str, str], tuple[int, int]] = {
    ("conv", "conv"): (1, 0),  # a convolution's own axes: _ConvParams.weight_axes
    ("linear", "linear"): (-1, 0),
    ("matmul", "linear"): (-1, 0),
    ("conv1d", "mm"): (0, -1),
    ("linear", "mm"): (0, -1),
    ("linear", "fold"): (-2, -1),  # x @ W.T with x of 3 or more axes (a Linear's weight, transposed)
    ("matmul", "mm"): (0, -1),
    ("matmul", "fold"): (-2, -1),
    ("matmul", "batched"): (-2, -1),
    ("sdpa", "batched"): (-2, -1),
}


def _matmul_layout(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Which decomposition ``at::matmul`` uses for ``a @ b`` (``None``: a 1-D operand, not a site)."""
    if a.dim() < 2 or b.dim() < 2:
        return None
    if a.dim() == 2 and b.dim() == 2:
        return "mm"
    if a.dim() >= 3 and b.dim() == 2:
        if b.requires_grad or a.numel() == 0:
            return "fold"
        shape, strides = a.shape, a.stride()
        foldable = all(strides[i] == strides[i + 1] * shape[i + 1] for i in range(a.dim() - 2))
        return "fold" if foldable else "batched"
    return "batched"


def _parse(func, args: tuple, kwargs: dict) -> tuple[str, Any, Any, Any] | None:
    """(layout, a, b, bias) of a GEMM call, or ``None`` where the call is not a site (1-D, out=, alpha…)."""
    if func in _SDPA_FUNCS:
        return ("sdpa", None, None, None)
    if func in _CONV_FUNCS:
        return ("conv", None, None, None)
    if "out" in kwargs:
        return None
    if func in _LINEAR_FUNCS:
        weight = args[1] if len(args) > 1 else kwargs["weight"]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return ("linear", args[0], weight, bias) if weight.dim() == 2 else None
    if func in _ADDMM_FUNCS or func in _BADDBMM_FUNCS:
        # as torch parses them: addmm(input, mat1, mat2, *, beta, alpha), baddbmm(input, batch1, batch2, ...)
        names = ("input", "mat1", "mat2") if func in _ADDMM_FUNCS else ("input", "batch1", "batch2")
        given = dict(zip(names, args[:3], strict=False)) | kwargs
        extra = dict(zip(("beta", "alpha"), args[3:], strict=False)) | kwargs
        bias, a, b = (given.get(name) for name in names)
        if not all(isinstance(t, torch.Tensor) for t in (bias, a, b)):
            return None
        rank = 2 if func in _ADDMM_FUNCS else 3
        if extra.get("beta", 1) != 1 or extra.get("alpha", 1) != 1 or a.dim() != rank or b.dim() != rank:
            return None
        return ("mm" if rank == 2 else "batched", a, b, bias)
    a, b = (args[1], args[0]) if func in _RMATMUL_FUNCS else (args[0], args[1])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    layout = _matmul_layout(a, b)
    return None if layout is None else (layout, a, b, None)


def _scaled_product(func, args: tuple, kwargs: dict) -> Callable[[], torch.Tensor] | None:
    """``addmm``/``baddbmm`` with ``alpha`` or ``beta`` other than 1, as ``beta · input + alpha · (a @ b)``
    with the product a site (``mm``/``bmm``, run under the mode); ``beta = 0`` ignores ``input``, as torch
    does (a NaN there does not propagate). ``None`` where the call is a plain one (or writes into ``out=``).
    The same value as torch's fused kernel up to float32 rounding (it scales and adds after the product)."""
    names = ("input", "mat1", "mat2") if func in _ADDMM_FUNCS else ("input", "batch1", "batch2")
    given = dict(zip(names, args[:3], strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    extra = dict(zip(("beta", "alpha"), args[3:], strict=False)) | kwargs
    beta, alpha = extra.get("beta", 1), extra.get("alpha", 1)
    if "out" in kwargs or (beta == 1 and alpha == 1):
        return None
    bias, a, b = (given.get(name) for name in names)
    if not all(isinstance(t, torch.Tensor) for t in (bias, a, b)):
        return None
    product = torch.mm if func in _ADDMM_FUNCS else torch.bmm

    def scaled() -> torch.Tensor:
        out = product(a, b)
        if alpha != 1:
            out = out * alpha
        return out if beta == 0 else out + (bias if beta == 1 else bias * beta)

    return scaled


def _upcast(*operands: torch.Tensor | None) -> torch.dtype | None:
    """The working dtype in which a mode below the interception mode has GEMMs computed on float32 values.

    A ``TorchFunctionMode`` (such as :class:`numscope.train.fp32_ops.Fp32Ops`) opts in by defining
    ``fp32_gemm_dtype() -> torch.dtype | None``; where one of ``operands`` has that dtype the site function
    computes on float32 copies of its fp16/bf16 operands and returns that dtype, as the mode would have.
    """
    if not any(t is not None and t.dtype in _LOW for t in operands):
        return None
    for index in range(torch._C._len_torch_function_stack() - 1, -1, -1):
        ask = getattr(torch._C._get_function_stack_at(index), "fp32_gemm_dtype", None)
        dtype = None if ask is None else ask()
        if dtype is not None:
            return dtype if any(t is not None and t.dtype == dtype for t in operands) else None
    return None


def _autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes a GEMM on ``tensor``'s device in, where it is on there.

    A site under autocast does what autocast does to a GEMM (its floating operands cast to that dtype,
    float64 excepted; the product in that dtype, accumulated in float32) with the plan's quantizers on the
    cast operands: it multiplies float32 copies of them with autocast off inside and returns that dtype.
    """
    device = tensor.device.type
    try:
        enabled = torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type autocast does not know
        return None
    return torch.get_autocast_dtype(device) if enabled else None


def _autocast_cast(
    dtype: torch.dtype | None, *tensors: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` as autocast casts a GEMM's arguments to ``dtype`` (float32 and the other 16-bit
    floating dtypes; float64 and integers stay)."""
    if dtype is None:
        return tensors
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


class _AutocastOff:
    """``torch.autocast(device, enabled=False)`` where ``dtype`` (a site under autocast) says so."""

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype | None) -> None:
        self.context = torch.autocast(tensor.device.type, enabled=False) if dtype is not None else None

    def __enter__(self) -> None:
        if self.context is not None:
            self.context.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.context is not None:
            self.context.__exit__(*exc)


def _out_numel(layout: str, a: torch.Tensor, b: torch.Tensor) -> int:
    if layout == "linear":
        return a.numel() // max(a.shape[-1], 1) * b.shape[0]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return math.prod(batch) * a.shape[-2] * b.shape[-1]


def _einsum_as_matmul(args: tuple, kwargs: dict) -> Callable[[], torch.Tensor] | None:
    """A two-operand ``torch.einsum`` as the one ``torch.matmul`` it amounts to, or None where the call is
    not of that kind (sublist form, ``...``, a repeated index in one operand, broadcasting, ≠ 2 operands).

    Indices in both operands and the output are batch axes, in both but not the output contracted, in one
    operand and the output free (rows of the left, columns of the right); an index in one operand only
    and not in the output is summed away first. Implicit output (no ``->``): the indices that occur once,
    in alphabetical order, as torch.einsum does. The result equals torch.einsum's in value (both reduce
    to a batched GEMM; the bits may differ where torch picks another operand order).
    """
    if kwargs or len(args) < 2 or not isinstance(args[0], str):
        return None
    equation, operands = args[0], args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if len(operands) != 2 or not all(isinstance(t, torch.Tensor) for t in operands):
        return None
    equation = equation.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    if len(terms) != 2 or not all(term.isalpha() for term in terms) or (output and not output.isalpha()):
        return None
    left, right = terms
    if not arrow:
        output = "".join(sorted(c for c in set(left + right) if (left + right).count(c) == 1))
    a, b = operands
    if (a.dim(), b.dim()) != (len(left), len(right)):
        return None
    if any(len(set(t)) != len(t) for t in (left, right, output)):
        return None  # a diagonal or a repeated output index
    if not set(output) <= set(left) | set(right):
        return None
    size = dict(zip(left, a.shape, strict=True))
    if any(size.get(c, n) != n for c, n in zip(right, b.shape, strict=True)):
        return None  # broadcasting a size-1 axis: left to torch.einsum
    size.update(zip(right, b.shape, strict=True))
    batch = [c for c in output if c in left and c in right]
    rows = [c for c in output if c in left and c not in right]
    cols = [c for c in output if c in right and c not in left]
    contracted = [c for c in left if c in right and c not in output]

    def operand(
        x: torch.Tensor, term: str, other: str, order: list[str], shape: tuple[int, ...]
    ) -> torch.Tensor:
        lonely = [i for i, c in enumerate(term) if c not in other and c not in output]
        if lonely:
            x = x.sum(dim=lonely)
        kept = [c for c in term if c in other or c in output]
        return x.permute([kept.index(c) for c in order]).reshape(shape)

    def product() -> torch.Tensor:
        m, k, n = (math.prod(size[c] for c in axes) for axes in (rows, contracted, cols))
        batch_size = (math.prod(size[c] for c in batch),) if batch else ()
        x = operand(a, left, right, [*batch, *rows, *contracted], (*batch_size, m, k))
        y = operand(b, right, left, [*batch, *contracted, *cols], (*batch_size, k, n))
        z = torch.matmul(x, y).reshape(tuple(size[c] for c in (*batch, *rows, *cols)))
        order = [*batch, *rows, *cols]
        return z.permute([order.index(c) for c in output])

    return product


def _unfused(function: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of a composite ``torch.nn.functional`` function that does not hand itself to torch-function
    modes as a whole (its ``has_torch_function`` check answers False), so that the GEMMs it issues reach the
    interception mode one by one, as the original computes them."""
    namespace = {**function.__globals__, "has_torch_function": lambda *args: False}
    copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


#: ``nn.MultiheadAttention`` (and ``nn.Transformer*`` through it) computes in one functional call, which a
#: torch-function mode would receive whole: it runs unfused, its in- and out-projections and its two
#: attention products each a site. Under the mode its fast path (``torch._native_multi_head_attention``) is
#: never taken: ``MultiheadAttention.forward`` leaves it wherever a torch function mode is active.
_COMPOSITE_FUNCS: dict[Callable[..., Any], Callable[..., Any]] = {
    F.multi_head_attention_forward: _unfused(F.multi_head_attention_forward)
}
