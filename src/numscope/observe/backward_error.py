"""The backward error of each GEMM's sampled products (Rasquinha & Tabak 2024): an operand, with its
quantization in every candidate format, waits for its GEMM partner; with both in, every candidate pair's
componentwise |L·R − Q(L)·Q(R)| / (|L|·|R|) is recorded for the step. Linear products are computed on rows
along the contraction axis (:func:`numscope.observe.sampling.draw_rows`); a convolution's through the
convolution itself, on a few batch entries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from numscope.analysis import merge_be_stats
from numscope.metrics import quantize_sample
from numscope.metrics.backward_error import BE_STATS, backward_error_stats
from numscope.observe.config import BATCH_ENTRIES, BE_RECORDED, HIGH_LABEL
from numscope.observe.sampling import _ConvHalf, _Half, _Rows, draw_rows
from numscope.sites import ConvCall
from numscope.vocab import OPERANDS, Gemm, Operand

#: per (site, gemm), per (left, right) format pair, per step: the recorded statistics
Records = dict[tuple[str, str], dict[tuple[str, str], dict[int, dict[str, float]]]]


class BackwardErrors:
    """The observer's backward errors: operands waiting for their partners and what the pairs recorded.

    labels: the candidate formats, in order; row_candidates: each one's (format, scaling) on rows along the
    contraction axis; pairs: the mixed pairs measured besides (fmt, fp32), (fp32, fmt) and (fmt, fmt);
    generator: the observer's sampling generator (conv batch entries, rows).
    """

    def __init__(
        self,
        labels: Sequence[str],
        row_candidates: Mapping[str, tuple[Any, Any]],
        pairs: Sequence[tuple[str, str]],
        generator: torch.Generator,
    ) -> None:
        self.labels = list(labels)
        self.row_candidates = dict(row_candidates)
        self.pairs = list(pairs)
        self.generator = generator
        self.records: Records = {}
        self._pending: dict[tuple[str, str], dict[str, _Half]] = {}
        self._pending_conv: dict[tuple[str, str], dict[str, _ConvHalf]] = {}

    def waiting(self) -> bool:
        """Whether an operand still waits for its partner (a step in progress)."""
        return bool(self._pending or self._pending_conv)

    def clear_waiting(self) -> None:
        """Forget the operands waiting (a step ended, or the observer detached)."""
        self._pending.clear()
        self._pending_conv.clear()

    def rows(
        self,
        tensor: torch.Tensor,
        axis: int,
        gemm_key: tuple[str, str],
        operand: str,
        max_elements: int,
        be_rows: int,
    ) -> _Rows:
        """The rows of ``tensor`` along ``axis`` (:func:`draw_rows`), drawn within the batch entries its
        waiting partner drew, if any."""
        partner = self._pending.get(gemm_key, {}).get(next(o for o in OPERANDS[gemm_key[1]] if o != operand))
        return draw_rows(tensor, axis, partner, max_elements, be_rows, self.generator)

    def add(self, gemm_key: tuple[str, str], operand: str, half: _Half, step: int) -> None:
        waiting = self._pending.setdefault(gemm_key, {})
        partner_name = next(o for o in OPERANDS[gemm_key[1]] if o != operand)
        partner = waiting.get(partner_name)
        if partner is None or partner.rows.shape[-1] != half.rows.shape[-1]:
            waiting.clear()
            waiting[operand] = half
            return
        del waiting[partner_name]
        left, right = (half, partner) if OPERANDS[gemm_key[1]][0] == operand else (partner, half)
        self._record(gemm_key, step, left, right)

    def add_conv(
        self,
        gemm_key: tuple[str, str],
        operand: str,
        tensor: torch.Tensor,
        axis: int,
        amax: torch.Tensor,
        call: ConvCall,
        step: int,
    ) -> None:
        """One operand of a convolution's GEMM with its quantizations (each as inside the whole tensor, along
        the contraction axis), up to ``BATCH_ENTRIES`` batch entries of it (shared with the partner in wgrad);
        with its partner waiting, the backward error of the convolution's own products (:meth:`_conv`)."""
        waiting = self._pending_conv.setdefault(gemm_key, {})
        partner = waiting.get(next(o for o in OPERANDS[gemm_key[1]] if o != operand))
        batch = None
        if operand != Operand.WEIGHT:  # input and grad_output carry the batch
            if partner is not None and partner.batch is not None:
                batch = partner.batch
            else:
                count = min(BATCH_ENTRIES, tensor.shape[0])
                order = torch.randperm(
                    tensor.shape[0], generator=self.generator, device=self.generator.device
                )
                batch = order[:count].to(tensor.device)
        values = tensor.float()
        # blocks along channels (axis != 0): the drawn entries quantize alone; along the batch (wgrad's axis
        # 0): each candidate quantizes the whole tensor, and only the drawn entries are kept
        if batch is not None and axis != 0:
            values = values[batch]
        moved = values.movedim(axis, -1)
        keep = batch if batch is not None and axis == 0 else None
        quantized = {}
        for label, (fmt, scaling) in self.row_candidates.items():
            rows = quantize_sample(moved.reshape(-1, moved.shape[-1]), fmt, scaling, amax=amax)
            whole = rows.reshape(moved.shape).movedim(-1, axis)
            quantized[label] = whole if keep is None else whole[keep]
        half = _ConvHalf(values if keep is None else values[keep], quantized, batch)
        if partner is None:
            waiting.clear()
            waiting[operand] = half
            return
        waiting.clear()
        left, right = (half, partner) if OPERANDS[gemm_key[1]][0] == operand else (partner, half)
        self._conv(gemm_key, step, left, right, call)

    def _conv(
        self, gemm_key: tuple[str, str], step: int, left: _ConvHalf, right: _ConvHalf, call: ConvCall
    ) -> None:
        """Every candidate pair's backward error on every output entry of the drawn batch entries: a
        convolution is linear in each operand, so |L·R − Q(L)·Q(R)| / (|L|·|R|) per output entry is the
        convolution's own product of (L, R), (Q(L), Q(R)) and (|L|, |R|), in float64."""
        product = {Gemm.FPROP: call.forward, Gemm.DGRAD: call.grad_input, Gemm.WGRAD: call.grad_weight}[
            gemm_key[1]
        ]
        labels = self.labels
        exact_left, exact_right = left.values.double(), right.values.double()
        exact = product(exact_left, exact_right)
        magnitude = product(exact_left.abs(), exact_right.abs())
        pairs = [(c, HIGH_LABEL) for c in labels] + [(HIGH_LABEL, c) for c in labels]
        pairs += [(c, c) for c in labels] + list(self.pairs)

        def side(half: _ConvHalf, label: str, exact_values: torch.Tensor) -> torch.Tensor:
            return exact_values if label == HIGH_LABEL else half.quantized[label].double()

        stats = [  # one pair at a time: a convolution's output can be large (float64, every drawn entry)
            backward_error_stats(
                exact,
                product(side(left, a, exact_left), side(right, b, exact_right))[None],
                magnitude,
                median=False,
            )[0]
            for a, b in pairs
        ]
        self._store(gemm_key, step, pairs, torch.stack(stats))

    def _record(self, gemm_key: tuple[str, str], step: int, left: _Half, right: _Half) -> None:
        """Every candidate pair's backward error on the sampled sub-product, in one batched product."""
        labels = self.labels
        exact_left, exact_right = left.rows.double(), right.rows.double().transpose(-1, -2)
        quantized_left = torch.stack([left.quantized[c] for c in labels]).double()
        quantized_right = torch.stack([right.quantized[c] for c in labels]).double()
        quantized_right = quantized_right.transpose(-1, -2)
        exact = exact_left @ exact_right
        magnitude = exact_left.abs() @ exact_right.abs()
        index = {label: i for i, label in enumerate(labels)}
        left_index = [index[a] for a, _ in self.pairs]
        right_index = [index[b] for _, b in self.pairs]
        products = torch.cat(
            [
                quantized_left @ exact_right,  # (fmt, fp32): the left operand quantized
                exact_left @ quantized_right,  # (fp32, fmt)
                quantized_left @ quantized_right,  # (fmt, fmt)
                quantized_left[left_index] @ quantized_right[right_index],  # (A, B): the mixed pairs
            ]
        )
        pairs = [(c, HIGH_LABEL) for c in labels] + [(HIGH_LABEL, c) for c in labels]
        pairs += [(c, c) for c in labels] + list(self.pairs)
        self._store(gemm_key, step, pairs, backward_error_stats(exact, products, magnitude, median=False))

    def _store(
        self, gemm_key: tuple[str, str], step: int, pairs: list[tuple[str, str]], stats_rows: torch.Tensor
    ) -> None:
        numbers = stats_rows.tolist()  # the median is not recorded
        per_gemm = self.records.setdefault(gemm_key, {})
        for pair, row in sorted(zip(pairs, numbers, strict=True)):
            stats = {name: value for name, value in zip(BE_STATS, row, strict=True) if name in BE_RECORDED}
            per_step = per_gemm.setdefault(pair, {})
            # a GEMM called again in this step (a site called twice): its entries join the step's
            per_step[step] = merge_be_stats([per_step[step], stats]) if step in per_step else stats
