"""The operands a plan study assigns formats to: every measured GEMM operand of a model, in call order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from numscope._names import natural_key
from numscope.analysis import Analysis, OperandKey
from numscope.plan import OperandSpec
from numscope.study.config import StudyError
from numscope.vocab import GEMMS


@dataclass(frozen=True)
class Operands:
    """The operands a plan assigns: keys in the model's site order, and each one's element count."""

    keys: tuple[OperandKey, ...]
    elements: Mapping[OperandKey, int]

    @classmethod
    def from_analysis(cls, analysis: Analysis, site_order: Sequence[str] | None = None) -> Operands:
        """Every operand the analysis measured, ordered by ``site_order`` (the model's call order; default:
        the order the observer saw the sites run, ``analysis.meta["site_kinds"]``; sites neither lists follow
        in natural order), then GEMM and operand. So "the last layers" of a Llama end at its ``lm_head``,
        whatever its name sorts as."""
        if site_order is None:
            site_order = [name for name, _ in analysis.meta.get("site_kinds", ())]
        order = {site: i for i, site in enumerate(site_order)}
        measured = analysis.keys()
        keys = [k for k in measured if analysis.elements.get(k, 0) > 0]
        if not keys:
            raise StudyError("the analysis holds no operand with elements; observe at least one step first")

        def sort_key(key: OperandKey) -> tuple:
            site, gemm, operand = key
            return (order.get(site, len(order)), natural_key(site), GEMMS.index(gemm), operand)

        keys.sort(key=sort_key)
        return cls(tuple(keys), {k: int(analysis.elements[k]) for k in keys})

    def sites(self) -> list[str]:
        return list(dict.fromkeys(k[0] for k in self.keys))

    def sizes(self) -> dict[str, dict[tuple[str, str], int]]:
        """``site → (gemm, operand) → elements``, as :meth:`Plan.average_bits` takes them."""
        out: dict[str, dict[tuple[str, str], int]] = {}
        for site, gemm, operand in self.keys:
            out.setdefault(site, {})[(gemm, operand)] = self.elements[(site, gemm, operand)]
        return out

    def average_bits(self, formats: Mapping[OperandKey, str]) -> float:
        total = sum(self.elements.values())
        return sum(format_bits(formats[k]) * n for k, n in self.elements.items()) / total


def format_bits(label: str) -> float:
    """Bits per element of a format, its block scales included (MXFP4: 4.25)."""
    return OperandSpec(label).bits_per_element()
