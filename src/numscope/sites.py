"""GEMM sites of any ``nn.Module`` and the one interception point through which their operands pass.

A *site* is one GEMM-bearing call: an ``nn.Linear``, a transformers ``Conv1D``, or a matmul issued in
forward code (``torch.matmul``/``@``/``bmm``/``mm``/``addmm``, ``F.linear`` outside a Linear, and
``F.scaled_dot_product_attention``, which counts as two sites: ``scores`` = q·kᵀ and ``context`` = p·v).
Every site has three GEMMs with two operands each:

========  =========================  ============================  ================================
gemm      product                    operands                      contraction axis passed
========  =========================  ============================  ================================
fprop     y  = x · Wᵀ                ``input``, ``weight``         x: -1; W (out, in): -1
dgrad     dx = dy · W                ``grad_output``, ``weight``   dy: -1; W (out, in): 0
wgrad     dW = dyᵀ · x               ``grad_output``, ``input``    dy, x flattened to (tokens, ·): 0
========  =========================  ============================  ================================

For a matmul site ``y = a @ b`` the same names are used with ``input`` = a and ``weight`` = b, so dgrad is
``da = dy · bᵀ`` and wgrad is ``db = aᵀ · dy``; the axes are a: -1 (fprop), -2 (wgrad); b: -2 (fprop),
-1 (dgrad); dy: -1 (dgrad), -2 (wgrad). Conv1D's weight is (in, out): fprop axis 0, dgrad axis -1.

Site names: the module's qualified name for Linear/Conv1D, Conv/ConvTranspose layers and a module's own
``weight`` in ``F.linear`` (a router); ``<module>.<role>`` for matmuls found in forward code, attributed to
the innermost module whose forward is running. Roles: ``scores`` (a matmul whose result reaches a softmax
in the same module) and ``context`` (a matmul whose left operand comes from that softmax), as in eager
attention and the two GEMMs of SDPA; other matmuls are ``matmul0``, ``matmul1``… and convolutions
``conv0``… in call order within the module's forward.

Layers that compute in one fused call are opened up: ``nn.MultiheadAttention`` (and ``nn.Transformer*``)
runs its functional forward unfused under the mode, giving ``<mha>.in_proj`` (or ``in_proj_q``/
``in_proj_kv``, ``q_proj``/``k_proj``/``v_proj``), ``scores``, ``context`` and ``out_proj``;
``nn.LSTM``/``GRU``/``RNN`` are unrolled (:mod:`numscope.recurrent`) into ``<rnn>.ih_l0`` and
``<rnn>.hh_l0`` (``_reverse`` for the backward direction); mixture-of-experts weights stacked in one
parameter give one site per expert, ``<experts>.<parameter>.<index>``, whether the experts run eagerly or as
one grouped GEMM (split per expert). Convolutions (:class:`SiteConv`) are the GEMMs of their im2col form:
contraction axes 1 (input, grad_output in dgrad), the weight's C_in (fprop) or C_out (dgrad) axis, and the
batch axis 0 for both wgrad operands. A two-operand ``torch.einsum`` is computed as the matmul it amounts to
and named like one. A GEMM numscope does not intercept (another einsum, bilinear, a packed sequence, a string
padding) runs as it is and warns once per module and op.

Roles need one forward pass to be found: :func:`sites` with ``example_inputs``, or, for an attached model,
the first forward (run once more, without gradients, in eval mode, the RNG restored, before the real one).

Handlers (:class:`OperandHandler`) are attached per model (:func:`attach`) and chained in attach order:
each gets the previous one's result. During the model's forward a ``TorchFunctionMode`` routes each site
through one ``torch.autograd.Function`` that calls the chain for (fprop, input) and (fprop, weight) in
forward and for the dgrad and wgrad operands in backward, then multiplies the returned tensors. With
every handler returning its tensor unchanged and fp32 accumulation, outputs and gradients are bit for bit
those of the unconverted model: the products are the ones autograd itself issues for ``F.linear``,
``addmm``, ``mm`` and ``matmul`` (for a 2-D @ ≥3-D matmul, and ≥3-D matmuls whose batch of 1 broadcasts,
the batched decomposition is used: equal in value, not guaranteed in bits). A handler may define
``wants(site) -> bool`` (sites nobody wants run the original op untouched: an unwanted SDPA stays the
fused kernel), ``accumulate(site) -> str | None`` (a name of :data:`ACCUMULATORS`) and
``shares_input(site) -> bool``: when every handler of a site says True (its wgrad input would be its
fprop input, handled identically), the function saves the handled fprop input for backward instead of
the raw one and passes it to wgrad without calling the chain again. A handler may also define
``active() -> bool``, asked at the start of each forward: while every attached handler says False, the
forward runs with no interception at all (an observer between its sampled steps costs nothing).

A handler gets the operand as the model passes it (a weight is the ``nn.Parameter`` itself, in fprop and
in dgrad) and returns it in its dtype or in float32; the site casts what comes back to the dtype its GEMM
multiplies in. That is the operand's own dtype, except under a ``TorchFunctionMode`` below the
interception mode that defines ``fp32_gemm_dtype() -> torch.dtype | None`` (as
:class:`numscope.train.fp32_ops.Fp32Ops` does): a GEMM with an operand in that working dtype multiplies
float32 values (fp16/bf16 operands cast up exactly, handlers' float32 results kept as they are) and
returns the working dtype, its gradients each input's dtype, as the mode itself would compute it.

Accumulation in bf16, fp16 or fp22 is emulated: the reduction dimension is split into chunks of
:data:`ACCUMULATE_CHUNK` (32) products; each chunk's partial sum is computed in fp32 and rounded to the
accumulator format; the partials are added one after another with rounding to the accumulator format
after each addition (as a tensor core that accumulates a short dot product exactly and adds it to a
narrow accumulator). ``fp22_promote128`` does so for each run of 128 products and adds the runs' sums in
fp32 (DeepSeek-V3's promotion to CUDA cores). A bias is added in fp32 to the rounded result.

Matmuls with a 1-D operand (dot, mv) are not sites. Only calls inside the attached model's own forward
are intercepted (not a submodule called directly), and only modules present at attach time are tracked.
"""

from __future__ import annotations

import math
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

from numscope._rng import fork_rng
from numscope._root_call import SITES, RootCall, RootCalls, remove_mode
from numscope.recurrent import CELLS, recurrent_reference

GEMMS: tuple[str, ...] = ("fprop", "dgrad", "wgrad")
#: number of products summed exactly (in fp32) before a rounding to a narrow accumulator
ACCUMULATE_CHUNK = 32


@dataclass(frozen=True)
class Accumulator:
    """How a GEMM sums its products: in ``format`` (``None``: fp32, torch's own matmul), and, where
    ``promote_every`` is set, with the narrow partial sum added into an fp32 total every that many
    products (DeepSeek-V3's promotion of the tensor cores' limited accumulation, every 128)."""

    format: str | None
    promote_every: int | None = None


#: the accumulators a plan's ``accumulate`` names: fp32; bf16 and fp16; fp22 (E8M13, the ~14 significant
#: bits that FP8 tensor cores keep, as the DeepSeek-V3 report measured on H800), alone or promoted to fp32
#: every 128 products
ACCUMULATORS: dict[str, Accumulator] = {
    "fp32": Accumulator(None),
    "bf16": Accumulator("bf16"),
    "fp16": Accumulator("fp16"),
    "fp22": Accumulator("e8m13"),
    "fp22_promote128": Accumulator("e8m13", 128),
}
_LOW = (torch.float16, torch.bfloat16)
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}


@dataclass(frozen=True)
class Site:
    """One GEMM-bearing call of a model.

    name: the site's name (what plan rules match). module: qualified name of the module it belongs to.
    kind: ``linear``, ``conv1d``, ``matmul`` (matmul/bmm/mm/addmm/F.linear in forward code) or ``sdpa``.
    """

    name: str
    module: str
    kind: str

    def key(self, gemm: str, operand: str, *parts: str) -> str:
        """A legible metric key, e.g. ``bert.encoder.layer.0.attention.self.query/wgrad/grad_output``."""
        return "/".join((self.name, gemm, operand, *parts))


