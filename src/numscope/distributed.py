"""numscope under ``torch.distributed``: rank queries, exact merging of analyses, low-precision collectives.

What already happens without this module, by default, whenever a process group is initialised:

* current (``tensor``) and delayed scaling take their amax over the default process group
  (``Scaling(reduce_amax=True)``, as Transformer Engine's ``reduce_amax``), and NVFP4 its per-tensor amax,
  so every rank quantizes with the same scale and N data-parallel ranks match one process on the
  concatenated batch. ``Scaling(reduce_amax=False)`` keeps each rank's own amax;
* :class:`numscope.LossScaler` all-reduces (MAX) its one-element found-inf flag, so an overflow on any rank
  skips the step on every rank and the scale stays the same everywhere (under FSDP2 too: each rank checks
  its own gradient shards, then one all-reduce);
* :class:`numscope.Observer` merges each sampled step across the ranks at ``step()`` (one gather with
  :func:`merge_analysis`), so every rank holds one process's analysis of the concatenated batch.

Every one of those reductions is a collective: all ranks must quantize the same tensors in the same order
(as they do when they run the same model), or the run hangs.

This module adds what needs an explicit call:

* :func:`merge_analysis` / :func:`save_analysis`: combine each rank's :class:`numscope.Analysis` exactly
  (histograms and element counts add, maxima and minima reduce, fractions and means weight by sample size;
  parameters, the same on every rank, are counted once) and write it once, on rank 0;
* :func:`all_gather_tensor`, :func:`broadcast_tensor_`: collectives that accept fp8 dtypes on every backend
  (gloo rejects ``torch.float8_*``; the bytes travel as ``uint8`` views);
* :func:`all_gather_quantized`: a low-precision all-gather (each rank sends the 1-byte codes of its shard
  in a ≤8-bit format plus its scales) whose result equals quantizing the whole tensor in one process;
* :func:`parameter_divergence`: the largest difference between a module's parameters on any rank and on
  rank 0 (0.0 when data parallelism keeps replicas identical);
* :func:`use_loopback_on_one_node`: before ``init_process_group("gloo")``, keep gloo on the loopback
  interface when every rank runs on this machine;
* :func:`destroy_process_group` / :func:`destroyed_on_exit`: tear the default group down without torch's
  exit-time deadlock (see there).

Every function works outside distributed runs too (a world of one rank), so code need not branch.
"""

from __future__ import annotations

import gc
import math
import os
import socket
import traceback
from collections.abc import Container, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from numscope.analysis import Analysis, OperandKey, OperandRecord, merge
from numscope.formats.quantize import Encoded, ScalingArg, encode
from numscope.formats.scaling import DelayedScaler, Scaling
from numscope.formats.spec import BlockFormat, Format, get_format
from numscope.sites import Site
from numscope.vocab import Gemm, Operand

__all__ = [
    "WIRE_DTYPES",
    "all_gather_quantized",
    "all_gather_tensor",
    "broadcast_tensor_",
    "from_wire",
    "is_distributed",
    "is_parameter_operand",
    "is_rank_zero",
    "loopback_interface",
    "merge_analysis",
    "parameter_divergence",
    "parameter_operands",
    "rank",
    "save_analysis",
    "to_wire",
    "use_loopback_on_one_node",
    "world_size",
]

Group = dist.ProcessGroup | None

WIRE_DTYPES: tuple[torch.dtype, ...] = tuple(
    dtype
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
)
"""torch dtypes that collectives send as ``uint8`` views (one byte per element, bits unchanged)."""


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def rank(group: Group = None) -> int:
    """This process's rank in ``group`` (the default group when ``None``); 0 outside distributed runs."""
    return dist.get_rank(group) if is_distributed() else 0


def world_size(group: Group = None) -> int:
    """The number of ranks in ``group`` (the default group when ``None``); 1 outside distributed runs."""
    return dist.get_world_size(group) if is_distributed() else 1


def is_rank_zero(group: Group = None) -> bool:
    """Whether this process is rank 0 of ``group`` (always true outside distributed runs)."""
    return rank(group) == 0


