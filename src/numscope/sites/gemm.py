"""Sites, their GEMMs and the one autograd function every intercepted GEMM runs through (:class:`SiteGemm`),
with exact replicas of autograd's mm backward and emulated narrow accumulation."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from numscope._root_call import save_exactly
from numscope.formats import native
from numscope.vocab import GEMMS, Gemm, Operand

#: number of products summed exactly (in fp32) before a rounding to a narrow accumulator
ACCUMULATE_CHUNK = 32
#: the memory the chunk sums of one narrow-accumulated GEMM take at once (bytes): a larger output is computed
#: in slices of its rows (at least :data:`SLICE_MIN_ROWS`), whose chunk sums go to one buffer per thread that
#: is reused from call to call (:data:`REUSE_PARTIALS`). Sums written and read back while still in cache,
#: into pages already mapped, took the fp22 GEMMs of BERT-base's and the benchmarks' shapes from 3.8x to
#: 2.3x a plain matmul (geometric mean of 8 shapes, one thread: ``benchmarks/bench_accumulate.py``). The
#: buffer stays for the thread's life: the larger of 16 MiB and SLICE_MIN_ROWS rows' chunk sums (94 MiB
#: for a 30,522-word head over a hidden size of 768)
PARTIALS_BYTES = 16 * 2**20
SLICE_MIN_ROWS = 32
REUSE_PARTIALS = True
_PARTIALS = threading.local()


def _partials_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` for chunk sums on ``device``, in this thread's reused buffer (grown as
    needed)."""
    count = math.prod(shape)
    buffer = getattr(_PARTIALS, "buffer", None)
    if buffer is None or buffer.dtype != dtype or buffer.device != device or buffer.numel() < count:
        buffer = torch.empty(count, dtype=dtype, device=device)
        _PARTIALS.buffer = buffer
    return buffer[:count].view(shape)


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


class _Factors(NamedTuple):
    """A registered operand's codes and decode scales, viewed as the operand is, and the extent along its
    contraction axis over which the decode scale is constant by construction (None: not known)."""

    codes: torch.Tensor
    decode: torch.Tensor
    constant_run: int | None


#: quantized operands whose element codes and per-element decode scales a GEMM may take (register_factors):
#: a weak reference to the values, the codes, the decode scales and the tile of the decode scales
_FACTORS: dict[int, tuple[weakref.ref, torch.Tensor, torch.Tensor, tuple[int, int] | None]] = {}


def register_factors(
    values: torch.Tensor, codes: torch.Tensor, decode: torch.Tensor, tile: tuple[int, int] | None = None
) -> None:
    """Tell the GEMMs that ``values`` (a quantized operand, a contiguous tensor that is no view) is
    ``codes · decode`` elementwise: a GEMM that applies the scales at each promotion
    (``fp22_promote128``) then sums the codes' products and scales the partial sums, as DeepGEMM does,
    for ``values`` and any view of it. Kept while ``values`` lives.

    tile: (rows, columns) of the last two axes over which ``decode`` is constant (the tile scaling that
    made it): the GEMM then knows from the layout alone whether the scales are constant along each run
    of products it promotes. Without it, the GEMM compares the scales themselves, a read back to the host.
    """
    if values._base is not None or not values.is_contiguous():
        raise ValueError("register_factors takes a contiguous tensor that is not a view (clone it)")
    if codes.shape != values.shape or decode.shape != values.shape:
        raise ValueError("codes and decode must have the values' shape")
    key = id(values)
    forget = weakref.ref(values, lambda _, key=key: _FACTORS.pop(key, None))
    _FACTORS[key] = (forget, codes.contiguous(), decode.contiguous(), tile)


def _factors_of(t: torch.Tensor, contraction_axis: int) -> _Factors | None:
    """The registered codes and decode scales of ``t`` (a registered tensor or a view of one), viewed as
    ``t`` views its base, with the extent of the registered tile along ``t``'s ``contraction_axis`` where
    that axis is one of the base's last two, unshifted; None where none are registered."""
    for base in (t, t._base):
        if base is None:
            continue
        entry = _FACTORS.get(id(base))
        if entry is None or entry[0]() is not base:
            continue
        offset = t.storage_offset() - base.storage_offset()
        codes, decode = (
            part.as_strided(t.size(), t.stride(), part.storage_offset() + offset) for part in entry[1:3]
        )
        tile, run = entry[3], None
        if tile is not None and offset == 0 and base.dim() >= 2 and base.stride(-1) != base.stride(-2):
            stride = t.stride(contraction_axis)  # which of the base's last two axes the view contracts
            if stride == base.stride(-1):
                run = tile[1]
            elif stride == base.stride(-2):
                run = tile[0]
        return _Factors(codes, decode, run)
    return None


