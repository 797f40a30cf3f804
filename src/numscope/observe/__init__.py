"""The observer: measure every candidate format on a model's own operands while it trains.

::

    with numscope.observe(model, candidates=["bf16", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3"], every=10) as obs:
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step(); optimizer.zero_grad()
            obs.step()                # once per optimizer step, as Transformer Engine's debug_api.step()
    analysis = obs.analysis()               # a numscope.Analysis

The observer attaches one :class:`~numscope.sites.OperandHandler` through :func:`numscope.sites.attach`, the
interception point the runtime quantizes through, so it sees exactly the operands each GEMM receives. It
returns every tensor unchanged and computes under ``torch.no_grad()`` on detached copies, so training with
and without it is bit-identical. On a *sampled* step (``step % every == 0``; steps count from 0 and
:meth:`Observer.step` advances them) it records, per (site, gemm, operand):

* ``stats`` of the high-precision tensor (:func:`numscope.metrics.tensor_stats`; ``amax`` is the full
  tensor's, the rest is of the sample);
* the metrics of every candidate format (:func:`numscope.metrics.operand_metrics`: ``sqnr_db``,
  ``rel_error``, ``underflow%``, ``overflow%``…), block formats with their blocks along the GEMM's
  contraction axis; each candidate uses its format's default scaling (:func:`numscope.plan.default_scaling`:
  per-tensor current scaling for fp8/fp6/fp4/int, none for fp32/tf32/bf16/fp16, the own block scale for
  block formats);
* a log2 histogram of the sample (:func:`numscope.metrics.log2_histogram`), summed over sampled steps;
* per GEMM, once both of its operands have passed, the backward error of each candidate on the left
  operand, on the right one, and on both (``(fmt, "fp32")``, ``("fp32", fmt)``, ``(fmt, fmt)``), and of
  each mixed pair ``(A, B)`` of ``pairs`` (the left operand in A, the right in B; by default the fp8
  hybrid's ``("fp8_e5m2", "fp8_e4m3")``: E5M2 gradients times E4M3 weights or inputs in dgrad and wgrad,
  where both are candidates), on a
  sub-product of sampled rows (see below): its mean, p99 and max over the output entries whose |L|·|R| is
  nonzero, with ``count`` (those entries) and ``excluded`` (the others: e.g. the rows of a gradient that
  is zero at positions without loss), as :func:`numscope.metrics.backward_error.backward_error_stats` and
  :func:`numscope.metrics.backward_error` compute them.

Only training forwards are measured: a forward run under ``torch.no_grad()`` (an evaluation between steps)
is left alone unless ``no_grad_forwards=True``.

Under a plan (monitoring) the observer also records, under the candidate label ``"plan"``, the metrics of
the format and scaling the plan gives each operand, and the format in ``Analysis.plan_formats``. The plan is
the one passed as ``plan=``, else the one :func:`numscope.convert` applied to the model. Start observing
*before* converting: handlers chain in attach order (:mod:`numscope.sites`), so the observer then sees the
high-precision operands; attaching to an already converted model is an error.

**Sampling (bounded memory and cost, unbiased metrics).** A tensor of at most ``max_elements`` elements is
measured whole. A larger one is measured on samples drawn with the observer's ``generator``:

* statistics, histogram and element formats: ``max_elements`` elements drawn uniformly (with replacement),
  so every element-wise fraction or mean (``underflow%``, ``overflow%``, ``rel_error``, noise and signal
  power) is an unbiased estimate of the tensor's. Per-tensor scales come from the *whole* tensor's amax
  (reduced across ranks, as in training; ``stats["amax"]`` is this rank's), so each sampled element is
  quantized exactly as it is inside the whole tensor;
* block formats and backward errors: whole rows along the GEMM's contraction axis, ``max_elements // K``
  of them (at least :data:`MIN_ROWS`, or ``be_rows`` if fewer) drawn uniformly with replacement, so every
  block holds the tensor's own elements and gets its true scale (NVFP4's tensor scale from the whole
  tensor's amax). For a batched matmul (both operands with the same leading batch shape) the rows are
  drawn within up to :data:`BATCH_ENTRIES` random batch entries shared by both operands;
* backward error: ``be_rows`` of those rows of each operand (the right one in its contraction-last
  layout, i.e. its columns as a GEMM operand), each with the full contraction length; every inner product
  of the sub-product is one of the full product's, so the mean over its entries estimates the full
  product's (without bias when no entry is excluded). The rows are quantized as inside their whole
  tensors (the block formats' quantization above is reused).

Memory held per operand is bounded by ``max(max_elements, MIN_ROWS × K)`` elements plus the candidates'
quantized copies of ``be_rows`` rows; nothing is kept past :meth:`Observer.step`.

**Cost.** On a step that is not sampled the observer is neither active nor wanted (:mod:`numscope.sites`):
the forward runs without interception and no operand is touched. On a sampled step, what does not depend
on the contraction axis (statistics, histogram, element-format metrics, the amax) is measured once per
tensor and reused where the same tensor (same memory and version, still alive) enters another GEMM —
the weight in fprop and dgrad, grad_output in dgrad and wgrad, the input in fprop and wgrad, one
activation entering several projections; the metrics of all candidates come back to the host together
(:func:`numscope.metrics.candidate_metrics`). ``benchmarks/bench_observer.py`` measures the overhead. Under
SDPA, a sampled step runs attention as its two matmuls (:func:`numscope.sites.sdpa_reference`: equal in
value, not in bits, to the fused kernel); eager attention and Linear layers are bit-identical.

**Under torch.distributed** (a process group initialised, ``reduce_ranks=True``, the default) each rank
measures its own operands and :meth:`Observer.step` merges a sampled step's records across the default
process group in one ``all_gather_object`` (:func:`numscope.distributed.merge_analysis`): histograms and
element counts add, ``amax`` takes the maximum, fractions and means weigh by sample size, so every rank then
holds the analysis one process would have measured on the concatenated batch (exactly, for tensors measured
whole); the weights of Linear and Conv1D sites, the same on every rank, are counted once. Every rank must
call ``step()`` alike (it is a collective on sampled steps); write the result once with
:func:`numscope.distributed.save_analysis`.

Operands whose partner never arrives (a GEMM the runtime does not route through the handler) simply get no
backward error. A convolution's GEMM is that of its im2col form, whose rows (a channel block times the
kernel window) the operands as passed do not show; as a convolution is linear in each operand, its backward
error is computed through the convolution itself (:class:`numscope.sites.ConvCall`): per output entry of up
to ``BATCH_ENTRIES`` drawn batch entries, |conv(L, R) − conv(Q(L), Q(R))| / conv(|L|, |R|) in float64 (for
dgrad and wgrad the input- and weight-gradient products), each operand quantized as inside the whole tensor
along its contraction axis: equal to the im2col GEMMs' backward error.
If the same operand of a GEMM arrives twice before its partner, the later one replaces the
earlier one. A site called several times in one step has its records of that step merged (sample-weighted,
see :func:`numscope.analysis.default_reduce`; backward errors weighted by their entries, see
:func:`numscope.analysis.merge_be_stats`) and its element counts added.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from numscope._callable import make_callable as _make_callable
from numscope.observe.config import BATCH_ENTRIES, DEFAULT_CANDIDATES, HANDLER_NAME, MIN_ROWS, ObserveConfig
from numscope.observe.observer import Observer
from numscope.plan import Plan


def observe(
    model: nn.Module,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    *,
    every: int = 1,
    max_elements: int = 1 << 14,
    be_rows: int = 64,
    backward_error: bool = True,
    plan: Plan | None = None,
    generator: torch.Generator | None = None,
    reduce_ranks: bool = True,
    no_grad_forwards: bool = False,
    pairs: Sequence[tuple[str, str]] | None = None,
) -> Observer:
    """An :class:`Observer` of ``model`` (use it as a context manager; see the module docstring).

    candidates: format names to measure (bf16, the advisor's default reference, should be among them).
    every: measure every ``every``-th optimizer step. max_elements: per operand and step. be_rows: rows of
    each operand in the backward-error sub-product. plan: the plan the model runs under (monitoring).
    generator: the random source of the samples (default: a CPU generator seeded with 0).
    reduce_ranks: under ``torch.distributed``, merge each sampled step across the ranks at ``step()``.
    no_grad_forwards: also measure forwards run under ``torch.no_grad()`` (evaluation, inference); by
    default only training forwards (and their backward) are measured.
    pairs: mixed candidate pairs (left format, right format) whose backward error is measured in every GEMM
    (see :class:`ObserveConfig`); default: the fp8 hybrid's E5M2 × E4M3 where both are candidates.
    """
    config = ObserveConfig(
        tuple(candidates),
        every,
        max_elements,
        be_rows,
        backward_error,
        reduce_ranks,
        no_grad_forwards,
        None if pairs is None else tuple(tuple(pair) for pair in pairs),  # type: ignore[misc]
    )
    return Observer(model, config, plan=plan, generator=generator)


__all__ = [
    "BATCH_ENTRIES",
    "DEFAULT_CANDIDATES",
    "HANDLER_NAME",
    "MIN_ROWS",
    "ObserveConfig",
    "Observer",
    "observe",
]

_make_callable(__name__, "observe")