# -- analyses ---------------------------------------------------------------------------------------
def parameter_operands(sites: Iterable[Site]) -> frozenset[OperandKey]:
    """The operand keys that hold a parameter, replicated on every data-parallel rank.

    The ``weight`` operand of every ``linear`` and ``conv1d`` site in every GEMM (``fprop``, ``dgrad``);
    a matmul site's ``weight`` (the right factor, e.g. attention's keys) is an activation, split with the
    batch. Pass ``numscope.sites(model)`` (with ``example_inputs`` to include matmul sites, which add
    nothing here).
    """
    return frozenset(
        (site.name, gemm, Operand.WEIGHT)
        for site in sites
        if is_parameter_operand(site, Operand.WEIGHT)
        for gemm in (Gemm.FPROP, Gemm.DGRAD)
    )


def is_parameter_operand(site: Site, operand: str) -> bool:
    """Whether ``operand`` of ``site`` is a parameter, the same on every data-parallel rank: the ``weight``
    of a ``linear`` or ``conv1d`` site (under FSDP2 the unsharded parameter it all-gathered)."""
    return operand == Operand.WEIGHT and site.kind in ("linear", "conv1d")


def _rms(parts: list[OperandRecord]) -> float:
    weighted = [(r.stats["rms"], r.sampled) for r in parts if not math.isnan(r.stats.get("rms", math.nan))]
    total = sum(n for _, n in weighted)
    return math.sqrt(sum(n * value * value for value, n in weighted) / total) if total else math.nan


def _dynamic_range(parts: list[OperandRecord]) -> float:
    """log2(largest amax) − log2(smallest nonzero magnitude), the latter recovered per rank from its stats."""
    smallest, largest = math.inf, 0.0
    for record in parts:
        amax, binades = record.stats.get("amax", math.nan), record.stats.get("dynamic_range", math.nan)
        if math.isnan(amax) or math.isnan(binades) or amax <= 0:
            continue
        largest = max(largest, amax)
        smallest = min(smallest, math.log2(amax) - binades)
    return math.log2(largest) - smallest if largest > 0 else 0.0


def _signal_and_noise(record: OperandRecord, candidate: str) -> tuple[float, float] | None:
    """(Σx², Σ(x−q)²) of one rank's sample for ``candidate``, recovered from its ``mse`` and ``sqnr_db``
    (or, where the noise is zero, from ``rms``); None when they were not measured."""
    metrics = record.metrics.get(candidate, {})
    mse, sqnr = metrics.get("mse", math.nan), metrics.get("sqnr_db", math.nan)
    if math.isnan(mse) or math.isnan(sqnr):
        return None
    noise = mse * record.sampled
    if sqnr == -math.inf:
        return 0.0, noise
    if noise > 0 and math.isfinite(sqnr):
        return noise * 10.0 ** (sqnr / 10.0), noise
    rms = record.stats.get("rms", math.nan)
    if math.isnan(rms):
        return None
    return record.sampled * (1.0 - record.stats.get("nonfinite%", 0.0) / 100.0) * rms * rms, noise


def _merge_signal_to_noise(metrics: dict[str, float], parts: list[tuple[float, float] | None]) -> None:
    """``sqnr_db`` and ``rel_error`` of the union of the ranks' samples: ratios of summed signal and noise
    powers (a mean of the ranks' decibels or ratios would not be)."""
    if any(part is None for part in parts):
        return
    signal = sum(part[0] for part in parts if part is not None)
    noise = sum(part[1] for part in parts if part is not None)
    if "sqnr_db" in metrics:
        metrics["sqnr_db"] = (
            math.inf if noise == 0 else -math.inf if signal == 0 else 10 * math.log10(signal / noise)
        )
    if "rel_error" in metrics:
        metrics["rel_error"] = 0.0 if noise == 0 else math.inf if signal == 0 else math.sqrt(noise / signal)