@runtime_checkable
class OperandHandler(Protocol):
    """Sees (and may replace) one operand of one GEMM of one site.

    ``axis`` is the contraction axis of ``tensor`` in this GEMM. Called inside an autograd Function: no
    gradient is tracked through what it does. Must return a tensor of the same shape, in ``tensor``'s
    dtype or in float32 (the site casts it to the dtype its GEMM multiplies in).
    """

    def __call__(
        self, site: Site, gemm: str, operand: str, tensor: torch.Tensor, axis: int
    ) -> torch.Tensor: ...


# -- exact replicas of autograd's mm backward ----------------------------------------------------------


def _mm_mat1_backward(grad: torch.Tensor, mat2: torch.Tensor, sizes: Sequence[int], strides: Sequence[int]):
    """The gradient of mat1 in ``mat1.mm(mat2)``, as torch's ``mm_mat1_backward`` (alpha 1, strided)."""
    if strides[0] == 1 and strides[1] == sizes[0]:
        return mat2.mm(grad.t()).t()
    return grad.mm(mat2.t())


def _mm_mat2_backward(grad: torch.Tensor, mat1: torch.Tensor, sizes: Sequence[int], strides: Sequence[int]):
    """The gradient of mat2 in ``mat1.mm(mat2)``, as torch's ``mm_mat2_backward`` (alpha 1, strided)."""
    if strides[0] == 1 and strides[1] == sizes[0]:
        return grad.t().mm(mat1).t()
    return mat1.t().mm(grad)