def _fma32(s: torch.Tensor, g: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """float32 ``s · g + t`` rounded once (a fused multiply-add), for float32 ``s``, ``t`` and ``g`` of at
    most 24 significant bits: the product is exact in float64, the sum is rounded there *to odd* (from its
    exact error, TwoSum), so that rounding it to float32 is the correct rounding of the exact value."""
    p, t64 = s.double() * g.double(), t.double()
    total = p + t64  # TwoSum (Knuth): err is exactly p + t64 - total
    back = total - t64
    err = (t64 - (total - back)) + (p - back)
    inexact = err != 0
    below = inexact & (torch.sign(err) != torch.sign(total))
    truncated = torch.where(below, torch.nextafter(total, torch.zeros_like(total)), total)
    bits = truncated.view(torch.int64)
    return torch.where(inexact, bits | 1, bits).view(torch.float64).float()


def _promoted_exact(
    a: torch.Tensor, b: torch.Tensor, accumulator: Accumulator, chunk: int
) -> torch.Tensor | None:
    """``a @ b`` as DeepGEMM computes a promoted FP8 GEMM, where both operands have registered factors
    whose decode scales are constant along each run of ``promote_every`` products: per run, the codes'
    products summed in chunks of ``chunk`` (exactly), each chunk and each addition rounded to the
    accumulator's format; then ``total = fma(sa · sb, partial, total)`` in float32 (DeepGEMM's
    ``final_accum += scale_a * scale_b * accum``, which nvcc contracts). None where it does not apply."""
    from numscope.formats.cast import cast_float
    from numscope.formats.quantize import as_float32
    from numscope.formats.spec import get_format

    fa, fb = _factors_of(a, -1), _factors_of(b, -2)
    run = accumulator.promote_every
    if fa is None or fb is None or run is None or run % chunk:
        return None
    ca, da = fa.codes, fa.decode
    cb, db = fb.codes, fb.decode
    length = a.shape[-1]
    sa, sb = da[..., ::run], db[..., ::run, :]  # (.., M, G), (.., G, N): one scale per run
    if fa.constant_run is not None and fb.constant_run is not None:
        constant = fa.constant_run % run == 0 and fb.constant_run % run == 0  # known from the tiles
    else:  # compared: a read back to the host
        constant = torch.equal(sa.repeat_interleave(run, dim=-1)[..., :length], da) and torch.equal(
            sb.repeat_interleave(run, dim=-2)[..., :length, :], db
        )
    if not constant:
        return None  # the scales change inside a run: not a promoted GEMM's layout
    narrow = get_format(accumulator.format)  # type: ignore[arg-type]

    def rounded(values: torch.Tensor) -> torch.Tensor:  # float64 in, the accumulator's value out
        return cast_float(as_float32(values, narrow), narrow, "nearest", "propagate").double()  # type: ignore[arg-type]

    pad = (-length) % run
    ca, cb = ca.double(), cb.double()
    if pad:
        ca, cb = F.pad(ca, (0, pad)), F.pad(cb, (0, 0, 0, pad))
    chunks = (length + pad) // chunk
    a_chunks = ca.reshape(*ca.shape[:-1], chunks, chunk).movedim(-2, -3)
    b_chunks = cb.reshape(*cb.shape[:-2], chunks, chunk, cb.shape[-1])
    sums = torch.matmul(a_chunks, b_chunks)  # exact sums of code products
    per_run = run // chunk
    fused = native.promoted_sum(sums, sa, sb, narrow, per_run)  # type: ignore[arg-type]
    if fused is not None:  # the loops below in one pass of C: the same roundings in the same order
        return fused.to(a.dtype)
    partials = rounded(sums)
    total = None
    for index in range(sa.shape[-1]):
        group = partials.select(-3, index * per_run)
        for inner in range(index * per_run + 1, (index + 1) * per_run):
            group = rounded(group + partials.select(-3, inner))
        scale = sa[..., index].unsqueeze(-1) * sb[..., index, :].unsqueeze(-2)  # float32
        total = _fma32(scale, group, torch.zeros_like(scale) if total is None else total)
    assert total is not None
    return total.to(a.dtype)


def accumulate_matmul(
    a: torch.Tensor, b: torch.Tensor, accumulate: str, chunk: int = ACCUMULATE_CHUNK
) -> torch.Tensor:
    """``a @ b`` (broadcasting, ≥2-D) with the sum over the contraction axis in the ``accumulate`` format.

    See the module docstring for the model (chunks of ``chunk`` products exact in fp32, then sequential
    additions rounded to the accumulator's format; with promotion, each run of ``promote_every`` products
    summed so and then added into an fp32 total). ``fp32`` is ``torch.matmul``. Returns ``a``'s dtype.
    An output whose chunk sums would take more than :data:`PARTIALS_BYTES` is computed in slices of rows
    (equal in value; in bits only as torch's matmul is between shapes).
    """
    accumulator = ACCUMULATORS.get(accumulate)
    if accumulator is None:
        raise ValueError(f"unknown accumulate {accumulate!r}; allowed: {', '.join(ACCUMULATORS)}")
    if accumulator.format is None:
        return torch.matmul(a, b)
    rows = math.prod(a.shape[:-1])
    per_row = math.ceil(a.shape[-1] / chunk) * b.shape[-1] * 4  # bytes of one output row's chunk sums
    step = max(SLICE_MIN_ROWS, PARTIALS_BYTES // per_row)
    if b.dim() == 2 and a.dim() >= 2 and rows > step:
        # the rows in slices, so that the chunk sums stay small (a vocabulary-sized output over many tokens
        # would hold gigabytes of them: 24 GB for MPNet's head on 64 x 128 tokens). torch's float32 sums of
        # 32 products could then differ in their last bit if its kernels differed between row counts (none
        # did in the shapes measured: tests/sites/test_sites.py), and an output element by one rounding of the
        # accumulator where one did
        flat = a.reshape(rows, a.shape[-1])
        parts = [accumulate_matmul(flat[i : i + step], b, accumulate, chunk) for i in range(0, rows, step)]
        return torch.cat(parts).reshape(*a.shape[:-1], b.shape[-1])
    from numscope.formats.cast import cast_float
    from numscope.formats.spec import get_format

    if accumulator.promote_every is not None:
        exact = _promoted_exact(a, b, accumulator, chunk)
        if exact is not None:
            return exact
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
    per_group = chunks if accumulator.promote_every is None else max(accumulator.promote_every // chunk, 1)
    tracked = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if tracked or torch.compiler.is_compiling() or not REUSE_PARTIALS:  # out= takes no autograd
        sums = torch.matmul(a_chunks, b_chunks)
    else:
        shape = torch.broadcast_shapes(a_chunks.shape[:-2], b_chunks.shape[:-2])
        buffer = _partials_buffer((*shape, a_chunks.shape[-2], b_chunks.shape[-1]), a.dtype, a.device)
        sums = torch.matmul(a_chunks, b_chunks, out=buffer)
    fused = native.rounded_sum(sums, narrow, per_group)  # type: ignore[arg-type]
    if fused is not None:  # the loop below in one pass of C: the same roundings in the same order
        return fused.to(out_dtype)
    partials = rounded(sums)
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
    accumulate: tuple[str, ...]  # the accumulator of fprop, dgrad, wgrad (numscope.vocab.GEMMS' order)
    storage: torch.dtype | None
    weight_axes: tuple[int, int] = (-1, 0)  # (fprop, dgrad) axes of b
    meta: dict[str, Any] = field(default_factory=dict)
    share_input: bool = False  # wgrad takes fprop's handled input (every handler said shares_input)
    share_weight: bool = False  # dgrad takes fprop's handled weight where it is an activation (shares_weight)
    prequantize: bool = False  # wgrad's input is quantized in forward and kept in its codes (see below)
    upcast: torch.dtype | None = None  # the working dtype of a GEMM computed on float32 values

    def acc(self, gemm: str) -> str:
        """The accumulator of ``gemm``."""
        return self.accumulate[GEMMS.index(gemm)]

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype an operand of ``dtype`` is multiplied in: float32 for fp16/bf16 when upcasting."""
        return torch.float32 if self.upcast is not None and dtype in _LOW else dtype

    def pack(
        self, tensor: torch.Tensor, raw: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], Callable[..., torch.Tensor]] | None:
        """A compact form of a handled fprop operand kept for backward (the input for wgrad, an activation
        weight for dgrad), from the last handler that offers one (``pack(site, tensor) -> (tensors, unpack)
        | None``; ``unpack(*tensors)`` must give ``tensor`` back bit for bit): a quantized operand kept in
        its own codes instead of float32. None where the codes would take more memory than ``raw``, the
        operand as it came."""
        packer = getattr(self.handlers[-1], "pack", None) if self.handlers else None
        packed = None if packer is None else packer(self.site, tensor)
        if packed is not None and packed[0][0].element_size() > raw.element_size():
            return None
        return packed

    def pack_wgrad_input(
        self, tensor: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], Callable[..., torch.Tensor]] | None:
        """wgrad's input (``tensor``, (tokens, features)) quantized now, in forward, and kept in its codes:
        what every handler's ``prequantizes_wgrad_input(site)`` allowed, from the last handler's
        ``pack_wgrad_input(site, tensor) -> (tensors, unpack) | None``; ``unpack(*tensors)`` is exactly what
        the chain would give wgrad in backward (a block format's input keeps its codes, not float32)."""
        return self.handlers[-1].pack_wgrad_input(self.site, tensor)  # type: ignore[attr-defined]

    def announce_gradient(self, tensor: torch.Tensor) -> None:
        """Tell the handlers that dgrad and then wgrad will take this gradient (``announce_gradient(site,
        tensor)``, where a handler has it): a quantizer may then make both its copies in one pass."""
        for handler in self.handlers:
            announce = getattr(handler, "announce_gradient", None)
            if announce is not None:
                announce(self.site, tensor)

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
    layout, acc = call.layout, call.acc(Gemm.FPROP)
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
        a_q = call.chain(Gemm.FPROP, Operand.INPUT, a, -1)
        b_q = call.chain(Gemm.FPROP, Operand.WEIGHT, b, fprop_b_axis)
        out = _forward_product(
            call, a_q, b_q, None if bias is None else bias.to(call.compute_dtype(bias.dtype))
        )
        need_a, need_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        # the handled input is kept for wgrad only where it takes no more memory than the raw one: as it is,
        # or in the codes its handler made it from (an fp8 operand of an fp16 model: one byte, not four)
        packed = call.pack(a_q, a) if call.share_input and need_b and call.storage is None else None
        share = call.share_input and (packed is not None or a_q.element_size() <= a.element_size())
        ctx.share = share
        ctx.call = call
        ctx.a_meta = (a.shape, a.stride(), a.dtype)
        ctx.b_meta = (b.shape, b.stride(), b.dtype)
        ctx.has_bias = bias is not None
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
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
        if prepared is not None or packed is not None or (share and a_q is not a and call.storage is None):
            save_exactly(*kept_a)
        # an activation weight (a product of activations) kept for dgrad in the codes fprop made of it
        packed_b = None
        if call.share_weight and need_a and call.storage is None and not isinstance(b, nn.Parameter):
            packed_b = call.pack(b_q, b)
        if packed_b is not None:
            kept_b = packed_b[0]
            save_exactly(*kept_b)
        else:
            kept_b = (_store(b, call.storage) if need_a else None,)
        ctx.b_unpack = None if packed_b is None else packed_b[1]
        ctx.kept_a = len(kept_a)
        ctx.save_for_backward(*kept_a, *kept_b)
        ctx.a_saved_dtype = (a_q if share else a).dtype
        # the parameter object itself for dgrad's handlers (saved-tensor hooks hand back a plain alias),
        # which may reuse what they made of it in fprop; saved above too, for autograd's version check
        ctx.parameter = b if need_a and isinstance(b, nn.Parameter) else None
        return out if call.upcast is None else out.to(call.upcast)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        call: _Call = ctx.call
        saved = ctx.saved_tensors
        kept_a, kept_b = saved[: ctx.kept_a], saved[ctx.kept_a :]
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
        # dgrad's weight as fprop handled it, where it was kept in its codes (else the chain makes it below)
        b_q = None if ctx.b_unpack is None else ctx.b_unpack(*kept_b).to(call.compute_dtype(b_dtype))
        b_saved = None if b_q is not None else kept_b[0]
        b = ctx.parameter if ctx.parameter is not None else None if b_saved is None else b_saved.to(b_dtype)
        share = ctx.share
        grad_a = grad_b = grad_bias = None
        layout = call.layout
        acc_d, acc_w = call.acc(Gemm.DGRAD), call.acc(Gemm.WGRAD)
        _, dgrad_b_axis = call.weight_axes
        if layout in ("linear", "fold"):
            grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
            if need_a and need_b:
                call.announce_gradient(grad_2d)
            if need_a:
                dy = call.chain(Gemm.DGRAD, Operand.GRAD_OUTPUT, grad_2d, -1)
                w = call.chain(Gemm.DGRAD, Operand.WEIGHT, b, dgrad_b_axis)
                mat2 = w.t() if layout == "linear" else w
                if acc_d == "fp32":
                    a2_size = (math.prod(a_shape[:-1]), a_shape[-1])
                    a2_stride = a_stride if len(a_shape) == 2 else call.meta["a_fold_strides"]
                    grad_a = _mm_mat1_backward(dy, mat2, a2_size, a2_stride).reshape(a_shape)
                else:
                    grad_a = accumulate_matmul(dy, mat2.t(), acc_d).reshape(a_shape)
            if need_b:
                dy = call.chain(Gemm.WGRAD, Operand.GRAD_OUTPUT, grad_2d, 0)
                if prepared is not None:
                    x = prepared
                else:
                    x = a.reshape(-1, a_shape[-1])
                    x = x if share else call.chain(Gemm.WGRAD, Operand.INPUT, x, 0)
                if acc_w != "fp32":
                    product = accumulate_matmul(x.t(), dy, acc_w)
                    grad_b = product.t() if layout == "linear" else product
                elif layout == "linear":
                    grad_b = _mm_mat2_backward(
                        dy, x, (b_shape[1], b_shape[0]), (b_stride[1], b_stride[0])
                    ).t()
                else:
                    grad_b = _mm_mat2_backward(dy, x, b_shape, b_stride)
        elif layout == "mm":
            if need_a and need_b:
                call.announce_gradient(grad_output)
            if need_a:
                dy = call.chain(Gemm.DGRAD, Operand.GRAD_OUTPUT, grad_output, -1)
                w = b_q if b_q is not None else call.chain(Gemm.DGRAD, Operand.WEIGHT, b, dgrad_b_axis)
                if acc_d == "fp32":
                    grad_a = _mm_mat1_backward(dy, w, a_shape, a_stride)
                else:
                    grad_a = accumulate_matmul(dy, w.t(), acc_d)
            if need_b:
                dy = call.chain(Gemm.WGRAD, Operand.GRAD_OUTPUT, grad_output, 0)
                x = (
                    prepared
                    if prepared is not None
                    else a
                    if share
                    else call.chain(Gemm.WGRAD, Operand.INPUT, a, 0)
                )
                grad_b = (
                    _mm_mat2_backward(dy, x, b_shape, b_stride)
                    if acc_w == "fp32"
                    else accumulate_matmul(x.t(), dy, acc_w)
                )
        else:  # batched, as at::matmul: expand the batch dims, fold them into one, bmm
            batch = call.meta["batch"]
            count = math.prod(batch)
            n, m, p = a_shape[-2], a_shape[-1], b_shape[-1]
            if need_a:
                dy = call.chain(Gemm.DGRAD, Operand.GRAD_OUTPUT, grad_output, -1).reshape(count, n, p)
                w = b_q if b_q is not None else call.chain(Gemm.DGRAD, Operand.WEIGHT, b, -1)
                w = w.expand(*batch, m, p).reshape(count, m, p)
                product = (
                    dy.bmm(w.transpose(1, 2))
                    if acc_d == "fp32"
                    else accumulate_matmul(dy, w.transpose(1, 2), acc_d)
                )
                grad_a = product.reshape(*batch, n, m).sum_to_size(a_shape)
            if need_b:
                dy = call.chain(Gemm.WGRAD, Operand.GRAD_OUTPUT, grad_output, -2).reshape(count, n, p)
                x = a if share else call.chain(Gemm.WGRAD, Operand.INPUT, a, -2)
                x = x.expand(*batch, n, m).reshape(count, n, m)
                product = (
                    x.transpose(1, 2).bmm(dy)
                    if acc_w == "fp32"
                    else accumulate_matmul(x.transpose(1, 2), dy, acc_w)
                )
                grad_b = product.reshape(*batch, m, p).sum_to_size(b_shape)
        if need_bias and ctx.has_bias:
            flat = grad_output.reshape(-1, grad_output.shape[-1]) if layout == "linear" else grad_output
            grad_bias = _sum_bias(flat, ctx.bias_shape, ctx.bias_dtype)
        if call.upcast is not None:  # computed in float32: back to each input's dtype, as autograd's casts
            grad_a = None if grad_a is None else grad_a.to(a_dtype)
            grad_b = None if grad_b is None else grad_b.to(b_dtype)
        return None, grad_a, grad_b, grad_bias
