"""Dropout whose mask is kept for backward in one bit per element, with torch's CPU results bit for bit.

On the CPU torch's ``F.dropout`` keeps a mask as large as its input, in the input's dtype (four bytes per
element in float32): ``noise = empty_like(x).bernoulli_(1 - p); noise.div_(1 - p); x * noise``, and
backward multiplies the gradient by ``noise`` (``_dropout_impl`` in ``aten/src/ATen/native/Dropout.cpp``;
CUDA's fused ``native_dropout`` keeps a one-byte boolean mask instead). :class:`BitDropout` draws the same
noise from the same generator in the same order, so its output is torch's bit for bit, and keeps only which
elements survived, eight to a byte; backward rebuilds ``noise`` with the same two ops and multiplies, as
torch does. :class:`CompactDropout` routes a model's ``F.dropout`` calls there: CPU tensors that need a
gradient, in training, 0 < p < 1, not in place; every other call runs as torch's own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["BitDropout", "CompactDropout", "pack_bits", "unpack_bits"]

_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(mask: Tensor) -> Tensor:
    """A boolean tensor's elements (in row-major order) eight to a ``uint8``, the first in bit 0."""
    flat = mask.reshape(-1)
    padded = F.pad(flat, (0, -flat.numel() % 8)) if flat.numel() % 8 else flat
    return (padded.view(-1, 8).to(torch.uint8) * _WEIGHTS.to(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, shape: torch.Size) -> Tensor:
    """The boolean tensor of ``shape`` that :func:`pack_bits` packed."""
    bits = packed.unsqueeze(1).bitwise_and(_WEIGHTS.to(packed.device)).ne(0)
    count = shape.numel()
    return bits.reshape(-1)[:count].reshape(shape)


class BitDropout(torch.autograd.Function):
    """``F.dropout(x, p, training=True)`` on the CPU, the mask kept in bits (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:  # type: ignore[override]
        noise = torch.empty_like(x).bernoulli_(1 - p)
        ctx.save_for_backward(pack_bits(noise.bool()))
        ctx.p = p
        ctx.layout = (x.shape, x.dtype, x.stride())
        return x * noise.div_(1 - p)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (packed,) = ctx.saved_tensors
        shape, dtype, stride = ctx.layout
        mask = unpack_bits(packed, shape)
        noise = torch.empty_strided(shape, stride, dtype=dtype, device=grad.device)
        noise.copy_(mask).div_(1 - ctx.p)
        return grad * noise, None


def _dropout_args(args: tuple, kwargs: dict) -> tuple[Tensor, float, bool, bool]:
    names = ("input", "p", "training", "inplace")
    values = dict(zip(names, (None, 0.5, True, False), strict=True))
    values.update(zip(names, args, strict=False))
    values.update(kwargs)
    return values["input"], values["p"], values["training"], values["inplace"]


class CompactDropout(TorchFunctionMode):
    """Run ``F.dropout`` through :class:`BitDropout` where it applies; ``live``: asked first (while it says
    False every call runs as torch's own)."""

    def __init__(self, live: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self.live = live

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            x, p, training, inplace = _dropout_args(args, kwargs)
            if (
                training
                and not inplace
                and isinstance(x, Tensor)
                and x.is_floating_point()
                and x.device.type == "cpu"
                and x.requires_grad
                and torch.is_grad_enabled()
                and isinstance(p, float | int)
                and 0 < p < 1
                and (self.live is None or self.live())
            ):
                return BitDropout.apply(x, float(p))
        return func(*args, **kwargs)
