"""Statistics of one high-precision tensor: range, histogram of binades, tail shape.

Pure tensor functions (no modules, no I/O). They run in the tensor's own precision (float32 for float32,
bf16 and fp16; float64 for float64), on its device, in a few passes; the tail fit looks at a fixed-size
random subsample. Non-finite elements (inf, NaN) are left out of every statistic and counted apart.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

FLOAT32_EXPONENTS = range(-149, 128)
"""floor(log2|x|) of every nonzero finite float32 (subnormals included): the default histogram bins."""

T_FIT_SAMPLE = 1 << 16
"""Elements the Student-t fit looks at (a uniform random subsample, with replacement, of larger tensors)."""

T_FIT_QUANTILES = (0.5, 0.99)
"""Quantiles of |x − median| whose ratio the Student-t fit matches."""

T_DOF_RANGE = (1.0, 1000.0)
"""The degrees of freedom the fit resolves; lighter tails than ν = 1000 are reported as ``inf``."""


def _working(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached, flattened, in float32 (float64 stays float64)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    x = x.detach().reshape(-1)
    if x.dtype == torch.float64:
        return x
    return x.float()


def _finite(x: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(x)
    return x if bool(finite.all()) else x[finite]


def dynamic_range_binades(x: torch.Tensor) -> float:
    """log2(max|x| / min nonzero |x|) over the finite elements, in binades; 0.0 without nonzeros."""
    values = _finite(_working(x)).abs()
    nonzero = values[values > 0]
    if nonzero.numel() == 0:
        return 0.0
    return math.log2(float(nonzero.max())) - math.log2(float(nonzero.min()))


@dataclass(frozen=True)
class Log2Histogram:
    """Counts of floor(log2|x|) per binade over fixed integer bins, so histograms add exactly.

    ``counts[i]`` counts the nonzero finite elements with floor(log2|x|) = ``low + i`` (so 2^(low+i) ≤ |x| <
    2^(low+i+1)); ``below``/``above`` those whose exponent lies under/over the bins, ``zeros`` the exact
    zeros and ``nonfinite`` the infs and NaNs. Histograms over the same bins from different steps or
    ranks merge with ``+``.
    """

    low: int
    counts: tuple[int, ...]
    zeros: int = 0
    below: int = 0
    above: int = 0
    nonfinite: int = 0

    @property
    def exponents(self) -> range:
        """The binade exponents the bins stand for."""
        return range(self.low, self.low + len(self.counts))

    @property
    def total(self) -> int:
        """Every element counted (nonzero, zero and non-finite)."""
        return sum(self.counts) + self.zeros + self.below + self.above + self.nonfinite

    def __add__(self, other: Log2Histogram) -> Log2Histogram:
        if not isinstance(other, Log2Histogram):
            return NotImplemented
        if other.exponents != self.exponents:
            raise ValueError(
                f"cannot merge histograms over binades {self.exponents.start}..{self.exponents.stop - 1} "
                f"and {other.exponents.start}..{other.exponents.stop - 1}; use the same bins"
            )
        return Log2Histogram(
            self.low,
            tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)),
            self.zeros + other.zeros,
            self.below + other.below,
            self.above + other.above,
            self.nonfinite + other.nonfinite,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; :meth:`from_dict` inverts it."""
        return {
            "low": self.low,
            "counts": list(self.counts),
            "zeros": self.zeros,
            "below": self.below,
            "above": self.above,
            "nonfinite": self.nonfinite,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Log2Histogram:
        return cls(
            int(data["low"]),
            tuple(int(c) for c in data["counts"]),
            int(data.get("zeros", 0)),
            int(data.get("below", 0)),
            int(data.get("above", 0)),
            int(data.get("nonfinite", 0)),
        )


def log2_histogram(x: torch.Tensor, exponents: range = FLOAT32_EXPONENTS) -> Log2Histogram:
    """Histogram of floor(log2|x|) over the integer binades ``exponents`` (see :class:`Log2Histogram`).

    The default bins hold every nonzero float32, bf16 and fp16 value, so nothing lands in ``below`` or
    ``above`` unless the input is float64 or the bins are narrowed.
    """
    if not isinstance(exponents, range) or exponents.step != 1 or len(exponents) == 0:
        raise ValueError(f"exponents must be a non-empty range of consecutive integers, got {exponents!r}")
    values = _working(x)
    nbins = len(exponents)
    _, exponent = torch.frexp(values)
    index = (exponent.long() - 1 - exponents.start).clamp(-1, nbins) + 1  # 0: below, nbins + 1: above
    index = torch.where(values == 0, torch.full_like(index, nbins + 2), index)
    index = torch.where(torch.isfinite(values), index, torch.full_like(index, nbins + 3))
    tally = torch.bincount(index, minlength=nbins + 4).tolist()
    return Log2Histogram(
        exponents.start,
        tuple(tally[1 : nbins + 1]),
        zeros=tally[nbins + 2],
        below=tally[0],
        above=tally[nbins + 1],
        nonfinite=tally[nbins + 3],
    )


def _moments(values: torch.Tensor) -> tuple[float, float, float]:
    """(mean, variance, fourth central moment) of finite ``values``, computed on values / amax."""
    amax = values.abs().max()
    unit = values / amax if float(amax) > 0 else values
    deviation = unit - unit.mean()
    squared = deviation * deviation
    scale = float(amax) if float(amax) > 0 else 1.0
    fourth = float((squared * squared).mean()) * scale**4
    return float(unit.mean()) * scale, float(squared.mean()) * scale**2, fourth


def kurtosis(x: torch.Tensor) -> float:
    """*Excess* kurtosis m4 / m2² − 3 of the finite elements (0 for a Gaussian, > 0 for heavy tails).

    Dimensionless; the biased (population) moments, as ``scipy.stats.kurtosis(fisher=True, bias=True)``.
    NaN when the variance is 0 or there are no finite elements.
    """
    values = _finite(_working(x))
    if values.numel() == 0:
        return math.nan
    _, variance, fourth = _moments(values)
    if variance == 0:
        return math.nan
    return fourth / variance**2 - 3.0


@functools.lru_cache(maxsize=1)
def _t_quantile_ratios() -> tuple[np.ndarray, np.ndarray]:
    """(ν grid, q_hi/q_lo of |T_ν|) for the quantiles :data:`T_FIT_QUANTILES`, decreasing in ν.

    With T = √ν·tan θ the angle θ ∈ (−π/2, π/2) has density ∝ cos^(ν−1) θ, so the quantiles of |T| come
    from one cumulative integral over θ (no special functions) and √ν cancels in their ratio.
    """
    dofs = np.geomspace(*T_DOF_RANGE, 121)
    theta = np.pi / 2 * (1.0 - (1.0 - np.linspace(0.0, 1.0, 8193)) ** 3)  # dense near π/2, the tail
    density = np.cos(theta)[None, :] ** (dofs[:, None] - 1.0)
    steps = 0.5 * (density[:, 1:] + density[:, :-1]) * np.diff(theta)[None, :]
    cdf = np.concatenate([np.zeros((len(dofs), 1)), np.cumsum(steps, axis=1)], axis=1)
    cdf /= cdf[:, -1:]
    low, high = T_FIT_QUANTILES
    ratios = np.array([np.tan(np.interp(high, c, theta)) / np.tan(np.interp(low, c, theta)) for c in cdf])
    return dofs, ratios


def student_t_dof(x: torch.Tensor, *, generator: torch.Generator | None = None) -> float:
    """Degrees of freedom ν of the Student-t whose tail shape matches ``x`` (small ν: heavy tails).

    Method (robust, scale-free, a few milliseconds at any size): take the ratio of the 99% and 50%
    quantiles of |x − median(x)| over at most :data:`T_FIT_SAMPLE` finite elements (a uniform random
    subsample with replacement of larger tensors, drawn from ``generator`` or a fixed seed), and find the ν
    whose t distribution has that ratio. Results lie in [1, 1000]; tails lighter than ν = 1000 give
    ``inf`` (a Gaussian's ratio 3.82 is the limit) and tails heavier than Cauchy give 1.0. NaN when more
    than half the elements equal the median (e.g. mostly zeros). The median is the lower middle element
    (as ``torch.median``), the quantiles interpolate linearly (as ``torch.quantile``).
    """
    return _t_dof_of_finite(_finite(_working(x)), generator)


def _order_statistic(array: np.ndarray, index: int) -> float:
    """The ``index``-th smallest element (0-based), by selection."""
    return float(np.partition(array, index)[index])


def _quantile(array: np.ndarray, level: float) -> float:
    """The ``level`` quantile with linear interpolation between order statistics (``numpy.quantile``'s and
    ``torch.quantile``'s default), by one selection instead of a sort."""
    position = level * (array.size - 1)
    below = math.floor(position)
    parted = np.partition(array, below)
    low = float(parted[below])
    if below + 1 >= array.size:
        return low
    high = float(parted[below + 1 :].min())
    return low + (high - low) * (position - below)


def _t_dof_of_finite(values: torch.Tensor, generator: torch.Generator | None = None) -> float:
    if values.numel() < 2:
        return math.nan
    if values.numel() > T_FIT_SAMPLE:
        if generator is None:
            generator = torch.Generator().manual_seed(0)
        index = torch.randint(values.numel(), (T_FIT_SAMPLE,), generator=generator, device=generator.device)
        values = values[index.to(values.device)]
    # order statistics by selection (numpy's introselect), not a full sort: O(n) on a bounded sample
    array = values.detach().double().cpu().numpy()
    median = _order_statistic(array, (array.size - 1) // 2)
    spread = np.abs(array - median)
    low, high = (_quantile(spread, level) for level in T_FIT_QUANTILES)
    if low == 0:
        return math.nan
    ratio = float(high / low)
    dofs, ratios = _t_quantile_ratios()
    if ratio <= ratios[-1]:
        return math.inf
    if ratio >= ratios[0]:
        return float(dofs[0])
    return float(np.exp(np.interp(ratio, ratios[::-1], np.log(dofs[::-1]))))


def tensor_stats(x: torch.Tensor) -> dict[str, float]:
    """Summary statistics of a high-precision tensor, keyed by legible names.

    ``amax`` and ``rms`` (units of x), ``dynamic_range`` (binades, :func:`dynamic_range_binades`),
    ``kurtosis`` (excess, :func:`kurtosis`), ``t_dof`` (:func:`student_t_dof`), ``zeros%`` and
    ``nonfinite%`` (percent of all elements). Statistics other than ``nonfinite%`` cover finite elements.
    The reductions run on the tensor's device and come back to the host together (one transfer).
    """
    values = _working(x)
    total = values.numel()
    finite = _finite(values)
    nonfinite = total - finite.numel()
    if finite.numel() == 0:
        nan = math.nan
        return {
            "amax": nan,
            "rms": nan,
            "dynamic_range": 0.0,
            "kurtosis": nan,
            "t_dof": nan,
            "zeros%": 0.0,
            "nonfinite%": 100.0 * nonfinite / max(total, 1),
        }
    magnitude = finite.abs()
    amax_t = magnitude.max()
    divisor = torch.where(amax_t > 0, amax_t, torch.ones_like(amax_t))
    unit = finite / divisor  # in [-1, 1]: squares and fourth powers cannot overflow
    deviation = unit - unit.mean()
    squared = deviation * deviation
    smallest = torch.where(magnitude > 0, magnitude, torch.full_like(magnitude, math.inf)).min()
    summary = torch.stack(
        [
            amax_t.to(unit.dtype),
            smallest.to(unit.dtype),
            (magnitude == 0).sum().to(unit.dtype),
            (unit * unit).mean(),
            squared.mean(),
            (squared * squared).mean(),
        ]
    ).tolist()
    amax, min_nonzero, zeros, mean_square, variance, fourth = summary
    if min_nonzero < math.inf:
        dynamic_range = math.log2(amax) - math.log2(min_nonzero)
        rms = amax * mean_square**0.5
    else:
        dynamic_range, rms = 0.0, 0.0
    return {
        "amax": amax,
        "rms": rms,
        "dynamic_range": dynamic_range,
        "kurtosis": fourth / variance**2 - 3.0 if variance > 0 else math.nan,
        "t_dof": _t_dof_of_finite(finite),
        "zeros%": 100.0 * zeros / total,
        "nonfinite%": 100.0 * nonfinite / total,
    }
