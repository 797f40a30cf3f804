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
  operand, on the right one, and on both (``(fmt, "fp32")``, ``("fp32", fmt)``, ``(fmt, fmt)``), on a
  sub-product of sampled rows (see below).

Under a plan (monitoring) the observer also records, under the candidate label ``"plan"``, the metrics of
the format and scaling the plan gives each operand, and the format in ``Analysis.plan_formats``. The plan is
the one passed as ``plan=``, else the one :func:`numscope.convert` applied to the model. Start observing
*before* converting: handlers chain in attach order (:mod:`numscope.sites`), so the observer then sees the
high-precision operands; attaching to an already converted model is an error.

**Sampling (bounded memory and cost, unbiased metrics).** A tensor of at most ``max_elements`` elements is
measured whole. A larger one is measured on a sample of ``max_elements`` elements drawn with the observer's
``generator``:

* element formats: a uniform random sample of elements (with replacement), so every element-wise fraction
  or mean (``underflow%``, ``overflow%``, ``rel_error``, noise and signal power) is an unbiased estimate of
  the tensor's; per-tensor scaling must see the tensor's true amax, so the element holding it is appended
  to the sample as an *anchor* (it fixes the scale and weighs 1/(n+1) in the metrics: a bias of at most
  1/65537 at the default ``max_elements``);
* block formats: uniformly sampled whole blocks along the contraction axis, so every block scale is the
  true one (MX); NVFP4's per-tensor scale gets the block holding the amax as its anchor;
* backward error: ``be_rows`` random rows of the left operand and ``be_rows`` random rows of the right
  operand's contraction-last layout (its columns as a GEMM operand), each with the full contraction length
  (fewer rows when rows × contraction length exceeds ``max_elements``); every inner product of the
  sub-product is one of the full product's, so the mean over output elements is unbiased. The operands
  are quantized with the tensors' true scales (anchor rows that are dropped after quantizing). For a
  batched matmul (both operands with the same leading batch shape) the rows are drawn within up to four
  random batch entries shared by both operands.

**Under torch.distributed** (a process group initialised, ``reduce_ranks=True``, the default) each rank
measures its own operands and :meth:`Observer.step` merges a sampled step's records across the default
process group in one ``all_gather_object`` (:func:`numscope.distributed.merge_analysis`): histograms and
element counts add, ``amax`` takes the maximum, fractions and means weigh by sample size, so every rank then
holds the analysis one process would have measured on the concatenated batch (exactly, for tensors measured
whole); the weights of Linear and Conv1D sites, the same on every rank, are counted once. Every rank must
call ``step()`` alike (it is a collective on sampled steps); write the result once with
:func:`numscope.distributed.save_analysis`.

Operands whose partner never arrives (a GEMM the runtime does not route through the handler) simply get no
backward error. If the same operand of a GEMM arrives twice before its partner, the later one replaces the
earlier one. A site called several times in one step has its records of that step merged (sample-weighted,
see :func:`numscope.analysis.default_reduce`) and its element counts added.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from numscope.analysis import PLAN_LABEL, Analysis, OperandKey, OperandRecord, default_reduce, merge_records
from numscope.convert import HANDLER_NAME as CONVERT_HANDLER
from numscope.convert import converted_plan
from numscope.distributed import is_parameter_operand, merge_analysis, world_size
from numscope.formats.quantize import quantize
from numscope.formats.scaling import Scaling
from numscope.formats.spec import BlockFormat, Format
from numscope.formats.spec import format as get_format
from numscope.metrics import log2_histogram, operand_metrics, tensor_stats
from numscope.plan import OPERANDS, OperandSpec, Plan, default_scaling
from numscope.sites import Site, attach, attached

DEFAULT_CANDIDATES: tuple[str, ...] = (
    "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "mxfp8_e4m3", "mxfp6_e3m2", "mxfp4_e2m1", "nvfp4",
)
"""What :func:`observe` measures unless told otherwise: bf16 (the reference), the 16-, 8-, 6- and 4-bit
formats of current hardware."""