def _merge_data_parallel(parts: list[Analysis], replicated: Container[OperandKey]) -> Analysis:
    sharded = [
        Analysis(
            a.candidates,
            {k: v for k, v in a.operands.items() if k not in replicated},
            {k: v for k, v in a.histograms.items() if k not in replicated},
            a.backward_errors,
            {k: v for k, v in a.elements.items() if k not in replicated},
            {k: v for k, v in a.plan_formats.items() if k not in replicated},
            a.meta,
        )
        for a in parts
    ]
    merged = merge(sharded)
    for key, per_step in merged.operands.items():
        for step, record in per_step.items():
            records = [a.operands[key][step] for a in sharded if step in a.operands.get(key, {})]
            if len(records) > 1 and "rms" in record.stats:
                record.stats["rms"] = _rms(records)
            if len(records) > 1 and "dynamic_range" in record.stats:
                record.stats["dynamic_range"] = _dynamic_range(records)
            if len(records) > 1:
                for candidate, metrics in record.metrics.items():
                    _merge_signal_to_noise(metrics, [_signal_and_noise(r, candidate) for r in records])
    first = parts[0]
    for key in first.operands:
        if key in replicated:
            merged.operands[key] = dict(first.operands[key])
            for table, source in (
                (merged.histograms, first.histograms),
                (merged.elements, first.elements),
                (merged.plan_formats, first.plan_formats),
            ):
                if key in source:
                    table[key] = source[key]  # type: ignore[index]
    merged.meta = {**first.meta, "ranks": len(parts)}
    return merged


def merge_analysis(
    analysis: Analysis, group: Group = None, *, replicated: Container[OperandKey] = frozenset()
) -> Analysis:
    """Every rank's analysis combined into one, returned on every rank (a collective: call it on all ranks).

    The analyses travel as Python objects (no float rounding on the way) and combine through
    :func:`numscope.analysis.merge`: histograms and element counts add, maxima (``amax``) and minima
    reduce, fractions and means (``zeros%``, ``nonfinite%``, ``underflow%``, ``overflow%``) are weighted by
    each rank's sample size, ``rms`` combines as the root of the weighted mean square and
    ``dynamic_range`` from each rank's amax and smallest magnitude, ``sqnr_db`` and ``rel_error`` from the
    summed signal and noise powers. All of these are exact when every rank measured its tensors whole
    (tensors of at most the observer's ``max_elements``), so the result equals the analysis of one process
    that saw the concatenated batch. ``cosine``, ``kurtosis``, ``t_dof`` and backward errors are weighted
    means, an approximation.

    replicated: operand keys whose tensor is the same on every rank (parameters under DDP, or FSDP2's
    unsharded parameters: see :func:`parameter_operands`); they are taken from rank 0 instead of being
    counted once per rank. Ranks combine in rank order. Outside distributed runs, and for an analysis
    already merged over as many ranks (``meta["ranks"]``, as an observer's that merged at ``step()``),
    returns ``analysis``.
    """
    if world_size(group) == 1 or analysis.meta.get("ranks") == world_size(group):
        return analysis
    gathered: list[Analysis | None] = [None] * world_size(group)
    dist.all_gather_object(gathered, analysis, group=group)
    return _merge_data_parallel([part for part in gathered if part is not None], replicated)


def save_analysis(
    analysis: Analysis,
    directory: str | os.PathLike[str],
    group: Group = None,
    *,
    replicated: Container[OperandKey] = frozenset(),
) -> Path | None:
    """Merge every rank's analysis (:func:`merge_analysis`) and write it once, on rank 0.

    Returns the directory written on rank 0 and ``None`` on the other ranks; all ranks return only after
    rank 0 has finished writing (a barrier), so any rank may read the files right after.
    """
    merged = merge_analysis(analysis, group, replicated=replicated)
    written = merged.save(directory) if is_rank_zero(group) else None
    if is_distributed():
        dist.barrier(group)
    return written


