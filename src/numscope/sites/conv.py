"""Convolutions as sites: the GEMMs of their im2col form, one autograd function (:class:`SiteConv`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from numscope.sites.gemm import _Call, _store
from numscope.vocab import Gemm, Operand

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
        """The parameters of a ``F.conv*`` call and its bound arguments, or ``None`` where torch itself would
        refuse them (a string padding other than 'same' and 'valid', 'same' with a stride).

        A string padding becomes numbers as torch's ``_convolution_mode`` computes them: 'valid' is 0;
        'same' pads each side by ``dilation · (kernel − 1) // 2`` and, where that total is odd, the input by
        one more zero at the end of the axis (``bound["input"]`` is then that padded input), as torch does."""
        dims, transposed = _CONV_FUNCS[func]
        bound = dict(zip(_CONV_TRANSPOSE_ARGS if transposed else _CONV_ARGS, args, strict=False)) | kwargs

        def tuple_of(value: Any, default: int) -> tuple[int, ...]:
            value = default if value is None else value
            return tuple(value) if isinstance(value, list | tuple) else (int(value),) * dims

        stride, dilation = tuple_of(bound.get("stride"), 1), tuple_of(bound.get("dilation"), 1)
        padding = bound.get("padding", 0)
        if isinstance(padding, str):
            if transposed or padding not in ("same", "valid"):
                return None
            if padding == "valid":
                padding = 0
            else:
                if any(s != 1 for s in stride):
                    return None  # torch refuses 'same' with a stride
                kernel = tuple(bound["weight"].shape[2:])
                totals = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
                padding = tuple(total // 2 for total in totals)
                extra = [total - 2 * left for total, left in zip(totals, padding, strict=True)]
                if any(extra):  # F.pad's order: the last axis first, (start, end) each
                    pad = [amount for e in reversed(extra) for amount in (0, e)]
                    bound["input"] = torch.nn.functional.pad(bound["input"], pad)
        params = cls(
            dims,
            transposed,
            stride,
            tuple_of(padding, 0),
            dilation,
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


@dataclass(frozen=True)
class ConvCall:
    """The convolution a handler is being called for (:func:`current_conv`): its geometry and the shapes of
    its input and weight, so that a handler can compute the convolution's own products, e.g. of a few batch
    entries of quantized operands (the observer's backward error of a convolution)."""

    params: _ConvParams
    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """fprop's product: the convolution of ``x`` (any batch size) with ``weight``, no bias."""
        return self.params.convolve(x, weight, None)

    def grad_input(self, grad_output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """dgrad's product: the input gradient of ``grad_output`` (any batch size) through ``weight``."""
        shape = (grad_output.shape[0], *self.input_shape[1:])
        x = torch.zeros(shape, dtype=grad_output.dtype, device=grad_output.device)  # its shape only
        return self.params.gradients(grad_output, x, weight, (True, False, False))[0]

    def grad_weight(self, grad_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """wgrad's product: the weight gradient of ``grad_output`` and ``x`` (the same batch entries)."""
        weight = torch.zeros(self.weight_shape, dtype=x.dtype, device=x.device)  # its shape only
        return self.params.gradients(grad_output, x, weight, (False, True, False))[1]


_CURRENT: ContextVar[ConvCall | None] = ContextVar("numscope_conv_call", default=None)


def current_conv() -> ConvCall | None:
    """Inside a handler's call for a convolution site, that convolution; None for every other site."""
    return _CURRENT.get()


@contextmanager
def _calling(params: _ConvParams, x: torch.Tensor, weight: torch.Tensor) -> Iterator[None]:
    token = _CURRENT.set(ConvCall(params, tuple(x.shape), tuple(weight.shape)))
    try:
        yield
    finally:
        _CURRENT.reset(token)


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
        with _calling(params, x, weight):
            x_q = call.chain(Gemm.FPROP, Operand.INPUT, x, 1)
            w_q = call.chain(Gemm.FPROP, Operand.WEIGHT, weight, fprop_w_axis)
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
            with _calling(params, x, weight):
                dy = call.chain(Gemm.DGRAD, Operand.GRAD_OUTPUT, grad_output, 1)
                w_q = call.chain(Gemm.DGRAD, Operand.WEIGHT, weight, dgrad_w_axis)
            grad_x = params.gradients(dy, x.to(dy.dtype), w_q, (True, False, False))[0]
        if need_w:
            with _calling(params, x, weight):
                dy = call.chain(Gemm.WGRAD, Operand.GRAD_OUTPUT, grad_output, 0)
                x_q = call.chain(Gemm.WGRAD, Operand.INPUT, x, 0)
            grad_w = params.gradients(dy, x_q, weight.to(dy.dtype), (False, True, False))[1]
        if need_bias and ctx.dtypes[2] is not None:  # from the unquantized grad_output, as autograd sums it
            channels = [weight.shape[1] * params.groups if params.transposed else weight.shape[0]]
            grad_bias = params.gradients(grad_output, x, weight, (False, False, True), channels)[2]
            grad_bias = grad_bias.to(ctx.dtypes[2])
        if call.upcast is not None:
            grad_x = None if grad_x is None else grad_x.to(ctx.dtypes[0])
            grad_w = None if grad_w is None else grad_w.to(ctx.dtypes[1])
        return None, None, grad_x, grad_w, grad_bias