HIGH_LABEL = "fp32"
BATCH_ENTRIES = 4
HANDLER_NAME = "numscope.observe"


@dataclass(frozen=True)
class ObserveConfig:
    """What the observer measures and how much of each tensor.

    candidates: format names (canonical names are stored).
    every: sample every ``every``-th step (steps count from 0).
    max_elements: the most elements measured per operand and sampled step (see the module docstring).
    be_rows: rows of each operand in the backward-error sub-product (``be_rows × be_rows`` inner products).
    backward_error: whether to compute backward errors at all.
    reduce_ranks: under ``torch.distributed``, merge each sampled step across the ranks at
        :meth:`Observer.step`.
    """

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    every: int = 1
    max_elements: int = 1 << 16
    be_rows: int = 64
    backward_error: bool = True
    reduce_ranks: bool = True

    def __post_init__(self) -> None:
        names = tuple(dict.fromkeys(get_format(c).name for c in self.candidates))
        if not names:
            raise ValueError("observe needs at least one candidate format")
        object.__setattr__(self, "candidates", names)
        for name in ("every", "max_elements", "be_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"observe: {name} must be a positive int, got {value!r}")


@dataclass
class _Half:
    """One operand of a GEMM waiting for its partner: sampled rows and the anchor row, contraction last."""

    rows: torch.Tensor  # (batch, rows, K) float32
    anchor: torch.Tensor  # (1, K): the row holding the tensor's amax
    batch: torch.Tensor | None  # the batch entries drawn (shared with the partner), None when not batched
    batch_shape: tuple[int, ...]


class Observer:
    """Collects an :class:`~numscope.analysis.Analysis` from the operands of a model's GEMM sites.

    Use :func:`observe` to make one; it is a context manager (``__enter__`` attaches, ``__exit__`` detaches),
    or call :meth:`attach` / :meth:`detach` yourself.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ObserveConfig,
        *,
        plan: Plan | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.plan = plan
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self._formats: dict[str, Format] = {c: get_format(c) for c in config.candidates}
        self._step = 0
        self._handle: Any = None
        self._pending: dict[tuple[str, str], dict[str, _Half]] = {}
        self._records: dict[OperandKey, dict[int, OperandRecord]] = {}
        self._histograms: dict[OperandKey, Any] = {}
        self._step_histograms: dict[OperandKey, Any] = {}  # the current step's, added at step()
        self._replicated: set[OperandKey] = set()  # the same on every rank: counted once when merged
        self._elements: dict[OperandKey, int] = {}
        self._plan_formats: dict[OperandKey, str] = {}
        self._be: dict[tuple[str, str], dict[tuple[str, str], dict[int, dict[str, float]]]] = {}
        self._be_counts: dict[tuple[str, str, int], int] = {}
        self._ranks = 1  # how many ranks the sampled steps were merged over

    # -- lifecycle --------------------------------------------------------------------------------
    def attach(self) -> Observer:
        """Attach the handler; an error if the model is already converted (the observer would only see
        quantized operands: enter ``observe`` first, then ``numscope.convert``)."""
        if CONVERT_HANDLER in attached(self.model):
            raise ValueError(
                "the model is already converted: an observer attached now would see the quantized operands; "
                "start observing before numscope.convert(model, plan) (it then monitors that plan)"
            )
        if self._handle is None:
            self._handle = attach(self.model, self._observe, name=HANDLER_NAME)
        return self

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._pending.clear()

    def __enter__(self) -> Observer:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    @property
    def current_step(self) -> int:
        """The step the next operands belong to (0 before the first :meth:`step`)."""
        return self._step

    @property
    def sampling(self) -> bool:
        """Whether operands of the current step are measured."""
        return self._step % self.config.every == 0

    def step(self) -> None:
        """Advance to the next optimizer step (call once per optimizer step); on a sampled step under
        ``torch.distributed``, first merge its records across the ranks (a collective: see the module
        docstring)."""
        if self.sampling and self.config.reduce_ranks and world_size() > 1:
            self._merge_ranks()
        for key, histogram in self._step_histograms.items():
            previous = self._histograms.get(key)
            self._histograms[key] = histogram if previous is None else previous + histogram
        self._step_histograms.clear()
        self._pending.clear()
        self._step += 1

    def _merge_ranks(self) -> None:
        """Replace this step's records, histograms, element counts and backward errors by all ranks'."""
        step = self._step
        local = Analysis(
            candidates=self.config.candidates,
            operands={k: {step: v[step]} for k, v in self._records.items() if step in v},
            histograms=dict(self._step_histograms),
            backward_errors={
                g: {p: {step: s[step]} for p, s in pairs.items() if step in s}
                for g, pairs in self._be.items()
            },
            elements={k: v[step].elements for k, v in self._records.items() if step in v},
            plan_formats=dict(self._plan_formats),
        )
        merged = merge_analysis(local, replicated=self._replicated)
        for key, per_step in merged.operands.items():
            self._records.setdefault(key, {})[step] = per_step[step]
            self._elements[key] = max(self._elements.get(key, 0), per_step[step].elements)
        self._step_histograms = dict(merged.histograms)
        self._plan_formats.update(merged.plan_formats)
        for gemm_key, pairs in merged.backward_errors.items():
            for pair, per_step_be in pairs.items():
                if step in per_step_be:
                    self._be.setdefault(gemm_key, {}).setdefault(pair, {})[step] = per_step_be[step]
        self._ranks = world_size()

    def analysis(self) -> Analysis:
        """A snapshot of everything recorded so far (the current step's records as this rank measured them
        until :meth:`step` merges them across ranks)."""
        histograms = dict(self._histograms)
        for key, histogram in self._step_histograms.items():
            histograms[key] = histogram if key not in histograms else histograms[key] + histogram
        return Analysis(
            candidates=self.config.candidates + ((PLAN_LABEL,) if self._plan_formats else ()),
            operands={k: dict(v) for k, v in self._records.items()},
            histograms=histograms,
            backward_errors={g: {p: dict(s) for p, s in pairs.items()} for g, pairs in self._be.items()},
            elements=dict(self._elements),
            plan_formats=dict(self._plan_formats),
            meta={
                "every": self.config.every,
                "max_elements": self.config.max_elements,
                "be_rows": self.config.be_rows,
                "steps_seen": self._step,
                **({"ranks": self._ranks} if self._ranks > 1 else {}),
            },
        )

    # -- the handler ------------------------------------------------------------------------------
    def _observe(self, site: Site, gemm: str, operand: str, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        if self.sampling and tensor.is_floating_point() and tensor.numel() > 0:
            if is_parameter_operand(site, operand):
                self._replicated.add((site.name, gemm, operand))
            with torch.no_grad():
                self._measure(site, gemm, operand, tensor.detach(), axis)
        return tensor

    def _measure(self, site: Site, gemm: str, operand: str, tensor: torch.Tensor, axis: int) -> None:
        key = (site.name, gemm, operand)
        step = self._step
        amax, flat_argmax = _amax(tensor)
        elements = tensor.numel()
        sample = self._element_sample(tensor)
        anchor = _at_flat(tensor, flat_argmax).float()
        stats = tensor_stats(sample)
        stats["amax"] = amax
        metrics = {}
        for label, fmt in self._formats.items():
            metrics[label] = self._format_metrics(tensor, sample, anchor, axis, fmt, default_scaling(fmt),
                                                  flat_argmax)
        plan = self._current_plan()
        if plan is not None:
            spec = plan.for_site(site.name).operand(gemm, operand)
            if not spec.is_high:
                metrics[PLAN_LABEL] = self._plan_metrics(tensor, sample, anchor, axis, spec, flat_argmax)
                self._plan_formats[key] = spec.format
        record = OperandRecord(stats, metrics, sample.numel(), elements)
        per_step = self._records.setdefault(key, {})
        if step in per_step:
            record = merge_records([per_step[step], record], default_reduce)
        per_step[step] = record
        self._elements[key] = max(self._elements.get(key, 0), record.elements)
        histogram = log2_histogram(sample)
        previous = self._step_histograms.get(key)
        self._step_histograms[key] = histogram if previous is None else previous + histogram
        if self.config.backward_error:
            self._pair(site.name, gemm, operand, tensor, axis, flat_argmax, step)

    def _current_plan(self) -> Plan | None:
        """The plan given to the observer, else the one the model was converted with, else None."""
        if self.plan is not None:
            return self.plan
        if CONVERT_HANDLER in attached(self.model):
            return converted_plan(self.model)
        return None

    # -- element and block samples -----------------------------------------------------------------
    def _draw(self, high: int, count: int) -> torch.Tensor:
        return torch.randint(high, (count,), generator=self.generator, device=self.generator.device)

    def _element_sample(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor (flattened, float32) or ``max_elements`` uniformly drawn elements."""
        limit = self.config.max_elements
        if tensor.numel() <= limit:
            return tensor.reshape(-1).float()
        index = self._draw(tensor.numel(), limit).to(tensor.device)
        return _at_flat(tensor, index).float()

    def _format_metrics(
        self,
        tensor: torch.Tensor,
        sample: torch.Tensor,
        anchor: torch.Tensor,
        axis: int,
        fmt: Format,
        scaling: Scaling | None,
        flat_argmax: int,
    ) -> dict[str, float]:
        if isinstance(fmt, BlockFormat):
            blocks = self._block_sample(tensor, axis, fmt.block_size, flat_argmax, fmt.tensor_scale)
            return operand_metrics(blocks, fmt, scaling=Scaling("block", axis=-1))
        if tensor.numel() <= self.config.max_elements or scaling is None:
            return operand_metrics(sample, fmt, scaling=scaling)
        return operand_metrics(torch.cat([sample, anchor]), fmt, scaling=scaling)

    def _block_sample(
        self, tensor: torch.Tensor, axis: int, block: int, flat_argmax: int, anchored: bool
    ) -> torch.Tensor:
        """Whole blocks along ``axis``, as rows of a (blocks, block) float32 matrix (zero-padded)."""
        moved = tensor.movedim(axis, -1) if tensor.dim() else tensor.reshape(1)
        length = moved.shape[-1]
        per_row = -(-length // block)
        rows = moved.numel() // length
        if moved.numel() <= self.config.max_elements:
            full = moved.reshape(rows, length).float()
            return F.pad(full, (0, per_row * block - length)).reshape(-1, block)
        count = max(1, self.config.max_elements // block)
        chosen = self._draw(rows * per_row, count).to(tensor.device)
        if anchored:
            lead, along = _moved_position(tensor, axis, flat_argmax)
            anchor_block = _ravel(lead, moved.shape[:-1]) * per_row + along // block
            chosen = torch.cat([chosen, torch.tensor([anchor_block], device=chosen.device)])
        row_index, block_index = chosen // per_row, chosen % per_row
        columns = block_index[:, None] * block + torch.arange(block, device=chosen.device)[None, :]
        valid = columns < length
        lead = torch.unravel_index(row_index, moved.shape[:-1]) if moved.dim() > 1 else ()
        lead = tuple(t[:, None].expand_as(columns) for t in lead)
        values = moved[(*lead, columns.clamp(max=length - 1))].float()
        return torch.where(valid, values, torch.zeros_like(values))

    def _plan_metrics(
        self,
        tensor: torch.Tensor,
        sample: torch.Tensor,
        anchor: torch.Tensor,
        axis: int,
        spec: OperandSpec,
        flat_argmax: int,
    ) -> dict[str, float]:
        """The plan's format and scaling. Delayed scaling is measured as current per-tensor scaling (the
        observer does not hold the runtime's amax history); row, column and tile scaling on the whole
        tensor."""
        fmt = spec.format_spec()
        assert fmt is not None
        scaling = spec.effective_scaling()
        if scaling is not None and scaling.kind == "delayed":
            scaling = Scaling("tensor", margin=scaling.margin, power_of_two=scaling.power_of_two)
        if isinstance(fmt, BlockFormat) or scaling is None or scaling.kind == "tensor":
            return self._format_metrics(tensor, sample, anchor, axis, fmt, scaling, flat_argmax)
        return operand_metrics(tensor.float(), fmt, scaling=scaling)

    # -- backward error ---------------------------------------------------------------------------
    def _pair(self, site: str, gemm: str, operand: str, tensor: torch.Tensor, axis: int, flat_argmax: int,
              step: int) -> None:
        gemm_key = (site, gemm)
        waiting = self._pending.setdefault(gemm_key, {})
        partner_name = next(o for o in OPERANDS[gemm] if o != operand)
        partner = waiting.get(partner_name)
        half = self._half(tensor, axis, flat_argmax, partner)
        if half is None:
            waiting.pop(partner_name, None)
            return
        if partner is None or partner.rows.shape[-1] != half.rows.shape[-1]:
            waiting.clear()
            waiting[operand] = half
            return
        del waiting[partner_name]
        left, right = (half, partner) if OPERANDS[gemm][0] == operand else (partner, half)
        self._record_be(gemm_key, step, left, right)

    def _half(self, tensor: torch.Tensor, axis: int, flat_argmax: int, partner: _Half | None) -> _Half | None:
        moved = tensor.movedim(axis, -1) if tensor.dim() else tensor.reshape(1)
        if moved.dim() == 1:
            moved = moved.reshape(1, -1)
        length = moved.shape[-1]
        batch_shape = tuple(moved.shape[:-2]) if moved.dim() >= 3 else ()
        batched = partner is not None and partner.batch is not None and partner.batch_shape == batch_shape
        rows_wanted = max(1, min(self.config.be_rows, self.config.max_elements // max(length, 1)))
        if batch_shape and (partner is None or batched):
            matrix = moved.reshape(-1, moved.shape[-2], length)
            if batched:
                batch = partner.batch
            else:
                count = min(BATCH_ENTRIES, matrix.shape[0])
                batch = self._draw(matrix.shape[0], count).to(tensor.device)
            per_entry = max(1, rows_wanted // len(batch))
            row_index = self._draw(matrix.shape[1], per_entry).to(tensor.device)
            rows = matrix[batch[:, None], row_index[None, :]].float()
        else:
            matrix = moved.reshape(-1, length)
            row_index = self._draw(matrix.shape[0], min(rows_wanted, matrix.shape[0])).to(tensor.device)
            rows = matrix[row_index].float()[None]
            batch = None
        lead, _ = _moved_position(tensor, axis, flat_argmax)
        anchor_row = moved[tuple(lead)].float() if tensor.dim() > 1 else moved[0].float()
        return _Half(rows, anchor_row.reshape(1, -1), batch, batch_shape)

    def _record_be(self, gemm_key: tuple[str, str], step: int, left: _Half, right: _Half) -> None:
        labels = self._formats
        quantized_left = {HIGH_LABEL: left.rows}
        quantized_right = {HIGH_LABEL: right.rows}
        for label, fmt in labels.items():
            quantized_left[label] = _quantize_rows(left, fmt)
            quantized_right[label] = _quantize_rows(right, fmt)
        exact_left, exact_right = left.rows.double(), right.rows.double()
        exact = exact_left @ exact_right.transpose(-1, -2)
        magnitude = exact_left.abs() @ exact_right.abs().transpose(-1, -2)
        pairs = set()
        for label in labels:
            pairs.update({(label, HIGH_LABEL), (HIGH_LABEL, label), (label, label)})
        per_gemm = self._be.setdefault(gemm_key, {})
        calls = self._be_counts.get((*gemm_key, step), 0)
        for pair in sorted(pairs):
            product = quantized_left[pair[0]].double() @ quantized_right[pair[1]].double().transpose(-1, -2)
            stats = _be_stats(exact, product, magnitude)
            per_step = per_gemm.setdefault(pair, {})
            per_step[step] = _running_mean(per_step[step], stats, calls) if calls else stats
        self._be_counts[(*gemm_key, step)] = calls + 1


def _running_mean(old: dict[str, float], new: dict[str, float], calls: int) -> dict[str, float]:
    out = {name: (old[name] * calls + new[name]) / (calls + 1) for name in old if name != "max"}
    out["max"] = max(old["max"], new["max"])
    return out


def _quantize_rows(half: _Half, fmt: Format) -> torch.Tensor:
    """The sampled rows quantized with the tensor's true scale (the anchor row joins, then is dropped)."""
    rows = half.rows.reshape(-1, half.rows.shape[-1])
    scaling = default_scaling(fmt)
    if isinstance(fmt, BlockFormat):
        scaling = Scaling("block", axis=-1)
    stacked = torch.cat([rows, half.anchor])
    quantized = quantize(stacked, fmt, scaling=scaling)[:-1]
    return quantized.reshape(half.rows.shape)


def _be_stats(exact: torch.Tensor, product: torch.Tensor, magnitude: torch.Tensor) -> dict[str, float]:
    """Mean, p99 and max over output elements of |exact − product| / (|L|·|R|) (0 where |L|·|R| = 0)."""
    error = (exact - product).abs()
    be = torch.where(magnitude > 0, error / magnitude.clamp_min(torch.finfo(torch.float64).tiny),
                     torch.zeros_like(error))
    be = torch.where(torch.isfinite(product), be, torch.full_like(be, math.inf)).reshape(-1)
    finite = be[torch.isfinite(be)]
    if finite.numel() == 0:
        return {"mean": math.inf, "p99": math.inf, "max": math.inf}
    p99 = float(torch.quantile(finite, 0.99)) if finite.numel() > 1 else float(finite[0])
    return {"mean": float(be.mean()), "p99": p99, "max": float(be.max())}


def _amax(tensor: torch.Tensor) -> tuple[float, int]:
    """max|x| over the tensor and the flat index of an element that holds it, without temporaries."""
    high, low = tensor.max(), tensor.min()
    if bool(high >= -low):
        return float(high), int(tensor.argmax())
    return float(-low), int(tensor.argmin())


def _moved_position(tensor: torch.Tensor, axis: int, flat_index: int) -> tuple[list[int], int]:
    """Where element ``flat_index`` sits once ``axis`` is moved last: (leading indices, index on axis)."""
    if tensor.dim() == 0:
        return [], 0
    position = [int(t) for t in torch.unravel_index(torch.tensor(flat_index), tuple(tensor.shape))]
    along = position.pop(axis % tensor.dim())
    return position, along


def _ravel(position: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for index, size in zip(position, shape, strict=True):
        flat = flat * int(size) + int(index)
    return flat


def _at_flat(tensor: torch.Tensor, index: torch.Tensor | int) -> torch.Tensor:
    """Elements at flat (row-major) indices of a tensor of any strides, without copying it."""
    if tensor.dim() == 0:
        return tensor.reshape(1)
    if isinstance(index, int):
        index = torch.tensor([index], device=tensor.device)
    return tensor[torch.unravel_index(index, tensor.shape)]


def observe(
    model: nn.Module,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    *,
    every: int = 1,
    max_elements: int = 1 << 16,
    be_rows: int = 64,
    backward_error: bool = True,
    plan: Plan | None = None,
    generator: torch.Generator | None = None,
    reduce_ranks: bool = True,
) -> Observer:
    """An :class:`Observer` of ``model`` (use it as a context manager; see the module docstring).

    candidates: format names to measure (bf16, the advisor's default reference, should be among them).
    every: measure every ``every``-th optimizer step. max_elements: per operand and step. be_rows: rows of
    each operand in the backward-error sub-product. plan: the plan the model runs under (monitoring).
    generator: the random source of the samples (default: a CPU generator seeded with 0).
    reduce_ranks: under ``torch.distributed``, merge each sampled step across the ranks at ``step()``.
    """
    config = ObserveConfig(tuple(candidates), every, max_elements, be_rows, backward_error, reduce_ranks)
    return Observer(model, config, plan=plan, generator=generator)


from numscope._callable import make_callable as _make_callable  # noqa: E402

_make_callable(__name__, "observe")