# -- collectives that accept fp8 dtypes ----------------------------------------------------------------
def to_wire(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor any backend can send: fp8 dtypes as a ``uint8`` view of the same bytes."""
    contiguous = tensor.contiguous()
    return contiguous.view(torch.uint8) if contiguous.dtype in WIRE_DTYPES else contiguous


def from_wire(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo :func:`to_wire`: the bytes of ``wire`` seen as ``dtype`` again."""
    return wire.view(dtype) if dtype in WIRE_DTYPES else wire


def all_gather_tensor(tensor: torch.Tensor, dim: int = 0, group: Group = None) -> torch.Tensor:
    """Every rank's ``tensor`` (all of the same shape and dtype) concatenated along ``dim``, in rank order.

    fp8 dtypes travel as ``uint8`` views (one byte per element), so this works on gloo too. Outside
    distributed runs returns ``tensor``.
    """
    size = world_size(group)
    if size == 1:
        return tensor
    wire = to_wire(tensor)
    parts = [torch.empty_like(wire) for _ in range(size)]
    dist.all_gather(parts, wire, group=group)
    return torch.cat([from_wire(part, tensor.dtype) for part in parts], dim=dim)


def broadcast_tensor_(tensor: torch.Tensor, src: int = 0, group: Group = None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with rank ``src``'s (a global rank), fp8 dtypes included; returns it."""
    if world_size(group) == 1:
        return tensor
    wire = to_wire(tensor)
    dist.broadcast(wire, src=src, group=group)
    if wire.data_ptr() != tensor.data_ptr():
        tensor.copy_(from_wire(wire, tensor.dtype))
    return tensor


# -- low-precision all-gather ----------------------------------------------------------------------------
def _gatherable_scaling(fmt: Format, scaling: ScalingArg) -> Scaling | None:
    if isinstance(scaling, DelayedScaler):
        raise ValueError(
            "all_gather_quantized cannot use delayed scaling (a per-rank history); allowed: "
            "none, tensor, row, or a block format's own scaling"
        )
    parsed = Scaling.parse(scaling)
    if isinstance(fmt, BlockFormat):
        axis = parsed.axis if parsed is not None else -1
        if axis != -1:
            raise ValueError(
                f"all_gather_quantized gathers along dim 0 with blocks along the last axis; got block axis "
                f"{axis}; allowed: -1"
            )
        return parsed
    if fmt.bits > 8:
        raise ValueError(
            f"all_gather_quantized sends 1-byte codes; format {fmt.name!r} has {fmt.bits} bits; "
            "allowed: formats of at most 8 bits"
        )
    kind = "none" if parsed is None else parsed.kind
    if kind not in ("none", "tensor", "row"):
        raise ValueError(
            f"all_gather_quantized cannot gather scaling {kind!r} (its scales span the gathered dim 0); "
            "allowed: none, tensor, row"
        )
    if kind == "tensor" and parsed is not None and not parsed.reduce_amax and is_distributed():
        raise ValueError(
            "all_gather_quantized with scaling 'tensor' needs reduce_amax=True so that every shard shares "
            "one scale; got reduce_amax=False"
        )
    return parsed


def all_gather_quantized(
    shard: torch.Tensor,
    fmt: str | Format,
    *,
    scaling: ScalingArg = "tensor",
    rounding: str = "nearest",
) -> torch.Tensor:
    """A low-precision all-gather over the default group: the float32 values of the whole tensor in ``fmt``.

    Each rank holds ``shard``, a slice along dim 0 (all shards of the same shape, as FSDP2's even shards);
    it encodes its shard in ``fmt`` (a format of at most 8 bits, or a block format with blocks along the
    last axis) and sends the 1-byte codes plus its scales instead of 4-byte floats (4-bit elements also take
    one byte each: codes are not packed). With ``tensor`` scaling the amax is reduced over the default group
    first, so all shards share one scale; ``row`` scaling and block scales belong to one shard each. The
    result equals ``numscope.quantize(torch.cat(shards), fmt, scaling=scaling)`` bit for bit.

    Supported: element formats with scaling ``none``, ``tensor`` (``reduce_amax=True``) or ``row``; block
    formats (MX, NVFP4) with their blocks along the last axis. Outside distributed runs this is
    ``encode(shard, ...).decode()``.
    """
    if shard.dim() == 0:
        raise ValueError("all_gather_quantized gathers along dim 0; got a 0-dim shard; allowed: dim >= 1")
    spec = get_format(fmt)
    parsed = _gatherable_scaling(spec, scaling)
    local = encode(shard, spec, scaling=parsed, rounding=rounding)
    if world_size() == 1:
        return local.decode()
    codes = all_gather_tensor(local.codes, dim=0)
    scales = local.scales
    per_shard_scales = isinstance(spec, BlockFormat) or (parsed is not None and parsed.kind == "row")
    if scales is not None and per_shard_scales:
        scales = all_gather_tensor(scales, dim=0)
    shape = (shard.shape[0] * world_size(), *shard.shape[1:])
    whole = Encoded(spec, codes, scales, local.tensor_scale, shape, local.axis, local.length)
    return whole.decode()


# -- checks ----------------------------------------------------------------------------------------------
@torch.no_grad()
def parameter_divergence(module: nn.Module, group: Group = None) -> float:
    """The largest absolute difference between any parameter on any rank and the same one on rank 0.

    0.0 when replicas are identical (what DDP promises). For replicated (not sharded) parameters: FSDP2's
    sharded parameters differ between ranks by design. A collective; 0.0 outside distributed runs.
    """
    if world_size(group) == 1:
        return 0.0
    source = dist.get_global_rank(group, 0) if group is not None else 0
    largest = torch.zeros(1, dtype=torch.float64)
    for param in module.parameters():
        local = param.detach().to(torch.float64)
        reference = broadcast_tensor_(local.clone(), src=source, group=group)
        difference = (local - reference).abs()
        if difference.numel():
            largest = torch.maximum(largest, difference.max().reshape(1).to(largest.device))
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    return float(largest.item())


def use_loopback_on_one_node() -> str | None:
    """Point gloo at the loopback interface (``GLOO_SOCKET_IFNAME``) when torchrun put every rank on this
    machine (``LOCAL_WORLD_SIZE == WORLD_SIZE``) and the user chose no interface; return the interface set.

    Gloo otherwise connects the ranks through the address the host name resolves to; in containers and
    sandboxes that address can drop connections, and the ranks then wait for the process group's
    timeout (30 minutes) instead of training. Call it before ``init_process_group("gloo")``.
    """
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return None
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local is None or local != world:
        return None
    loopback = loopback_interface()
    if loopback is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    return loopback


def loopback_interface() -> str | None:
    """This machine's loopback network interface (``lo`` on Linux), None if it has none by that name."""
    names = [name for _, name in socket.if_nameindex()]
    return "lo" if "lo" in names else next((n for n in names if n.startswith("lo")), None)


def destroy_process_group(error: BaseException | None = None) -> None:
    """``dist.destroy_process_group()`` once nothing else holds the group; ``error``: the exception that
    ends the run, if any, whose frames are cleared first (their locals may hold a DDP wrapper).

    Call it after the function that built the ``DistributedDataParallel`` wrapper has returned. A DDP that
    outlives ``destroy_process_group`` holds, in its C++ ``Reducer``, the last reference to the gloo group;
    freeing it then joins gloo's worker threads with the GIL held, while a worker may be waiting for the
    GIL to free the tensors of the last collective: the process hangs at exit (under torch 2.13, one
    ``torchrun`` run in about eight). Cleared frames and a garbage collection first leave the group's
    last reference with ``destroy_process_group``, which releases the GIL while it joins.
    """
    if error is not None:
        traceback.clear_frames(error.__traceback__)
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def destroyed_on_exit() -> Iterator[None]:
    """Destroy the default process group when the block ends, with :func:`destroy_process_group`: on an
    exception, with that exception's frames cleared first. Build the DDP wrapper in a function called inside
    the block, so that it is gone when the block ends."""
    try:
        yield
    except BaseException as error:
        destroy_process_group(error)
        raise
    destroy_process_group()
