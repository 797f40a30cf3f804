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
``nn.LSTM``/``GRU``/``RNN`` are unrolled (:mod:`numscope.sites.rnn`) into ``<rnn>.ih_l0`` and
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
the raw one and passes it to wgrad without calling the chain again; ``shares_weight(site) -> bool`` does
the same for dgrad's weight where that weight is an activation (the right operand of ``scores`` and
``context``, a product of two activations); the last handler's ``pack(site, tensor)`` may then keep
either in its codes (see :class:`numscope.sites.gemm._Call.pack`). A handler may also define
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

from numscope.sites.api import (
    Handle,
    active_handlers,
    attach,
    attached,
    forward_has_grad,
    is_discovered,
    on_discovered,
    operand_sizes,
    recomputing,
    refresh,
    sites,
)
from numscope.sites.conv import ConvCall, SiteConv, current_conv
from numscope.sites.gemm import (
    ACCUMULATE_CHUNK,
    ACCUMULATORS,
    STORAGE_DTYPES,
    Accumulator,
    OperandHandler,
    Site,
    SiteGemm,
    accumulate_matmul,
    register_factors,
)
from numscope.sites.sdpa import sdpa_reference
from numscope.vocab import GEMMS

__all__ = [
    "ACCUMULATE_CHUNK",
    "ACCUMULATORS",
    "GEMMS",
    "STORAGE_DTYPES",
    "Accumulator",
    "ConvCall",
    "Handle",
    "OperandHandler",
    "Site",
    "SiteConv",
    "SiteGemm",
    "accumulate_matmul",
    "active_handlers",
    "attach",
    "attached",
    "current_conv",
    "forward_has_grad",
    "is_discovered",
    "on_discovered",
    "operand_sizes",
    "recomputing",
    "refresh",
    "register_factors",
    "sdpa_reference",
    "sites",
]

from numscope._callable import make_callable as _make_callable

_make_callable(__name__, "sites")
