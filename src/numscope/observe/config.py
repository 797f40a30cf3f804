"""What the observer measures: its candidates, sampling sizes and defaults (:class:`ObserveConfig`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from numscope.formats.scaling import Scaling
from numscope.formats.spec import get_format

DEFAULT_CANDIDATES: tuple[str, ...] = (
    "bf16",
    "fp16",
    "fp8_e4m3",
    "fp8_e5m2",
    "int8",
    "mxfp8_e4m3",
    "mxfp6_e3m2",
    "mxfp6_e2m3",
    "mxfp4_e2m1",
    "nvfp4",
)
"""What :func:`observe` measures unless told otherwise, and the one default list of numscope: ``numscope
analyze``, ``numscope demo`` and ``benchmarks/bench_observer.py`` measure these too. bf16 (the advisor's
reference), fp16, the 8-bit element formats, and the 8-, 6- and 4-bit block formats of current hardware."""

HIGH_LABEL = "fp32"
BE_RECORDED = ("mean", "p99", "max", "count", "excluded")
"""The backward-error statistics recorded per GEMM, pair and step (see
:func:`numscope.metrics.backward_error.backward_error_stats`)."""
BATCH_ENTRIES = 4
MIN_ROWS = 8
"""Rows drawn at least (fewer if ``be_rows`` is smaller), whatever the contraction length."""
HANDLER_NAME = "numscope.observe"
BLOCKS_LAST = Scaling("block", axis=-1)


@dataclass(frozen=True)
class ObserveConfig:
    """What the observer measures and how much of each tensor.

    candidates: format names (canonical names are stored).
    every: sample every ``every``-th step (steps count from 0).
    max_elements: the most elements measured per operand and sampled step (see the module docstring).
    be_rows: rows of each operand in the backward-error sub-product (``be_rows × be_rows`` inner products).
    backward_error: whether to compute backward errors at all.
    pairs: mixed candidate pairs ``(A, B)`` whose backward error is measured in every GEMM, the GEMM's left
        operand (fprop: input, dgrad and wgrad: grad_output) in A and its right one in B; ``None``: the fp8
        hybrid's ``("fp8_e5m2", "fp8_e4m3")`` where both are candidates. Pairs of one format are always
        measured.
    reduce_ranks: under ``torch.distributed``, merge each sampled step across the ranks at
        :meth:`Observer.step`.
    no_grad_forwards: also measure forwards run without gradients (``torch.no_grad()``: evaluation,
        inference). Off by default: an evaluation between training steps would otherwise be merged into
        the step's records (other operands, other sizes), and under ``torch.distributed`` a forward run on
        one rank only would wait for the others.
    """

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    every: int = 1
    max_elements: int = 1 << 14
    be_rows: int = 64
    backward_error: bool = True
    reduce_ranks: bool = True
    no_grad_forwards: bool = False
    pairs: tuple[tuple[str, str], ...] | None = None

    def __post_init__(self) -> None:
        names = tuple(dict.fromkeys(get_format(c).name for c in self.candidates))
        if not names:
            raise ValueError("observe needs at least one candidate format")
        object.__setattr__(self, "candidates", names)
        if self.pairs is None:
            hybrid = ("fp8_e5m2", "fp8_e4m3")
            pairs = (hybrid,) if set(hybrid) <= set(names) else ()
        else:
            pairs = tuple(self._pair(pair) for pair in self.pairs)
        object.__setattr__(self, "pairs", tuple(dict.fromkeys(p for p in pairs if p[0] != p[1])))
        for name in ("every", "max_elements", "be_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"observe: {name} must be a positive int, got {value!r}")

    def _pair(self, pair: Any) -> tuple[str, str]:
        if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"observe: a pair is two candidate formats (left, right), got {pair!r}")
        left, right = (get_format(name).name for name in pair)
        for name in (left, right):
            if name not in self.candidates:
                raise ValueError(
                    f"observe: pair {tuple(pair)!r}: {name!r} is not a candidate; candidates: "
                    f"{', '.join(self.candidates)}"
                )
        return left, right
