"""The backward error of a quantized GEMM (Rasquinha & Tabak 2024): how far the product of two quantized
operands is from the exact one, relative to the magnitude of the terms, BE = |L·R − Q(L)·Q(R)| / (|L|·|R|),
entry by entry (dimensionless), on the whole product or a uniform random grid of its entries.

Pure tensor functions (no modules, no I/O); scaling arguments as in :mod:`numscope.metrics.errors` (the
default ``"auto"`` runs a block format's blocks along the contraction axis, as hardware does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from numscope.formats.quantize import quantize
from numscope.formats.spec import Format, get_format
from numscope.metrics.errors import AUTO, ScalingChoice, resolve_scaling


@dataclass(frozen=True)
class BackwardError:
    """Componentwise backward error of a quantized product over its output entries (dimensionless).

    BE_ij = |(a·b)_ij − (Q(a)·Q(b))_ij| / (|a|·|b|)_ij. ``mean``, ``median``, ``p99`` (99th percentile,
    linear interpolation) and ``max`` are over the ``count`` entries measured; ``excluded`` entries had a
    zero denominator. ``sampled`` says the entries were a random subset (see :func:`product_reference`):
    then ``mean`` and ``median`` estimate the full product's, while ``max`` is a lower bound of it. All
    four are NaN when no entry has a nonzero denominator.
    """

    mean: float
    median: float
    p99: float
    max: float
    count: int
    excluded: int = 0
    sampled: bool = False


@dataclass(frozen=True)
class ProductReference:
    """The float64 exact product a·b and its magnitude |a|·|b| on the measured output entries.

    rows / cols: indices of the sampled rows of a and columns of b (``None``: all). Build it once with
    :func:`product_reference` and reuse it for every pair of candidate formats of one GEMM.
    """

    exact: torch.Tensor
    magnitude: torch.Tensor
    rows: torch.Tensor | None
    cols: torch.Tensor | None
    shape: tuple[int, int, int]


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"a and b must be torch.Tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"backward_error takes 2-D operands a (m×k) and b (k×n), got shapes {tuple(a.shape)} and "
            f"{tuple(b.shape)}; flatten leading dims first (e.g. x.reshape(-1, x.shape[-1]))"
        )
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"contraction sizes differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} "
            "(a's axis 1 must equal b's axis 0)"
        )


def _sample(
    size: int, wanted: int | None, generator: torch.Generator | None, name: str
) -> torch.Tensor | None:
    if wanted is None or wanted >= size:
        return None
    if wanted < 1:
        raise ValueError(f"{name} must be a positive number of entries or None, got {wanted}")
    order = torch.randperm(size, generator=generator)
    return order[:wanted].sort().values


def product_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    sample_rows: int | None = None,
    sample_cols: int | None = None,
    generator: torch.Generator | None = None,
) -> ProductReference:
    """The float64 reference of a (m×k) · b (k×n), on all output entries or a uniform random subset.

    ``sample_rows`` rows of a and ``sample_cols`` columns of b, drawn uniformly without replacement from
    ``generator``, select a grid of output entries in which every entry is equally likely to appear: the
    mean over them is an unbiased estimate of the mean over the full product (for a fixed set of
    excluded entries), at (rows·cols·k) instead of (m·n·k) float64 work.
    """
    _check_operands(a, b)
    rows = _sample(a.shape[0], sample_rows, generator, "sample_rows")
    cols = _sample(b.shape[1], sample_cols, generator, "sample_cols")
    left = a.detach() if rows is None else a.detach()[rows.to(a.device)]
    right = b.detach() if cols is None else b.detach()[:, cols.to(b.device)]
    left, right = left.double(), right.double()
    return ProductReference(
        left @ right, left.abs() @ right.abs(), rows, cols, (a.shape[0], a.shape[1], b.shape[1])
    )


BE_STATS: tuple[str, ...] = ("mean", "median", "p99", "max", "count", "excluded")
"""The columns of :func:`backward_error_stats`, in order."""


def backward_error_stats(
    exact: torch.Tensor, products: torch.Tensor, magnitude: torch.Tensor, *, median: bool = True
) -> torch.Tensor:
    """The backward error of one or more quantized products against one exact product, summarised.

    exact, magnitude: the float64 product L·R and |L|·|R| on the measured output entries (any shape);
    products: the quantized products Q(L)·Q(R), shaped ``(P, *exact.shape)`` for P candidate pairs.
    Returns a float64 ``(P, 6)`` tensor with the columns :data:`BE_STATS`: over the entries with a
    nonzero denominator, BE = |exact − product| / magnitude, its mean, median, 99th percentile (linear
    interpolation, as ``torch.quantile``) and max, and how many entries that is (``count``); ``excluded``
    counts the entries whose denominator is 0 (their product is exactly 0 in every format, so they say
    nothing about one). An entry whose product (or error) is not finite counts as BE = inf. Mean,
    quantiles and max are NaN where ``count`` is 0. ``median=False`` leaves the median out (NaN): the 99th
    percentile then needs only each row's largest 1% (``topk``) instead of a sort of every entry.
    """
    rows = products.shape[0]
    products = products.reshape(rows, -1)
    exact, magnitude = exact.reshape(1, -1), magnitude.reshape(1, -1)
    finite_product = torch.isfinite(products)
    excluded = (magnitude == 0) & finite_product
    raw = (exact - products).abs() / magnitude.clamp_min(torch.finfo(magnitude.dtype).tiny)
    raw = torch.where(finite_product & torch.isfinite(raw), raw, torch.full_like(raw, math.inf))
    be = torch.where(excluded, torch.full_like(raw, math.nan), raw)
    count = (~excluded).sum(dim=1)
    last = (count - 1).clamp_min(0)
    below_all = torch.where(excluded, torch.full_like(be, -math.inf), be)  # excluded entries: -inf
    if median or not be.shape[1]:
        ordered = be.sort(dim=1).values  # ascending; NaN (excluded) sorts last

        def at(index: torch.Tensor) -> torch.Tensor:  # the index-th smallest entry of each row
            return ordered.gather(1, index[:, None])[:, 0]
    else:
        # the p99's two neighbours are among the ceil(1% of the entries) + 1 largest: the index-th smallest
        # of the row's count entries is the (count - 1 - index)-th largest, excluded entries (-inf) last
        entries = be.shape[1]
        top = min(entries, math.ceil(0.01 * (entries - 1)) + 1)
        largest_first = below_all.topk(top, dim=1).values

        def at(index: torch.Tensor) -> torch.Tensor:
            return largest_first.gather(1, (last - index).clamp(0, top - 1)[:, None])[:, 0]

    def quantile(level: float) -> torch.Tensor:
        position = level * last.double()
        below = position.floor().long()
        above = torch.minimum(below + 1, last)
        low, high = at(below), at(above)
        weight = position - below.double()
        between = torch.where(high == low, low, low + (high - low) * weight)
        return torch.where(weight > 0, between, low)

    total = torch.where(excluded, torch.zeros_like(be), be).sum(dim=1)
    none = count == 0
    nan = torch.full((rows,), math.nan, dtype=be.dtype, device=be.device)
    mean = torch.where(none, nan, total / count.clamp_min(1).double())
    largest = below_all.amax(dim=1)
    columns = [mean, quantile(0.5) if median else nan, quantile(0.99), largest]
    columns = [torch.where(none, nan, column) for column in columns]
    columns += [count.double(), excluded.sum(dim=1).double()]
    return torch.stack(columns, dim=1)


def backward_error_from(
    reference: ProductReference, left_q: torch.Tensor, right_q: torch.Tensor
) -> BackwardError:
    """The backward error of Q(a)·Q(b) against a :class:`ProductReference` of a·b.

    ``left_q`` and ``right_q`` are the full quantized operands (shapes m×k and k×n, as ``numscope.quantize``
    returns them); the reference's sampled rows and columns are taken from them here. The numbers are
    :func:`backward_error_stats`'s.
    """
    m, k, n = reference.shape
    if tuple(left_q.shape) != (m, k) or tuple(right_q.shape) != (k, n):
        raise ValueError(
            f"quantized operands {tuple(left_q.shape)} and {tuple(right_q.shape)} do not match the reference "
            f"product ({m}×{k})·({k}×{n})"
        )
    left = left_q.detach() if reference.rows is None else left_q.detach()[reference.rows.to(left_q.device)]
    right = (
        right_q.detach() if reference.cols is None else right_q.detach()[:, reference.cols.to(right_q.device)]
    )
    quantized = left.double() @ right.double()
    exact = reference.exact.to(quantized.device)
    magnitude = reference.magnitude.to(quantized.device)
    numbers = backward_error_stats(exact, quantized[None], magnitude)[0].tolist()
    mean, median, p99, largest, count, excluded = numbers
    sampled = reference.rows is not None or reference.cols is not None
    return BackwardError(mean, median, p99, largest, int(count), int(excluded), sampled)


def backward_error(
    a: torch.Tensor,
    b: torch.Tensor,
    format_a: str | Format,
    format_b: str | Format,
    *,
    scaling_a: ScalingChoice = AUTO,
    scaling_b: ScalingChoice = AUTO,
    rounding: str = "nearest",
    sample_rows: int | None = None,
    sample_cols: int | None = None,
    generator: torch.Generator | None = None,
) -> BackwardError:
    """Backward error of the product a (m×k) · b (k×n) when both operands are quantized.

    BE_ij = |(a·b)_ij − (Q(a)·Q(b))_ij| / Σ_k |a_ik||b_kj|, both products in float64 (entries with a zero
    denominator are excluded). It is the relative perturbation of the operands that explains the
    quantized result, so it compares formats independently of the data's scale (bf16 gives ≈ 2^-9).

    Axis convention: k is a's axis 1 and b's axis 0. With ``"auto"`` scaling an element format uses one
    current scale per tensor; a block format runs its blocks along k (``Scaling("block", axis=1)`` for a,
    ``axis=0`` for b), as hardware does. Per-channel integer scaling along k is ``scaling_a="row"``,
    ``scaling_b="column"``. ``None`` quantizes without scaling.

    Each operand is quantized whole (its scales see the whole tensor); ``sample_rows``/``sample_cols``
    then measure a uniform random grid of output entries (see :func:`product_reference`). ``generator``
    draws the sample and, for ``rounding="stochastic"``, the rounding.
    """
    _check_operands(a, b)
    spec_a, spec_b = get_format(format_a), get_format(format_b)
    left_q = quantize(
        a.detach().float(),
        spec_a,
        scaling=resolve_scaling(spec_a, scaling_a, 1),
        rounding=rounding,
        generator=generator,
    )
    right_q = quantize(
        b.detach().float(),
        spec_b,
        scaling=resolve_scaling(spec_b, scaling_b, 0),
        rounding=rounding,
        generator=generator,
    )
    reference = product_reference(a, b, sample_rows=sample_rows, sample_cols=sample_cols, generator=generator)
    return backward_error_from(reference, left_q, right_q)