def accumulate_matmul(
    a: torch.Tensor, b: torch.Tensor, accumulate: str, chunk: int = ACCUMULATE_CHUNK
) -> torch.Tensor:
    """``a @ b`` (broadcasting, ≥2-D) with the sum over the contraction axis in the ``accumulate`` format.

    See the module docstring for the model (chunks of ``chunk`` products exact in fp32, then sequential
    additions rounded to the accumulator's format; with promotion, each run of ``promote_every`` products
    summed so and then added into an fp32 total). ``fp32`` is ``torch.matmul``. Returns ``a``'s dtype.
    """
    accumulator = ACCUMULATORS.get(accumulate)
    if accumulator is None:
        raise ValueError(f"unknown accumulate {accumulate!r}; allowed: {', '.join(ACCUMULATORS)}")
    if accumulator.format is None:
        return torch.matmul(a, b)
    from numscope.formats.cast import cast_float
    from numscope.formats.spec import format as get_format

    narrow = get_format(accumulator.format)

    def rounded(values: torch.Tensor) -> torch.Tensor:
        return cast_float(values, narrow, "nearest", "propagate")  # type: ignore[arg-type]

    out_dtype = a.dtype
    a, b = a.float(), b.float()
    length = a.shape[-1]
    pad = (-length) % chunk
    if pad:
        a = F.pad(a, (0, pad))
        b = F.pad(b, (0, 0, 0, pad))
    chunks = (length + pad) // chunk
    a_chunks = a.reshape(*a.shape[:-1], chunks, chunk).movedim(-2, -3)
    b_chunks = b.reshape(*b.shape[:-2], chunks, chunk, b.shape[-1])
    partials = rounded(torch.matmul(a_chunks, b_chunks))
    per_group = chunks if accumulator.promote_every is None else max(accumulator.promote_every // chunk, 1)
    total = None
    for first in range(0, chunks, per_group):
        group = partials.select(-3, first)
        for index in range(first + 1, min(first + per_group, chunks)):
            group = rounded(group + partials.select(-3, index))
        total = group if total is None else total + group  # the promotion: an fp32 addition
    assert total is not None
    return total.to(out_dtype)


# -- the one autograd function -------------------------------------------------------------------------


@dataclass
class _Call:
    """Everything the autograd function needs about one site call besides its tensors."""

    site: Site
    layout: str  # linear | mm | fold | batched
    handlers: tuple[Callable[..., torch.Tensor], ...]
    accumulate: str
    storage: torch.dtype | None
    weight_axes: tuple[int, int] = (-1, 0)  # (fprop, dgrad) axes of b
    meta: dict[str, Any] = field(default_factory=dict)
    share_input: bool = False  # wgrad takes fprop's handled input (every handler said shares_input)
    prequantize: bool = False  # wgrad's input is quantized in forward and kept in its codes (see below)
    upcast: torch.dtype | None = None  # the working dtype of a GEMM computed on float32 values

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype an operand of ``dtype`` is multiplied in: float32 for fp16/bf16 when upcasting."""
        return torch.float32 if self.upcast is not None and dtype in _LOW else dtype

    def pack(
        self, tensor: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], Callable[..., torch.Tensor]] | None:
        """A compact form of the handled fprop input kept for wgrad, from the last handler that offers one
        (``pack(site, tensor) -> (tensors, unpack) | None``; ``unpack(*tensors)`` must give ``tensor`` back
        bit for bit): a quantized operand kept in its own codes instead of float32."""
        packer = getattr(self.handlers[-1], "pack", None) if self.handlers else None
        return None if packer is None else packer(self.site, tensor)

    def pack_wgrad_input(
        self, tensor: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], Callable[..., torch.Tensor]] | None:
        """wgrad's input (``tensor``, (tokens, features)) quantized now, in forward, and kept in its codes:
        what every handler's ``prequantizes_wgrad_input(site)`` allowed, from the last handler's
        ``pack_wgrad_input(site, tensor) -> (tensors, unpack) | None``; ``unpack(*tensors)`` is exactly what
        the chain would give wgrad in backward (a block format's input keeps its codes, not float32)."""
        return self.handlers[-1].pack_wgrad_input(self.site, tensor)  # type: ignore[attr-defined]

    def chain(self, gemm: str, operand: str, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        dtype = self.compute_dtype(tensor.dtype)
        for handler in self.handlers:
            tensor = handler(self.site, gemm, operand, tensor, axis).to(dtype)
        return tensor.to(dtype)


def _store(tensor: torch.Tensor, storage: torch.dtype | None) -> torch.Tensor:
    """The copy of an activation kept for backward (parameters are kept as they are)."""
    if storage is None or isinstance(tensor, nn.Parameter) or not tensor.is_floating_point():
        return tensor
    return tensor.to(storage)


def _sum_bias(grad_output: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The bias gradient: the unquantized grad_output summed (in fp32) to the bias shape."""
    if grad_output.dtype == torch.float32:
        return grad_output.sum_to_size(shape).to(dtype)
    return grad_output.float().sum_to_size(shape).to(dtype)


def _fold_strides(a: torch.Tensor) -> tuple[int, int]:
    """Strides of ``a.reshape(-1, a.shape[-1])`` (a view where the leading dims fold, else a fresh copy)."""
    shape, strides = a.shape, a.stride()
    for index in range(a.dim() - 2):
        if strides[index] != strides[index + 1] * shape[index + 1]:
            return (shape[-1], 1)
    return (strides[-2], strides[-1])


def _forward_product(
    call: _Call, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    layout, acc = call.layout, call.accumulate
    if acc == "fp32":
        if layout == "linear":
            return F.linear(a, b, bias)
        if layout == "mm":
            return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
        return torch.matmul(a, b) if bias is None else torch.baddbmm(bias, a, b)
    if layout == "linear":
        out = accumulate_matmul(a.reshape(-1, a.shape[-1]), b.t(), acc).reshape(*a.shape[:-1], b.shape[0])
    else:
        out = accumulate_matmul(a, b, acc)
    return out if bias is None else out + bias


class SiteGemm(torch.autograd.Function):
    """``y = a ⊗ b (+ bias)`` of one site, every operand of its three GEMMs passed through the handler chain.

    Parametrised by a :class:`_Call` (layout, site, handlers, accumulation, storage); one class for every
    kind of site.
    """

    @staticmethod
    def forward(ctx, call: _Call, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None):  # type: ignore[override]
        fprop_b_axis, _ = call.weight_axes
        a_q = call.chain("fprop", "input", a, -1)
        b_q = call.chain("fprop", "weight", b, fprop_b_axis)
        out = _forward_product(
            call, a_q, b_q, None if bias is None else bias.to(call.compute_dtype(bias.dtype))
        )
        need_a, need_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        # the handled input is kept for wgrad only where it takes no more memory than the raw one
        share = call.share_input and a_q.element_size() <= a.element_size()
        ctx.share = share
        ctx.call = call
        ctx.a_meta = (a.shape, a.stride(), a.dtype)
        ctx.b_meta = (b.shape, b.stride(), b.dtype)
        ctx.has_bias = bias is not None
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        packed = call.pack(a_q) if share and need_b and call.storage is None else None
        ctx.unpack = None if packed is None else packed[1]
        prepared = None
        if need_b and not share and call.prequantize and call.storage is None:
            prepared = call.pack_wgrad_input(a if call.layout == "mm" else a.reshape(-1, a.shape[-1]))
        ctx.wgrad_unpack = None if prepared is None else prepared[1]
        if prepared is not None:
            kept_a = prepared[0]
        elif packed is not None:
            kept_a = packed[0]
        else:
            kept_a = (_store(a_q if share else a, call.storage) if need_b else None,)
        ctx.save_for_backward(*kept_a, _store(b, call.storage) if need_a else None)
        ctx.a_saved_dtype = (a_q if share else a).dtype
        # the parameter object itself for dgrad's handlers (saved-tensor hooks hand back a plain alias),
        # which may reuse what they made of it in fprop; saved above too, for autograd's version check
        ctx.parameter = b if need_a and isinstance(b, nn.Parameter) else None
        return out if call.upcast is None else out.to(call.upcast)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        call: _Call = ctx.call
        *kept_a, b_saved = ctx.saved_tensors
        a_shape, a_stride, a_dtype = ctx.a_meta
        b_shape, b_stride, b_dtype = ctx.b_meta
        need_a, need_b, need_bias = ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        # wgrad's input quantized in forward (kept in its codes), as the chain would have made it here
        prepared = None
        if ctx.wgrad_unpack is not None:
            prepared = ctx.wgrad_unpack(*kept_a).to(call.compute_dtype(a_dtype))
            a_saved = None
        else:
            a_saved = ctx.unpack(*kept_a) if ctx.unpack is not None else kept_a[0]
        a = None if a_saved is None else a_saved.to(ctx.a_saved_dtype)
        b = ctx.parameter if ctx.parameter is not None else None if b_saved is None else b_saved.to(b_dtype)
        share = ctx.share
        grad_a = grad_b = grad_bias = None
        layout, acc = call.layout, call.accumulate
        _, dgrad_b_axis = call.weight_axes
        if layout in ("linear", "fold"):
            grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
            if need_a:
                dy = call.chain("dgrad", "grad_output", grad_2d, -1)
                w = call.chain("dgrad", "weight", b, dgrad_b_axis)
                mat2 = w.t() if layout == "linear" else w
                if acc == "fp32":
                    a2_size = (math.prod(a_shape[:-1]), a_shape[-1])
                    a2_stride = a_stride if len(a_shape) == 2 else call.meta["a_fold_strides"]
                    grad_a = _mm_mat1_backward(dy, mat2, a2_size, a2_stride).reshape(a_shape)
                else:
                    grad_a = accumulate_matmul(dy, mat2.t(), acc).reshape(a_shape)
            if need_b:
                dy = call.chain("wgrad", "grad_output", grad_2d, 0)
                if prepared is not None:
                    x = prepared
                else:
                    x = a.reshape(-1, a_shape[-1])
                    x = x if share else call.chain("wgrad", "input", x, 0)
                if acc != "fp32":
                    product = accumulate_matmul(x.t(), dy, acc)
                    grad_b = product.t() if layout == "linear" else product
                elif layout == "linear":
                    grad_b = _mm_mat2_backward(
                        dy, x, (b_shape[1], b_shape[0]), (b_stride[1], b_stride[0])
                    ).t()
                else:
                    grad_b = _mm_mat2_backward(dy, x, b_shape, b_stride)
        elif layout == "mm":
            if need_a:
                dy = call.chain("dgrad", "grad_output", grad_output, -1)
                w = call.chain("dgrad", "weight", b, dgrad_b_axis)
                if acc == "fp32":
                    grad_a = _mm_mat1_backward(dy, w, a_shape, a_stride)
                else:
                    grad_a = accumulate_matmul(dy, w.t(), acc)
            if need_b:
                dy = call.chain("wgrad", "grad_output", grad_output, 0)
                x = prepared if prepared is not None else a if share else call.chain("wgrad", "input", a, 0)
                grad_b = (
                    _mm_mat2_backward(dy, x, b_shape, b_stride)
                    if acc == "fp32"
                    else accumulate_matmul(x.t(), dy, acc)
                )
        else:  # batched, as at::matmul: expand the batch dims, fold them into one, bmm
            batch = call.meta["batch"]
            count = math.prod(batch)
            n, m, p = a_shape[-2], a_shape[-1], b_shape[-1]
            if need_a:
                dy = call.chain("dgrad", "grad_output", grad_output, -1).reshape(count, n, p)
                w = call.chain("dgrad", "weight", b, -1).expand(*batch, m, p).reshape(count, m, p)
                product = (
                    dy.bmm(w.transpose(1, 2))
                    if acc == "fp32"
                    else accumulate_matmul(dy, w.transpose(1, 2), acc)
                )
                grad_a = product.reshape(*batch, n, m).sum_to_size(a_shape)
            if need_b:
                dy = call.chain("wgrad", "grad_output", grad_output, -2).reshape(count, n, p)
                x = a if share else call.chain("wgrad", "input", a, -2)
                x = x.expand(*batch, n, m).reshape(count, n, m)
                product = (
                    x.transpose(1, 2).bmm(dy)
                    if acc == "fp32"
                    else accumulate_matmul(x.transpose(1, 2), dy, acc)
                )
                grad_b = product.reshape(*batch, m, p).sum_to_size(b_shape)
        if need_bias and ctx.has_bias:
            flat = grad_output.reshape(-1, grad_output.shape[-1]) if layout == "linear" else grad_output
            grad_bias = _sum_bias(flat, ctx.bias_shape, ctx.bias_dtype)
        if call.upcast is not None:  # computed in float32: back to each input's dtype, as autograd's casts
            grad_a = None if grad_a is None else grad_a.to(a_dtype)
            grad_b = None if grad_b is None else grad_b.to(b_dtype)
        return None, grad_a, grad_b, grad_bias


# -- convolutions ------------------------------------------------------------------------------------

_CONV_FUNCS: dict[Callable[..., Any], tuple[int, bool]] = {
    F.conv1d: (1, False),
    F.conv2d: (2, False),
    F.conv3d: (3, False),
    F.conv_transpose1d: (1, True),
    F.conv_transpose2d: (2, True),
    F.conv_transpose3d: (3, True),
}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_TRANSPOSE_ARGS = (
    "input",
    "weight",
    "bias",
    "stride",
    "padding",
    "output_padding",
    "groups",
    "dilation",
)


@dataclass(frozen=True)
class _ConvParams:
    """A convolution's geometry, in ``aten.convolution``'s terms."""

    dims: int
    transposed: bool
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    output_padding: tuple[int, ...]
    groups: int

    @classmethod
    def of(
        cls, func: Callable[..., Any], args: tuple, kwargs: dict
    ) -> tuple[_ConvParams, dict[str, Any]] | None:
        """The parameters of a ``F.conv*`` call, or ``None`` where its padding is a string ('same')."""
        dims, transposed = _CONV_FUNCS[func]
        bound = dict(zip(_CONV_TRANSPOSE_ARGS if transposed else _CONV_ARGS, args, strict=False)) | kwargs
        if isinstance(bound.get("padding", 0), str):
            return None

        def tuple_of(value: Any, default: int) -> tuple[int, ...]:
            value = default if value is None else value
            return tuple(value) if isinstance(value, list | tuple) else (int(value),) * dims

        params = cls(
            dims,
            transposed,
            tuple_of(bound.get("stride"), 1),
            tuple_of(bound.get("padding"), 0),
            tuple_of(bound.get("dilation"), 1),
            tuple_of(bound.get("output_padding"), 0),
            int(bound.get("groups", 1) or 1),
        )
        return params, bound

    @property
    def weight_axes(self) -> tuple[int, int]:
        """The contraction axis of the weight in fprop and in dgrad: a convolution's weight is (C_out,
        C_in/groups, k…) and contracts over C_in in fprop, over C_out in dgrad; transposed, the reverse."""
        return (0, 1) if self.transposed else (1, 0)

    def convolve(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.aten.convolution(
            x, weight, bias, self.stride, self.padding, self.dilation, self.transposed, self.output_padding,
            self.groups,
        )  # fmt: skip

    def gradients(
        self,
        grad_output: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        mask: tuple[bool, bool, bool],
        bias_sizes: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """``aten.convolution_backward``: the op autograd itself runs for a convolution."""
        return torch.ops.aten.convolution_backward(
            grad_output, x, weight, bias_sizes, self.stride, self.padding, self.dilation, self.transposed,
            self.output_padding, self.groups, list(mask),
        )  # fmt: skip


class SiteConv(torch.autograd.Function):
    """A convolution site: its input, weight and grad_output through the handler chain in each of its three
    GEMMs (the convolution is the GEMM of its im2col form), multiplied by ``aten.convolution`` and
    ``aten.convolution_backward``, the ops autograd itself runs, so identity handlers are bit-identical.

    Contraction axes handed to the handlers: the channel axis 1 of the input (fprop) and of grad_output
    (dgrad); the weight's C_in axis in fprop and C_out axis in dgrad (see :attr:`_ConvParams.weight_axes`);
    in wgrad the contraction runs over the batch and every output position, and the handlers get axis 0,
    the batch axis (so block formats block consecutive samples at one channel and position there).
    """

    @staticmethod
    def forward(ctx, call: _Call, params: _ConvParams, x, weight, bias):  # type: ignore[override]
        fprop_w_axis, _ = params.weight_axes
        x_q = call.chain("fprop", "input", x, 1)
        w_q = call.chain("fprop", "weight", weight, fprop_w_axis)
        out = params.convolve(x_q, w_q, None if bias is None else bias.to(call.compute_dtype(bias.dtype)))
        ctx.call, ctx.params = call, params
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(_store(x, call.storage), weight)
        return out if call.upcast is None else out.to(call.upcast)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        call, params = ctx.call, ctx.params
        x_saved, weight = ctx.saved_tensors
        x = x_saved.to(ctx.dtypes[0])
        need_x, need_w, need_bias = ctx.needs_input_grad[2], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        _, dgrad_w_axis = params.weight_axes
        grad_x = grad_w = grad_bias = None
        if need_x:
            dy = call.chain("dgrad", "grad_output", grad_output, 1)
            w_q = call.chain("dgrad", "weight", weight, dgrad_w_axis)
            grad_x = params.gradients(dy, x.to(dy.dtype), w_q, (True, False, False))[0]
        if need_w:
            dy = call.chain("wgrad", "grad_output", grad_output, 0)
            x_q = call.chain("wgrad", "input", x, 0)
            grad_w = params.gradients(dy, x_q, weight.to(dy.dtype), (False, True, False))[1]
        if need_bias and ctx.dtypes[2] is not None:  # from the unquantized grad_output, as autograd sums it
            channels = [weight.shape[1] * params.groups if params.transposed else weight.shape[0]]
            grad_bias = params.gradients(grad_output, x, weight, (False, False, True), channels)[2]
            grad_bias = grad_bias.to(ctx.dtypes[2])
        if call.upcast is not None:
            grad_x = None if grad_x is None else grad_x.to(ctx.dtypes[0])
            grad_w = None if grad_w is None else grad_w.to(ctx.dtypes[1])
        return None, None, grad_x, grad_w, grad_bias


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


# -- scaled dot-product attention, emulated as two sites --------------------------------------------


def sdpa_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    matmul: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as explicit GEMMs: scores = q·kᵀ, scale, mask, softmax in fp32,
    dropout (``F.dropout``, inverted), context = p·v.

    attn_mask: boolean (True = attend) or additive, broadcastable to (..., L, S). is_causal: a lower
    triangular (top-left aligned) mask. enable_gqa: key/value heads repeated to the query's heads.
    matmul(role, a, b): how each product is computed (``torch.matmul`` by default; the runtime passes its
    sites ``scores`` and ``context``).
    """
    product = matmul if matmul is not None else (lambda role, a, b: torch.matmul(a, b))
    length, source = query.size(-2), key.size(-2)
    factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    key, value = _sdpa_kv_heads({"query": query, "key": key, "value": value, "enable_gqa": enable_gqa})
    scores = product("scores", query, key.transpose(-2, -1)).float() * factor
    if is_causal:
        keep = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return product("context", probs, value)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = dict(zip(_SDPA_ARGS, args, strict=False))
    bound.update(kwargs)
    return bound


def _sdpa_kv_heads(bound: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value with their heads as the products see them: under ``enable_gqa`` (grouped-query
    attention: fewer key/value heads than query heads, each shared by a group of consecutive query heads)
    every key/value head repeated to its group, as ``F.scaled_dot_product_attention`` does; a head count
    that does not divide the query's is the error SDPA itself raises."""
    query, key, value = bound["query"], bound["key"], bound["value"]
    if not bound.get("enable_gqa", False) or query.dim() < 3 or key.size(-3) == query.size(-3):
        return key, value
    heads, kv_heads = query.size(-3), key.size(-3)
    if heads % kv_heads or value.size(-3) != kv_heads:
        raise RuntimeError(
            f"scaled_dot_product_attention with enable_gqa: query heads ({heads}) must be a multiple of "
            f"key heads ({kv_heads}), and value heads ({value.size(-3)}) must equal key heads"
        )
    repeat = heads // kv_heads
    return key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)


def _sdpa_sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[dict, dict]:
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    scores = math.prod(batch) * q.shape[-2] * k.shape[-2]
    out = math.prod(batch) * q.shape[-2] * v.shape[-1]
    return _sizes(q.numel(), k.numel(), scores), _sizes(scores, v.numel(), out)


def _sizes(a: int, b: int, out: int) -> dict[tuple[str, str], int]:
    return {
        ("fprop", "input"): a,
        ("fprop", "weight"): b,
        ("dgrad", "grad_output"): out,
        ("dgrad", "weight"): b,
        ("wgrad", "grad_output"): out,
        ("wgrad", "input"): a,
    }


# -- the interception runtime ------------------------------------------------------------------------

_LINEAR_FUNCS = {F.linear}
_MM_FUNCS = {torch.mm, torch.Tensor.mm}
_ADDMM_FUNCS = {torch.addmm, torch.Tensor.addmm}
_BADDBMM_FUNCS = {torch.baddbmm, torch.Tensor.baddbmm}
_MATMUL_FUNCS = {torch.matmul, torch.Tensor.matmul, torch.bmm, torch.Tensor.bmm}
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
    ("matmul", "mm"): (0, -1),
    ("matmul", "fold"): (-2, -1),
    ("matmul", "batched"): (-2, -1),
    ("sdpa", "batched"): (-2, -1),
}


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
        extra = dict(zip(("beta", "alpha"), args[3:], strict=False)) | kwargs
        bias, a, b = args[0], args[1], args[2]
        rank = 2 if func in _ADDMM_FUNCS else 3
        if extra.get("beta", 1) != 1 or extra.get("alpha", 1) != 1 or a.dim() != rank or b.dim() != rank:
            return None
        return ("mm" if rank == 2 else "batched", a, b, bias)
    a, b = (args[1], args[0]) if func in _RMATMUL_FUNCS else (args[0], args[1])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    layout = _matmul_layout(a, b)
    return None if layout is None else (layout, a, b, None)


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


def _out_numel(layout: str, a: torch.Tensor, b: torch.Tensor) -> int:
    if layout == "linear":
        return a.numel() // max(a.shape[-1], 1) * b.shape[0]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return math.prod(batch) * a.shape[-2] * b.shape[-1]


def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def _static_kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return "conv1d"
    return None


@dataclass
class _Frame:
    name: str
    module: nn.Module
    kind: str | None
    calls: int = 0


@dataclass
class _Attachment:
    name: str
    handler: Callable[..., torch.Tensor]
    storage: torch.dtype | None


@dataclass
class _Discovery:
    """Per-call dataflow tags of the discovery pass (names matmul roles)."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    tags: dict[int, frozenset] = field(default_factory=dict)
    alive: list[torch.Tensor] = field(default_factory=list)

    def tags_of(self, values: Iterable[Any]) -> frozenset:
        found: frozenset = frozenset()
        for value in values:
            if isinstance(value, torch.Tensor):
                found = found | self.tags.get(id(value), frozenset())
        return found

    def tag(self, outputs: Any, tags: frozenset) -> None:
        if not tags:
            return
        for value in _pytree.tree_leaves(outputs):
            if isinstance(value, torch.Tensor):
                self.tags[id(value)] = tags
                self.alive.append(value)


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


class _Mode(TorchFunctionMode):
    def __init__(self, runtime: _Runtime) -> None:
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        runtime = self.runtime
        unfused = _COMPOSITE_FUNCS.get(func)
        if unfused is not None and runtime.stack:
            with self:  # this mode stays on for the GEMMs inside
                return unfused(*args, **kwargs)
        if func in CELLS and runtime.stack and (runtime.discovery is not None or runtime.in_forward()):
            return runtime.recurrent_call(func, args, kwargs)
        if func is torch.einsum and runtime.stack:
            product = _einsum_as_matmul(args, kwargs)
            if product is not None:  # two operands: the matmul it amounts to, a site like any other
                with self:
                    return product()
        if func in _UNINTERCEPTED and runtime.stack:
            runtime.unintercepted(runtime.stack[-1], func, _UNINTERCEPTED[func])
            return func(*args, **kwargs)
        if (
            func in _GROUPED_FUNCS
            and runtime.stack
            and (runtime.discovery is not None or runtime.in_forward())
        ):
            return runtime.grouped_call(func, args, kwargs)
        if runtime.discovery is not None:
            return runtime.discover_call(func, args, kwargs)
        if func not in _GEMM_FUNCS or not runtime.stack or not runtime.in_forward():
            return func(*args, **kwargs)
        return runtime.gemm_call(func, args, kwargs)


class _Interception:
    """The sites' context of one root call (see :mod:`numscope._root_call`).

    Finds the model's matmul sites first where a handler is attached and no forward has found them, then
    pushes the interception mode, unless an enclosing forward of the same model already intercepts (a
    forward nested in another) or no handler is active.
    """

    def __init__(self, runtime: _Runtime, call: RootCall, args: tuple, kwargs: dict) -> None:
        self.runtime = runtime
        self.call: RootCall | None = call
        self.inputs: tuple[tuple, dict] | None = (args, kwargs)
        self.on = False

    def __enter__(self) -> None:
        runtime, call = self.runtime, self.call
        args, kwargs = self.inputs  # type: ignore[misc]
        self.inputs = None
        if runtime.discovery is None and not runtime.discovered and runtime.attachments:
            runtime.discover(args, kwargs)
        calls = runtime.root.calls
        index = calls.index(call) if call in calls else 0
        outer = calls[index - 1].context(runtime.key) if index > 0 else None
        if getattr(outer, "on", False) or not runtime.active():
            return
        runtime.mode.__enter__()
        self.on = True

    def __exit__(self, *exc: object) -> None:
        self.call = None
        if self.on:
            self.on = False
            remove_mode(self.runtime.mode)
            self.runtime.stack.clear()


class _Runtime:
    """The interception state of one model: hooks, module stack, site table, attached handlers."""

    def __init__(self, model: nn.Module) -> None:
        self.model_ref = weakref.ref(model)
        self.attachments: list[_Attachment] = []
        self.stack: list[_Frame] = []
        self.mode = _Mode(self)
        self.discovery: _Discovery | None = None
        self.discovered = False
        self.table: dict[tuple[str, int], tuple[Site, ...]] = {}
        self.order: list[str] = []
        self.sizes: dict[str, dict[tuple[str, str], int]] = {}
        self.on_discovered: list[Callable[[list[Site]], None]] = []
        self.static: dict[int, Site] = {}
        self.named: dict[str, Site] = {}  # sites named for what they compute (MultiheadAttention projections)
        self.skipped: set[tuple[str, str]] = set()  # (module, op) of GEMMs that ran past the handlers
        self._wanted: dict[str, tuple] = {}
        self.hooks: list[Any] = []
        for qualname, module in model.named_modules():
            kind = _static_kind(module)
            if kind is not None:
                self.static[id(module)] = Site(qualname, qualname, kind)
            self.hooks.append(module.register_forward_pre_hook(self._pre_hook(qualname, kind)))
            self.hooks.append(module.register_forward_hook(self._post_hook, always_call=True))
        self.root = RootCalls.of(model)
        self.root_handle = self.root.register(
            lambda call, args, kwargs: _Interception(self, call, args, kwargs), SITES
        )
        self.key = self.root_handle.key

    # hooks
    def intercepting(self) -> bool:
        """Whether the innermost forward of the model pushed the interception mode."""
        calls = self.root.calls
        return bool(calls) and getattr(calls[-1].context(self.key), "on", False)

    def _pre_hook(self, qualname: str, kind: str | None):
        def hook(module: nn.Module, args: Any) -> None:
            if self.intercepting():
                self.stack.append(_Frame(qualname, module, kind))

        return hook

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack and self.stack[-1].module is module and self.intercepting():
            self.stack.pop()

    def in_forward(self) -> bool:
        """Whether the innermost forward is still running (False after a forward was aborted)."""
        return self.root.innermost() is not None

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        self.root_handle.remove()

    # handlers
    def invalidate(self) -> None:
        self._wanted.clear()

    def active(self) -> bool:
        """Whether a forward starting now is intercepted: unless every attached handler defines
        ``active()`` and says False (and none sets a storage dtype); always while finding sites."""
        if self.discovery is not None or not self.attachments:
            return True
        return any(
            a.storage is not None or getattr(a.handler, "active", None) is None or a.handler.active()
            for a in self.attachments
        )

    @property
    def storage(self) -> torch.dtype | None:
        for attachment in reversed(self.attachments):
            if attachment.storage is not None:
                return attachment.storage
        return None

    def handlers_for(self, site: Site) -> tuple[tuple, str]:
        cached = self._wanted.get(site.name)
        if cached is None:
            wanted = tuple(
                a.handler
                for a in self.attachments
                if getattr(a.handler, "wants", None) is None or a.handler.wants(site)
            )
            accumulate = "fp32"
            for attachment in self.attachments:
                chooser = getattr(attachment.handler, "accumulate", None)
                choice = chooser(site) if chooser is not None else None
                if choice is not None:
                    accumulate = choice
            if accumulate not in ACCUMULATORS:
                raise ValueError(
                    f"unknown accumulate {accumulate!r} for site {site.name!r}; "
                    f"allowed: {', '.join(ACCUMULATORS)}"
                )
            cached = (wanted, accumulate)
            self._wanted[site.name] = cached
        return cached

    # sites
    def all_sites(self) -> list[Site]:
        found: dict[str, Site] = {}
        for entry in self.table.values():
            for site in entry:
                found[site.name] = site
        static = {site.name: site for site in self.static.values()} | self.named
        names = [n for n in self.order if n in found or n in static]
        names += [n for n in static if n not in names]
        names += [n for n in found if n not in names]
        return [found.get(n) or static[n] for n in names]

    def anonymous(self, frame: _Frame, kind: str) -> tuple[Site, ...]:
        index = frame.calls
        frame.calls += 1
        entry = self.table.get((frame.name, index))
        if entry is None:
            prefix = f"{frame.name}." if frame.name else ""
            if kind == "sdpa":
                entry = (
                    Site(f"{prefix}call{index}.scores", frame.name, kind),
                    Site(f"{prefix}call{index}.context", frame.name, kind),
                )
            else:
                entry = (Site(f"{prefix}call{index}", frame.name, kind),)
            self.table[(frame.name, index)] = entry
        return entry

    def _site_for(self, frame: _Frame, layout: str, weight: torch.Tensor) -> Site:
        static = self.static.get(id(frame.module))
        if (
            static is not None
            and layout in ("linear", "mm")
            and getattr(frame.module, "weight", None) is weight
        ):
            return static
        named = (
            self._projection(frame, layout, weight)
            or self._own_weight(frame, layout, weight)
            or (self._expert(frame, weight) if layout in ("linear", "mm") else None)
        )
        return named if named is not None else self.anonymous(frame, "matmul")[0]

    def _projection(self, frame: _Frame, layout: str, weight: torch.Tensor) -> Site | None:
        """The named site of a ``MultiheadAttention`` projection: ``out_proj`` (its Linear's own site),
        ``in_proj`` (the packed weight: self-attention), ``in_proj_q``/``in_proj_kv``/``in_proj_k``/
        ``in_proj_v`` (its slices: cross-attention), ``q_proj``/``k_proj``/``v_proj`` (separate weights)."""
        module = frame.module
        if layout != "linear" or not isinstance(module, nn.MultiheadAttention):
            return None
        if weight is module.out_proj.weight:
            return self.static[id(module.out_proj)]
        name = None
        for attribute in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            if weight is getattr(module, attribute, None):
                name = attribute[:6]
        packed = module.in_proj_weight
        if packed is not None and weight is packed:
            name = "in_proj"
        elif packed is not None and weight._base is packed:
            rows = weight.shape[0] // module.embed_dim
            first = (weight.storage_offset() - packed.storage_offset()) // (
                module.embed_dim * packed.shape[1]
            )
            name = "in_proj_kv" if rows == 2 else f"in_proj_{'qkv'[first]}"
        if name is None:
            return None
        qualified = f"{frame.name}.{name}" if frame.name else name
        return self.named.setdefault(qualified, Site(qualified, frame.name, "linear"))

    def _call(self, site: Site, layout: str, upcast: torch.dtype | None = None) -> _Call | None:
        handlers, accumulate = self.handlers_for(site)
        storage = self.storage
        if not handlers and storage is None:
            return None
        share_input = bool(handlers) and all(
            getattr(handler, "shares_input", None) is not None and handler.shares_input(site)
            for handler in handlers
        )
        prequantize = (
            bool(handlers)
            and not share_input
            and layout in ("linear", "fold", "mm")
            and all(getattr(h, "prequantizes_wgrad_input", lambda site: False)(site) for h in handlers)
        )
        axes = _WEIGHT_AXES[(site.kind, layout)]
        return _Call(
            site,
            layout,
            handlers,
            accumulate,
            storage,
            axes,
            share_input=share_input,
            upcast=upcast,
            prequantize=prequantize,
        )

    def gemm_call(self, func, args: tuple, kwargs: dict):
        frame = self.stack[-1]
        parsed = _parse(func, args, kwargs)
        if parsed is None:
            return func(*args, **kwargs)
        layout, a, b, bias = parsed
        if layout == "sdpa":
            return self.sdpa_call(frame, func, args, kwargs)
        if layout == "conv":
            return self.conv_call(frame, func, args, kwargs)
        site = self._site_for(frame, layout, b)
        self.sizes[site.name] = _sizes(a.numel(), b.numel(), _out_numel(layout, a, b))
        call = self._call(site, layout, _upcast(a, b, bias))
        if call is None:
            return func(*args, **kwargs)
        if layout in ("linear", "fold") and a.dim() != 2:
            call.meta["a_fold_strides"] = (
                _fold_strides(a) if a.is_contiguous() or layout == "fold" else (a.shape[-1], 1)
            )
        elif layout == "batched":
            call.meta["batch"] = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
        return SiteGemm.apply(call, a, b, bias)

    def _expert(self, frame: _Frame, weight: torch.Tensor, index: int | None = None) -> Site | None:
        """The site of one expert of a module that keeps its experts' weights stacked in one parameter
        (``experts.gate_up_proj`` of shape (E, …)): named ``<module>.<parameter>.<expert>``, stable from batch
        to batch whatever order the experts are hit in. ``weight`` is the stack (with ``index``) or one
        expert's slice of it."""
        for attribute, parameter in frame.module.named_parameters(recurse=False):
            if parameter.dim() != 3:
                continue
            stack = weight if weight is parameter else weight._base
            if stack is not parameter:
                continue
            if index is None:
                offset = weight.storage_offset() - parameter.storage_offset()
                index = offset // parameter[0].numel()
            prefix = f"{frame.name}." if frame.name else ""
            name = f"{prefix}{attribute}.{index}"
            return self.named.setdefault(name, Site(name, frame.name, "linear"))
        return None

    def _own_weight(self, frame: _Frame, layout: str, weight: torch.Tensor) -> Site | None:
        """A module's own ``weight`` in ``F.linear`` (a router, a custom projection): the module's site."""
        if layout != "linear" or getattr(frame.module, "weight", None) is not weight or not frame.name:
            return None
        return self.named.setdefault(frame.name, Site(frame.name, frame.name, "linear"))

    def linear_site(self, site: Site, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """``F.linear(a, weight, bias)`` as ``site`` (computed plainly while finding sites)."""
        if self.discovery is not None:
            if site.name not in self.order:
                self.order.append(site.name)
            return F.linear(a, weight, bias)
        self.sizes[site.name] = _sizes(a.numel(), weight.numel(), _out_numel("linear", a, weight))
        call = self._call(site, "linear", _upcast(a, weight, bias))
        if call is None:
            return F.linear(a, weight, bias)
        if a.dim() != 2:
            call.meta["a_fold_strides"] = _fold_strides(a) if a.is_contiguous() else (a.shape[-1], 1)
        return SiteGemm.apply(call, a, weight, bias)

    def recurrent_call(self, func, args: tuple, kwargs: dict):
        """An ``nn.LSTM``/``GRU``/``RNN`` unrolled into its ``ih``/``hh`` GEMMs (see numscope.recurrent)."""
        frame = self.stack[-1]
        names = {id(p): name for name, p in frame.module.named_parameters(recurse=False)}
        unrolled = not kwargs and len(args) == 9 and isinstance(args[2], list | tuple)  # not packed
        if unrolled:
            inputs, hx, weights, has_biases, layers, dropout, training, bidirectional, batch_first = args
            expected = layers * (2 if bidirectional else 1) * (4 if has_biases else 2)
            unrolled = len(weights) == expected and all(id(w) in names for w in weights)  # no proj_size
        if not unrolled:
            self.unintercepted(frame, func, "a packed sequence or projected LSTM, fused")
            return func(*args, **kwargs)
        prefix = f"{frame.name}." if frame.name else ""

        def linear(name: str, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
            site = self.named.setdefault(prefix + name, Site(prefix + name, frame.name, "linear"))
            return self.linear_site(site, a, weight, bias)

        return recurrent_reference(
            CELLS[func], [names[id(w)] for w in weights], inputs, hx, weights, has_biases, layers, dropout,
            training, bidirectional, batch_first, linear,
        )  # fmt: skip

    def grouped_call(self, func, args: tuple, kwargs: dict):
        """A grouped GEMM as one ``mm`` site per expert (see :data:`_GROUPED_FUNCS`)."""
        frame = self.stack[-1]
        bound = dict(zip(("mat_a", "mat_b", "offs", "bias", "out_dtype"), args, strict=False)) | kwargs
        a, b, offs = bound["mat_a"], bound["mat_b"], bound.get("offs")
        sites = [self._expert(frame, b, index) for index in range(b.shape[0])] if b.dim() == 3 else []
        usable = a.dim() == 2 and offs is not None and bound.get("bias") is None and None not in sites
        if not usable or bound.get("out_dtype") not in (None, a.dtype):
            self.unintercepted(frame, func, "a grouped GEMM of a layout numscope does not split")
            return func(*args, **kwargs)
        ends = offs.tolist()
        pieces, start = [], 0
        for index, end in enumerate(ends):
            if end > start:
                site, expert, rows = sites[index], b[index], a[start:end]
                self.sizes[site.name] = _sizes(rows.numel(), expert.numel(), rows.shape[0] * expert.shape[1])
                if self.discovery is not None:  # finding sites: in call order, computed as they are
                    if site.name not in self.order:
                        self.order.append(site.name)
                    call = None
                else:
                    call = self._call(site, "mm", _upcast(a, b))
                pieces.append(
                    torch.mm(rows, expert) if call is None else SiteGemm.apply(call, rows, expert, None)
                )
            start = max(start, end)
        if start < a.shape[0]:  # rows past the last offset: zeros, as the grouped kernel leaves them
            pieces.append(a.new_zeros(a.shape[0] - start, b.shape[-1]))
        return torch.cat(pieces) if pieces else a.new_zeros(a.shape[0], b.shape[-1])

    def unintercepted(self, frame: _Frame, func: Callable[..., Any], what: str) -> None:
        """Warn once per module and op that a GEMM runs past numscope (unquantized, unobserved)."""
        name = getattr(func, "__name__", str(func))
        key = (frame.name, name)
        if key in self.skipped:
            return
        self.skipped.add(key)
        where = frame.name or type(frame.module).__name__
        warnings.warn(
            f"numscope: {where} runs {what} ({name}), which numscope does not intercept: it is neither "
            "quantized by a plan nor observed",
            UserWarning,
            stacklevel=2,
        )

    def conv_call(self, frame: _Frame, func, args: tuple, kwargs: dict):
        parsed = _ConvParams.of(func, args, kwargs)
        if parsed is None:  # padding='same'/'valid': left to torch, and said
            self.unintercepted(frame, func, "a string padding ('same', 'valid')")
            return func(*args, **kwargs)
        params, bound = parsed
        x, weight, bias = bound["input"], bound["weight"], bound.get("bias")
        site = self._conv_site(frame, weight)
        self.sizes[site.name] = _sizes(x.numel(), weight.numel(), 0)
        call = self._call(site, "conv", _upcast(x, weight, bias))
        if call is None:
            return func(*args, **kwargs)
        if call.accumulate != "fp32":
            raise ValueError(
                f"site {site.name!r}: accumulate {call.accumulate!r} is not emulated for convolutions; "
                "give conv sites accumulate fp32 in the plan"
            )
        unbatched = x.dim() == params.dims + 1  # F.conv* accepts an input without a batch axis
        if unbatched:
            x = x.unsqueeze(0)
        out = SiteConv.apply(call, params, x, weight, bias)
        self.sizes[site.name] = _sizes(x.numel(), weight.numel(), out.numel())
        return out.squeeze(0) if unbatched else out

    def _conv_is_static(self, frame: _Frame, weight: torch.Tensor) -> bool:
        """Whether a convolution is its module's own (a Conv/ConvTranspose layer with this weight)."""
        static = self.static.get(id(frame.module))
        return (
            static is not None and static.kind == "conv" and getattr(frame.module, "weight", None) is weight
        )

    def _conv_site(self, frame: _Frame, weight: torch.Tensor) -> Site:
        if self._conv_is_static(frame, weight):
            return self.static[id(frame.module)]
        return self.anonymous(frame, "conv")[0]

    def sdpa_call(self, frame: _Frame, func, args: tuple, kwargs: dict):
        scores_site, context_site = self.anonymous(frame, "sdpa")
        bound = _sdpa_arguments(args, kwargs)
        q, k, v = bound["query"], *_sdpa_kv_heads(bound)
        self.sizes[scores_site.name], self.sizes[context_site.name] = _sdpa_sizes(q, k, v)
        calls = {"scores": self._call(scores_site, "batched"), "context": self._call(context_site, "batched")}
        if all(c is None for c in calls.values()):
            return func(*args, **kwargs)
        upcast = _upcast(q, k, v)
        if (
            upcast is not None
        ):  # as the fp32 mode below would: float32 copies, the result in the working dtype
            for name in ("query", "key", "value"):
                if bound[name].dtype in _LOW:
                    bound[name] = bound[name].float()

        def matmul(role: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            call = calls[role]
            if call is None:
                return torch.matmul(a, b)
            call.meta["batch"] = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
            return SiteGemm.apply(call, a, b, None)

        out = sdpa_reference(**bound, matmul=matmul)
        return out if upcast is None else out.to(upcast)

    # discovery
    def discover(self, args: tuple, kwargs: dict) -> list[Site]:
        """Run the model once without gradients, in eval mode, to find and name its matmul sites."""
        model = self.model_ref()
        if model is None:
            raise RuntimeError("the model of this runtime no longer exists")
        training = {name: module.training for name, module in model.named_modules()}
        self.discovery = _Discovery()
        self.table.clear()
        self.order.clear()
        try:
            with fork_rng(), torch.no_grad():
                model.eval()
                model(*args, **kwargs)
        finally:
            for name, module in model.named_modules():
                module.training = training.get(name, module.training)
            discovery, self.discovery = self.discovery, None
        self._name_entries(discovery)
        self.discovered = True
        self.invalidate()
        found = self.all_sites()
        for callback in list(self.on_discovered):
            callback(found)
        return found

    def discover_call(self, func, args: tuple, kwargs: dict):
        discovery = self.discovery
        assert discovery is not None
        inputs = _pytree.tree_leaves((args, kwargs))
        out = func(*args, **kwargs)
        frame = self.stack[-1] if self.stack else None
        if frame is None:
            return out
        if func in _SOFTMAX_FUNCS:
            for tag in discovery.tags_of(inputs):
                if tag[0] == "gemm" and discovery.entries[tag[1]]["module"] == frame.name:
                    discovery.entries[tag[1]]["role"] = "scores"
            discovery.tag(out, frozenset({("softmax", frame.name)}))
            return out
        gemm = self._discover_gemm(func, args, kwargs, frame, discovery)
        if gemm is None:
            discovery.tag(out, discovery.tags_of(inputs))
            return out
        discovery.tag(out, frozenset({("gemm", gemm)}))
        return out

    def _discover_gemm(self, func, args, kwargs, frame: _Frame, discovery: _Discovery) -> int | None:
        parsed = _parse(func, args, kwargs) if func in _GEMM_FUNCS else None
        if parsed is None:
            return None
        layout, a, b, _ = parsed
        if layout == "conv":
            b = args[1] if len(args) > 1 else kwargs.get("weight")
        if layout in ("sdpa", "conv") and not (layout == "conv" and self._conv_is_static(frame, b)):
            discovery.entries.append({"module": frame.name, "index": frame.calls, "role": layout})
            self.order.append(f"@{len(discovery.entries) - 1}")
            frame.calls += 1
            return None
        static = self.static.get(id(frame.module))
        allowed = (
            ("linear", "mm", "conv") if static is not None and static.kind == "conv" else ("linear", "mm")
        )
        if static is None or layout not in allowed or getattr(frame.module, "weight", None) is not b:
            static = (
                self._projection(frame, layout, b)
                or self._own_weight(frame, layout, b)
                or (self._expert(frame, b) if layout in ("linear", "mm") else None)
            )
        if static is not None:
            if static.name not in self.order:
                self.order.append(static.name)
            return None
        context = ("softmax", frame.name) in discovery.tags_of([a])
        discovery.entries.append(
            {"module": frame.name, "index": frame.calls, "role": "context" if context else None}
        )
        self.order.append(f"@{len(discovery.entries) - 1}")
        frame.calls += 1
        return len(discovery.entries) - 1

    def _name_entries(self, discovery: _Discovery) -> None:
        per_module: dict[str, list[dict[str, Any]]] = {}
        for entry in discovery.entries:
            per_module.setdefault(entry["module"], []).append(entry)
        names: dict[int, tuple[Site, ...]] = {}
        for module, entries in per_module.items():
            prefix = f"{module}." if module else ""
            counts = {"scores": 0, "context": 0}
            for entry in entries:
                if entry["role"] == "sdpa":
                    counts["scores"] += 1
                    counts["context"] += 1
                elif entry["role"] in counts:
                    counts[entry["role"]] += 1
            seen = {"scores": 0, "context": 0}
            anonymous = convolutions = 0

            def role_name(role: str, prefix: str = prefix, counts: dict = counts, seen: dict = seen) -> str:
                suffix = str(seen[role]) if counts[role] > 1 else ""
                seen[role] += 1
                return f"{prefix}{role}{suffix}"

            for entry in entries:
                key = (module, entry["index"])
                if entry["role"] == "sdpa":
                    site = (
                        Site(role_name("scores"), module, "sdpa"),
                        Site(role_name("context"), module, "sdpa"),
                    )
                elif entry["role"] == "conv":
                    site = (Site(f"{prefix}conv{convolutions}", module, "conv"),)
                    convolutions += 1
                elif entry["role"] in counts:
                    site = (Site(role_name(entry["role"]), module, "matmul"),)
                else:
                    site = (Site(f"{prefix}matmul{anonymous}", module, "matmul"),)
                    anonymous += 1
                self.table[key] = site
                names[id(entry)] = site
        order: list[str] = []
        for item in self.order:
            if item.startswith("@"):
                order.extend(s.name for s in names[id(discovery.entries[int(item[1:])])])
            elif item not in order:
                order.append(item)
        self.order = order


_RUNTIMES: weakref.WeakKeyDictionary[nn.Module, _Runtime] = weakref.WeakKeyDictionary()


def _runtime(model: nn.Module) -> _Runtime | None:
    return _RUNTIMES.get(model)


class Handle:
    """An attached handler; :meth:`remove` detaches it (the last removal restores the model exactly)."""

    def __init__(self, model: nn.Module, attachment: _Attachment) -> None:
        self._model = weakref.ref(model)
        self._attachment = attachment
        self.name = attachment.name

    @property
    def attached(self) -> bool:
        model = self._model()
        runtime = None if model is None else _RUNTIMES.get(model)
        return runtime is not None and self._attachment in runtime.attachments

    def remove(self) -> None:
        model = self._model()
        runtime = None if model is None else _RUNTIMES.get(model)
        if runtime is None or self._attachment not in runtime.attachments:
            return
        runtime.attachments.remove(self._attachment)
        runtime.invalidate()
        if not runtime.attachments:
            runtime.remove()
            del _RUNTIMES[model]


def _example_call(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple | list):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def sites(model: nn.Module, example_inputs: dict | tuple | torch.Tensor | None = None) -> list[Site]:
    """Every GEMM site of ``model``, in call order where a forward pass was seen.

    Without ``example_inputs`` only Linear/Conv1D sites are listed (and matmul sites already found by an
    attached model's first forward). With them, one forward runs without gradients in eval mode (the RNG
    state and training flags restored) to find the matmul sites: a dict is passed as keyword arguments, a
    tuple as positional ones, anything else as the one argument.
    """
    runtime = _runtime(model)
    if example_inputs is None:
        if runtime is not None:
            return runtime.all_sites()
        runtime = _Runtime(model)
        runtime.remove()
        return runtime.all_sites()
    temporary = runtime is None
    runtime = _Runtime(model) if runtime is None else runtime
    try:
        args, kwargs = _example_call(example_inputs)
        return runtime.discover(args, kwargs)
    finally:
        if temporary:
            runtime.remove()


def attach(
    model: nn.Module,
    handler: OperandHandler | Callable[..., torch.Tensor],
    *,
    name: str,
    storage: str | None = None,
) -> Handle:
    """Route every site operand of ``model`` through ``handler`` (after handlers attached before it).

    name: identifies the attachment (unique per model). storage: ``"fp16"``/``"bf16"``/``"fp32"``: the
    dtype in which site activations saved for backward are kept (parameters are kept as they are); the
    latest attachment that sets one wins. Parameters and ``state_dict`` keys are untouched; removing the
    last handle removes every hook.
    """
    if not callable(handler):
        raise TypeError(
            f"handler must be callable(site, gemm, operand, tensor, axis), got {type(handler).__name__}"
        )
    if storage is not None and storage not in STORAGE_DTYPES:
        raise ValueError(f"unknown storage {storage!r}; allowed: None, {', '.join(STORAGE_DTYPES)}")
    runtime = _runtime(model)
    if runtime is None:
        runtime = _Runtime(model)
        _RUNTIMES[model] = runtime
    if any(a.name == name for a in runtime.attachments):
        raise ValueError(
            f"a handler named {name!r} is already attached to this model; attached: "
            f"{', '.join(a.name for a in runtime.attachments)}"
        )
    attachment = _Attachment(name, handler, STORAGE_DTYPES[storage] if storage is not None else None)
    runtime.attachments.append(attachment)
    runtime.invalidate()
    return Handle(model, attachment)


def attached(model: nn.Module) -> list[str]:
    """Names of the handlers attached to ``model``, in chain order."""
    runtime = _runtime(model)
    return [] if runtime is None else [a.name for a in runtime.attachments]


def operand_sizes(model: nn.Module) -> dict[str, dict[tuple[str, str], int]]:
    """Per site, ``(gemm, operand)`` → element count, from the latest forward of an attached model."""
    runtime = _runtime(model)
    if runtime is None:
        return {}
    return {name: dict(sizes) for name, sizes in runtime.sizes.items()}


def on_discovered(model: nn.Module, callback: Callable[[list[Site]], None]) -> None:
    """Call ``callback(sites)`` whenever an attached ``model``'s matmul sites are (re)discovered."""
    runtime = _runtime(model)
    if runtime is None:
        raise ValueError("on_discovered needs a model with an attached handler (numscope.sites.attach)")
    runtime.on_discovered.append(callback)


def is_discovered(model: nn.Module) -> bool:
    """Whether an attached ``model``'s matmul sites have been found by a forward pass."""
    runtime = _runtime(model)
    return runtime is not None and runtime.discovered


def forward_has_grad(model: nn.Module) -> bool:
    """Whether the forward of ``model`` now running began with gradients enabled (a training forward;
    evaluation runs under ``torch.no_grad()``). Handlers are called inside an autograd function, where
    ``torch.is_grad_enabled()`` is always False, so they ask here. True outside a forward."""
    runtime = _runtime(model)
    calls = [] if runtime is None else runtime.root.calls
    return not calls or calls[-1].grad_enabled


def refresh(model: nn.Module) -> None:
    """Ask the attached handlers' ``wants(site)`` again at the next site call (answers are cached per site;
    a handler whose answer changes, such as an observer between sampled and skipped steps, calls this)."""
    runtime = _runtime(model)
    if runtime is not None:
        runtime.invalidate()


from numscope._callable import make_callable as _make_callable  # noqa: E402

_make_callable(__name__, "sites")
