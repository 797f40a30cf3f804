"""Ops kept in FP32 while a model computes in fp16/bf16.

Micikevicius et al., "Mixed Precision Training" (2018), §3.3: large reductions (sums over a vector, as in
softmax and normalisation statistics) must accumulate in FP32, and point-wise ops whose results leave
fp16's range (exp, log, pow…) lose everything in fp16. ``torch.autocast`` encodes the same rule as its
list of CUDA ops that "autocast to float32" (``AT_FORALL_FP32`` and ``AT_FORALL_FP32_SET_OPT_DTYPE`` in
``aten/src/ATen/autocast_mode.h``). :data:`FP32_OPS` is that list at the Python level, grouped, plus the
reductions CUDA kernels accumulate in fp32 anyway (``mean``, ``var``, ``std``) and ``rms_norm``.

:func:`keep_fp32_ops` applies it during a model's forward with ``torch.autocast``'s rules:

* an op of :data:`FP32_OPS` whose floating tensor arguments include fp16/bf16 runs on fp32 copies of them
  and returns its fp32 result (ops called with an explicit ``dtype=`` are left alone, as autocast does);
* a GEMM (``F.linear``, ``matmul``/``@``, ``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``einsum``, ``conv``,
  ``F.scaled_dot_product_attention``) with an operand in the working dtype runs on fp32 copies of its
  operands (exact: every fp16/bf16 value is a float32 value) and its result is rounded to the working
  dtype: FP16 multiplication with FP32 accumulation, written in FP16 (the paper's §3.2, what tensor cores
  do). Torch's own CPU fp16 GEMM gives no such guarantee and, without AVX512-FP16, is much slower than
  float32. A GEMM whose operands are all fp32 (a layer kept in fp32) runs as called;
* every other op runs as called (torch's type promotion).

The casts are ordinary autograd ops: backward runs each kept op in fp32 too, GEMM gradients accumulate in
fp32, and every gradient returns to the working dtype at its cast. GEMMs that are :mod:`numscope.sites`
sites of a converted or observed model are left to the site function, whose mode sits above this one:
its handlers see the parameters themselves (so site names, plan rules and weight reuse are those of an
fp32 model), and it multiplies float32 values with the result in the working dtype, as this mode would
(:meth:`Fp32Ops.fp32_gemm_dtype`); a plan's quantized operands enter those products unrounded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

from numscope._root_call import OUTSIDE_SITES, RootCalls, RootHandle

__all__ = ["FP32_OPS", "GEMM_OPS", "Fp32Ops", "keep_fp32_ops"]

_T = torch.Tensor

FP32_OPS: dict[str, tuple[Callable[..., Any], ...]] = {
    "softmax": (torch.softmax, _T.softmax, F.softmax, F.softmin, torch.log_softmax, _T.log_softmax,
                F.log_softmax),
    "normalisation": (F.layer_norm, torch.layer_norm, F.group_norm, torch.group_norm, F.rms_norm,
                      torch.rms_norm, F.normalize),
    "loss": (F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
             F.binary_cross_entropy_with_logits, F.poisson_nll_loss, F.cosine_embedding_loss,
             F.hinge_embedding_loss, F.margin_ranking_loss, F.multilabel_margin_loss, F.soft_margin_loss,
             F.triplet_margin_loss, F.multi_margin_loss),
    "reduction": (torch.sum, _T.sum, torch.mean, _T.mean, torch.var, _T.var, torch.std, _T.std, torch.prod,
                  _T.prod, torch.cumsum, _T.cumsum, torch.cumprod, _T.cumprod, torch.norm, _T.norm,
                  torch.linalg.vector_norm, torch.linalg.matrix_norm, torch.linalg.norm, torch.logsumexp,
                  _T.logsumexp, torch.dist, _T.dist, torch.cdist, F.pdist, torch.renorm, _T.renorm),
    "pointwise": (torch.exp, _T.exp, torch.expm1, _T.expm1, torch.log, _T.log, torch.log2, _T.log2,
                  torch.log10, _T.log10, torch.log1p, _T.log1p, torch.pow, _T.pow, _T.__pow__, _T.__rpow__,
                  torch.reciprocal, _T.reciprocal, _T.__rtruediv__, torch.rsqrt, _T.rsqrt, torch.acos,
                  _T.acos, torch.asin, _T.asin, torch.cosh, _T.cosh, torch.sinh, _T.sinh, torch.tan, _T.tan,
                  torch.erfinv, _T.erfinv, F.softplus, F.cosine_similarity),
}  # fmt: skip
"""The ops kept in fp32, by group (the torch callables a ``TorchFunctionMode`` sees)."""

GEMM_OPS: frozenset[Callable[..., Any]] = frozenset(
    {F.linear, torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.mm, _T.mm, torch.bmm, _T.bmm,
     torch.addmm, _T.addmm, torch.baddbmm, _T.baddbmm, torch.addbmm, _T.addbmm, torch.einsum, F.conv1d,
     F.conv2d, F.conv3d, F.scaled_dot_product_attention}
)  # fmt: skip
"""GEMMs: run on fp32 copies of working-dtype operands, the result rounded to the working dtype."""

_LOW = (torch.float16, torch.bfloat16)


def _floating(values: Any) -> list[Tensor]:
    return [v for v in _pytree.tree_leaves(values) if isinstance(v, Tensor) and v.is_floating_point()]


def _cast(values: Any, source: tuple[torch.dtype, ...], target: torch.dtype) -> Any:
    return _pytree.tree_map(
        lambda v: v.to(target) if isinstance(v, Tensor) and v.dtype in source else v, values
    )


class Fp32Ops(TorchFunctionMode):
    """The ``TorchFunctionMode`` of :func:`keep_fp32_ops` (see the module docstring for its rules).

    dtype: the working dtype (``torch.float16`` or ``torch.bfloat16``). ops: the ops kept in fp32.
    live: asked before an op is changed; while it says False every call passes through as called (the
    forward the mode was opened for has ended: :func:`keep_fp32_ops` passes its forward's liveness).
    """

    def __init__(
        self, dtype: torch.dtype, ops: Iterable[Callable[..., Any]], live: Callable[[], bool] | None = None
    ) -> None:
        super().__init__()
        if dtype not in _LOW:
            raise ValueError(f"the working dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
        self.dtype = dtype
        self.ops = frozenset(ops)
        self.live = live

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.ops and kwargs.get("dtype") is None:
            if any(t.dtype in _LOW for t in _floating((args, kwargs))) and self._live():
                args, kwargs = _cast((args, kwargs), _LOW, torch.float32)
        elif (
            func in GEMM_OPS
            and any(t.dtype == self.dtype for t in _floating((args, kwargs)))
            and self._live()
        ):
            args, kwargs = _cast((args, kwargs), _LOW, torch.float32)
            return _cast(func(*args, **kwargs), (torch.float32,), self.dtype)
        return func(*args, **kwargs)

    def _live(self) -> bool:
        return self.live is None or self.live()

    def fp32_gemm_dtype(self) -> torch.dtype | None:
        """The working dtype whose GEMMs :mod:`numscope.sites` computes on float32 values when it
        intercepts them above this mode (its site function does what this mode does to a GEMM)."""
        return self.dtype if self._live() else None


def resolve_ops(ops: Iterable[Callable[..., Any]] | None) -> frozenset[Callable[..., Any]]:
    """The ops to keep in fp32: every op of :data:`FP32_OPS` for ``None``, else ``ops``, checked."""
    if ops is None:
        return frozenset(op for group in FP32_OPS.values() for op in group)
    if isinstance(ops, str) or not isinstance(ops, Iterable):
        raise TypeError(f"fp32 ops must be an iterable of torch callables such as torch.softmax, got {ops!r}")
    resolved = frozenset(ops)
    for op in resolved:
        if not callable(op):
            raise TypeError(f"fp32 ops must be torch callables such as torch.softmax, got {op!r}")
    return resolved


def keep_fp32_ops(
    model: nn.Module, dtype: torch.dtype, ops: Iterable[Callable[..., Any]] | None = None
) -> RootHandle:
    """Keep ``ops`` (default: every op of :data:`FP32_OPS`) in fp32 during each forward of ``model``.

    dtype: the model's working dtype (fp16 or bf16): GEMMs with an operand in it accumulate in fp32 and
    return it. Returns a handle whose ``remove()`` ends it.
    """
    resolved = resolve_ops(ops)
    Fp32Ops(dtype, resolved)  # validate now, not at the first forward
    return RootCalls.of(model).register(
        lambda call, args, kwargs: Fp32Ops(dtype, resolved, live=call.is_live), OUTSIDE_SITES
    )
