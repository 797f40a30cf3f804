"""The observer: the handler it attaches at every site, and :class:`Observer`, which measures on sampled
steps and keeps the analysis."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from numscope.analysis import (
    PLAN_LABEL,
    Analysis,
    OperandKey,
    OperandRecord,
    default_reduce,
    merge_records,
)
from numscope.convert import HANDLER_NAME as CONVERT_HANDLER
from numscope.convert import converted_plan
from numscope.distributed import is_parameter_operand, merge_analysis, world_size
from numscope.formats.cast import scale_then_cast
from numscope.formats.scaling import Scaling, default_scaling, reduce_amax_
from numscope.formats.spec import BlockFormat, Format, get_format
from numscope.metrics import candidate_metrics, log2_histogram, quantize_sample, tensor_stats
from numscope.metrics.errors import (
    Quantized,
    finite_or_zero,
    metrics_of_quantized,
    quantize_kept,
)
from numscope.observe.backward_error import BackwardErrors
from numscope.observe.config import (
    BLOCKS_LAST,
    HANDLER_NAME,
    ObserveConfig,
)
from numscope.observe.sampling import _Half, _identity, _scaling_amax, _Shared, _weak, draw
from numscope.plan import OperandSpec, Plan
from numscope.sites import Site, attach, attached, current_conv, forward_has_grad, recomputing, refresh
from numscope.vocab import Gemm, Operand


class _Handler:
    """The operand handler the observer attaches: it measures on sampled steps and is neither active nor
    wanted on the others, so that their forward runs the model's own operations without interception. A
    forward without gradients (an evaluation) is not measured unless ``no_grad_forwards``: then it is not
    active either (the per-operand check in :meth:`Observer._observe` still skips such a forward when
    another handler, e.g. ``numscope.convert``'s, keeps the interception on)."""

    def __init__(self, observer: Observer) -> None:
        self.observer = observer

    def active(self) -> bool:
        """Asked as a forward starts (its grad mode known to :func:`numscope.sites.forward_has_grad`)."""
        observer = self.observer
        return observer.sampling and (observer.config.no_grad_forwards or forward_has_grad(observer.model))

    def wants(self, site: Site) -> bool:
        return self.observer.sampling

    def __call__(self, site: Site, gemm: str, operand: str, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return self.observer._observe(site, gemm, operand, tensor, axis)


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
        self._element_candidates = {
            c: (f, default_scaling(f)) for c, f in self._formats.items() if not isinstance(f, BlockFormat)
        }
        # on rows along the contraction axis: every candidate (for the backward error), block formats with
        # their blocks along the rows
        self._row_candidates = {
            c: (f, BLOCKS_LAST if isinstance(f, BlockFormat) else default_scaling(f))
            for c, f in self._formats.items()
        }
        self._block_labels = [c for c, f in self._formats.items() if isinstance(f, BlockFormat)]
        self._shared: dict[tuple, _Shared] = {}  # this step's axis-independent measurements, by tensor
        self._step = 0
        self._handle: Any = None
        self._records: dict[OperandKey, dict[int, OperandRecord]] = {}
        self._histograms: dict[OperandKey, Any] = {}
        self._step_histograms: dict[OperandKey, Any] = {}  # the current step's, added at step()
        self._replicated: set[OperandKey] = set()  # the same on every rank: counted once when merged
        self._elements: dict[OperandKey, int] = {}
        self._plan_formats: dict[OperandKey, str] = {}
        self._site_kinds: dict[str, str] = {}  # site name -> kind, in the order the sites first ran
        self._weight_shapes: dict[str, list[int]] = {}  # Linear site -> its weight's shape (export rules)
        self._errors = BackwardErrors(self._formats, self._row_candidates, config.pairs, self.generator)
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
            self._handle = attach(self.model, _Handler(self), name=HANDLER_NAME)
        return self

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._errors.clear_waiting()
        self._shared.clear()

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
        self._errors.clear_waiting()
        self._shared.clear()
        was_sampling = self.sampling
        self._step += 1
        if self.sampling != was_sampling:
            refresh(self.model)  # sites ask the handler's wants() again

    def _merge_ranks(self) -> None:
        """Replace this step's records, histograms, element counts and backward errors by all ranks'."""
        step = self._step
        local = Analysis(
            candidates=self.config.candidates,
            operands={k: {step: v[step]} for k, v in self._records.items() if step in v},
            histograms=dict(self._step_histograms),
            backward_errors={
                g: {p: {step: s[step]} for p, s in pairs.items() if step in s}
                for g, pairs in self._errors.records.items()
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
                    records = self._errors.records.setdefault(gemm_key, {})
                    records.setdefault(pair, {})[step] = per_step_be[step]
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
            backward_errors={
                g: {p: dict(s) for p, s in pairs.items()} for g, pairs in self._errors.records.items()
            },
            elements=dict(self._elements),
            plan_formats=dict(self._plan_formats),
            meta={
                "every": self.config.every,
                "max_elements": self.config.max_elements,
                "be_rows": self.config.be_rows,
                "pairs": [list(pair) for pair in self.config.pairs],
                "steps_seen": self._step,
                "site_kinds": [[name, kind] for name, kind in self._site_kinds.items()],
                "weight_shapes": [[name, shape] for name, shape in self._weight_shapes.items()],
                **({"ranks": self._ranks} if self._ranks > 1 else {}),
            },
        )

    def records_at(self, step: int) -> dict[OperandKey, OperandRecord]:
        """Every operand's record of sampled step ``step`` (merged across ranks once :meth:`step` has
        passed it), by ``(site, gemm, operand)``; empty for a step that was not sampled."""
        return {key: per_step[step] for key, per_step in self._records.items() if step in per_step}

    def forget_before(self, step: int) -> None:
        """Drop the records and backward errors of sampled steps before ``step`` (a long adaptive run keeps
        only the window it decides from); histograms, element counts and plan formats stay."""
        for per_step in self._records.values():
            for old in [s for s in per_step if s < step]:
                del per_step[old]
        self._records = {key: per_step for key, per_step in self._records.items() if per_step}
        for pairs in self._errors.records.values():
            for per_step_be in pairs.values():
                for old in [s for s in per_step_be if s < step]:
                    del per_step_be[old]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume observing as if never interrupted: everything recorded so far
        (the analysis as JSON text, exact for every float), the step counter and the sampling generator.
        Take it between steps (after :meth:`step`)."""
        if self._step_histograms or self._errors.waiting():
            raise ValueError("Observer.state_dict() is taken between steps: call step() first")
        return {
            "analysis": json.dumps(self.analysis().to_dict(), allow_nan=True),
            "step": self._step,
            "generator": self.generator.get_state(),
            "ranks": self._ranks,
            "replicated": [list(key) for key in sorted(self._replicated)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the candidates must be the same)."""
        analysis = Analysis.from_dict(json.loads(state["analysis"]))
        candidates = tuple(c for c in analysis.candidates if c != PLAN_LABEL)
        if candidates != self.config.candidates:
            raise ValueError(
                f"the observer state was recorded with candidates {list(candidates)}, this observer "
                f"measures {list(self.config.candidates)}"
            )
        self._records = {key: dict(per_step) for key, per_step in analysis.operands.items()}
        self._histograms = dict(analysis.histograms)
        self._errors.records = {
            gemm: {pair: dict(steps) for pair, steps in pairs.items()}
            for gemm, pairs in analysis.backward_errors.items()
        }
        self._elements = dict(analysis.elements)
        self._plan_formats = dict(analysis.plan_formats)
        self._site_kinds = {str(name): str(kind) for name, kind in analysis.meta.get("site_kinds", [])}
        self._weight_shapes = {str(n): list(shape) for n, shape in analysis.meta.get("weight_shapes", [])}
        self._replicated = {tuple(key) for key in state["replicated"]}  # type: ignore[misc]
        self._step, self._ranks = int(state["step"]), int(state["ranks"])
        self.generator.set_state(state["generator"])
        self._step_histograms.clear()
        self._errors.clear_waiting()
        self._shared.clear()
        refresh(self.model)

    # -- the handler ------------------------------------------------------------------------------
    def _observe(self, site: Site, gemm: str, operand: str, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        if gemm == Gemm.FPROP and (
            recomputing(self.model) or not (self.config.no_grad_forwards or forward_has_grad(self.model))
        ):
            return tensor  # a forward recomputed by activation checkpointing was measured the first time
        self._site_kinds.setdefault(site.name, site.kind)
        if (
            operand == Operand.WEIGHT
            and gemm == Gemm.FPROP
            and tensor.dim() == 2
            and site.kind in ("linear", "conv1d")
        ):
            self._weight_shapes.setdefault(site.name, [int(d) for d in tensor.shape])
        if self.sampling and tensor.is_floating_point() and tensor.numel() > 0:
            if is_parameter_operand(site, operand):
                self._replicated.add((site.name, gemm, operand))
            with torch.no_grad():
                self._measure(site, gemm, operand, tensor, axis)
        return tensor

    def _measure(self, site: Site, gemm: str, operand: str, original: torch.Tensor, axis: int) -> None:
        key = (site.name, gemm, operand)
        step = self._step
        tensor = original.detach()
        identity = _identity(tensor)
        shared = self._shared.get(identity) if identity is not None else None
        if shared is not None:
            # the measured tensor must still live *and hold this memory*: FSDP2 frees an unsharded
            # parameter's storage after forward while the parameter lives, and the allocator may hand the
            # address to another tensor of the same size and version (a false hit, different on every run)
            owner = shared.owner()
            if owner is None or _identity(owner.detach()) != identity:
                shared = None
        if shared is not None:
            local_amax = shared.local_amax
        else:
            high, low = torch.aminmax(tensor)
            local_amax = torch.maximum(high.abs(), low.abs()).float()
        # the amax every per-tensor scale derives from, reduced across ranks as in training (one collective
        # per measured operand on every rank, whatever is reused)
        amax = reduce_amax_(local_amax.reshape(1).clone())[0]
        if shared is None:
            shared = self._shared_measurement(original, tensor, identity, local_amax, amax)
        metrics = {label: dict(values) for label, values in shared.metrics.items()}
        gemm_key = (site.name, gemm)
        rows = self._errors.rows(
            tensor, axis, gemm_key, operand, self.config.max_elements, self.config.be_rows
        )
        flat = rows.values.reshape(-1, rows.values.shape[-1])
        clean = finite_or_zero(flat)
        finite = bool(torch.isfinite(flat).all())
        blocks = {
            c: quantize_kept(clean, *self._row_candidates[c], "nearest", None, amax)
            for c in self._block_labels
        }
        metrics.update(metrics_of_quantized(clean, blocks))
        metrics = {label: metrics[label] for label in self.config.candidates}
        # block formats are measured on the rows, the rest on the element sample
        sizes = {label: clean.numel() for label in self._block_labels if clean.numel() != shared.sampled}
        plan = self._current_plan()
        if plan is not None:
            spec = plan.for_site(site.name).operand(gemm, operand)
            if not spec.is_high:
                metrics[PLAN_LABEL] = self._plan_metrics(
                    tensor, shared, clean, spec, metrics, local_amax, amax
                )
                if isinstance(spec.format_spec(), BlockFormat) and clean.numel() != shared.sampled:
                    sizes[PLAN_LABEL] = clean.numel()
                self._plan_formats[key] = spec.format
        record = OperandRecord(dict(shared.stats), metrics, shared.sampled, tensor.numel(), sizes)
        per_step = self._records.setdefault(key, {})
        if step in per_step:
            record = merge_records([per_step[step], record], default_reduce)
        per_step[step] = record
        self._elements[key] = max(self._elements.get(key, 0), record.elements)
        previous = self._step_histograms.get(key)
        self._step_histograms[key] = shared.histogram if previous is None else previous + shared.histogram
        if not self.config.backward_error:
            return
        if site.kind == "conv":  # its products are convolutions: measured through the convolution itself
            call = current_conv()
            if call is not None:
                self._errors.add_conv(gemm_key, operand, tensor, axis, amax, call, step)
            return
        # the backward error's rows, quantized as inside the whole tensor; the block formats' quantization
        # above is reused where the rows were finite (else the operand enters as it is: a non-finite
        # product flags it)
        values = rows.for_be(rows.values)
        quantized = {}
        for label, (fmt, scaling) in self._row_candidates.items():
            if finite and label in blocks:
                quantized[label] = rows.for_be(blocks[label].q.reshape(rows.values.shape))
            else:
                quantized[label] = quantize_sample(
                    values.reshape(-1, values.shape[-1]), fmt, scaling, amax=amax
                ).reshape(values.shape)
        self._errors.add(gemm_key, operand, _Half(values, quantized, rows.batch, rows.batch_shape), step)

    def _shared_measurement(
        self,
        original: torch.Tensor,
        tensor: torch.Tensor,
        identity: tuple | None,
        local_amax: torch.Tensor,
        amax: torch.Tensor,
    ) -> _Shared:
        """Statistics, histogram and element-format metrics of ``tensor``, kept for reuse when the same
        tensor (same memory, same version, still alive and still holding that memory) comes again in this
        step: the weight in fprop and dgrad, the input in fprop and wgrad, grad_output in dgrad and wgrad,
        one activation entering several projections. None of these depend on the contraction axis."""
        sample, index = self._element_sample(tensor)
        stats = tensor_stats(sample)
        stats["amax"] = float(local_amax)
        shared = _Shared(
            _weak(original),
            local_amax,
            sample,
            stats,
            candidate_metrics(sample, self._element_candidates, amax=amax),
            log2_histogram(sample),
            sample.numel(),
            index,
        )
        if identity is not None and shared.owner() is not None:
            self._shared[identity] = shared
        return shared

    def _current_plan(self) -> Plan | None:
        """The plan given to the observer, else the one the model was converted with, else None."""
        if self.plan is not None:
            return self.plan
        if CONVERT_HANDLER in attached(self.model):
            return converted_plan(self.model)
        return None

    # -- element and block samples -----------------------------------------------------------------
    def _element_sample(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole tensor (flattened, float32) or ``max_elements`` uniformly drawn elements, and the
        drawn elements' indices into the flattened tensor (None for the whole tensor)."""
        limit = self.config.max_elements
        if tensor.numel() <= limit:
            # a copy, never a view: the sample outlives the step's use of the tensor (the plan's metrics
            # reuse it in backward), and FSDP2 frees an unsharded parameter's storage after forward
            return tensor.reshape(-1).to(torch.float32, copy=True), None
        index = draw(self.generator, tensor.numel(), limit).to(tensor.device)
        if tensor.is_contiguous():
            return tensor.reshape(-1)[index].float(), index
        return tensor[torch.unravel_index(index, tensor.shape)].float(), index

    def _plan_metrics(
        self,
        tensor: torch.Tensor,
        shared: _Shared,
        rows: torch.Tensor,
        spec: OperandSpec,
        measured: dict[str, dict[str, float]],
        local_amax: torch.Tensor,
        amax: torch.Tensor,
    ) -> dict[str, float]:
        """The plan's format and scaling (rounding to nearest). A spec that is a candidate with its default
        scaling reuses that candidate's numbers. Delayed scaling is measured as current per-tensor scaling
        (the observer does not hold the runtime's amax history). Row, column and tile scaling are measured
        on the element sample, each element scaled by its row's, column's or tile's amax in the whole tensor
        (:func:`_scaling_amax`: reductions that keep one value per row, column or tile), as
        ``numscope.quantize`` scales it."""
        fmt = spec.format_spec()
        assert fmt is not None
        if spec.scaling is None and fmt.name in measured:
            return dict(measured[fmt.name])
        scaling = spec.effective_scaling()
        if scaling is not None and scaling.kind == "delayed":
            scaling = Scaling(
                "tensor",
                margin=scaling.margin,
                power_of_two=scaling.power_of_two,
                reduce_amax=scaling.reduce_amax,
                amax_epsilon=scaling.amax_epsilon,
            )
        if isinstance(fmt, BlockFormat):
            return candidate_metrics(rows, {PLAN_LABEL: (fmt, BLOCKS_LAST)}, amax=amax)[PLAN_LABEL]
        if scaling is None or scaling.kind == "tensor":
            scale_amax = amax if scaling is None or scaling.reduce_amax else local_amax
            return candidate_metrics(shared.sample, {PLAN_LABEL: (fmt, scaling)}, amax=scale_amax)[PLAN_LABEL]
        index = shared.index
        if index is None:
            index = torch.arange(tensor.numel(), device=tensor.device)
        clean = finite_or_zero(shared.sample)
        scale = scaling.scale(_scaling_amax(tensor, index, fmt, scaling), fmt.max)
        kept = Quantized(*scale_then_cast(clean, fmt, scale), None, fmt, -1)  # type: ignore[arg-type]
        return metrics_of_quantized(clean, {PLAN_LABEL: kept})[PLAN_LABEL]
