"""Float64 sums of squares and products over large float32 tensors, a slice at a time.

Why: ``float((a.double() - b.double()).pow(2).sum())`` over a model's flat gradient (110M elements on
MPNet-110M) allocates three float64 temporaries of 880 MB each, which the allocator maps and unmaps
afresh on every call; the measurements that compare gradients call it once per pass. A slice of
:data:`SLICE` elements keeps the temporaries in cache: the same sums (in float64, up to the order of
their additions), faster (``benchmarks/bench_sums.py``; docs/results/benchmarks.md)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

SLICE = 1 << 18
"""Elements per slice (2 MiB of float64). Only fresh tensors are changed in place (a float64 input's
``.double()`` is the input itself)."""


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1)


def power(x: torch.Tensor) -> float:
    """Σ x² in float64."""
    flat = _flat(x)
    # a float32 slice's float64 copy is squared in place; a float64 input is not touched
    square = torch.square if flat.dtype == torch.float64 else torch.Tensor.square_
    return sum(
        float(square(flat[start : start + SLICE].double()).sum()) for start in range(0, flat.numel(), SLICE)
    )


def distance_power(a: torch.Tensor, b: torch.Tensor) -> float:
    """Σ (a − b)² in float64 (the difference taken in float64, as the whole-tensor sums took it)."""
    x, y = _flat(a), _flat(b)
    if x.numel() != y.numel():
        raise ValueError(f"distance_power of tensors of {x.numel()} and {y.numel()} elements")
    total = 0.0
    for start in range(0, x.numel(), SLICE):
        difference = x[start : start + SLICE].double() - y[start : start + SLICE].double()
        total += float(difference.square_().sum())  # a fresh tensor
    return total


def moments(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float, float]:
    """(Σ a², Σ b², Σ a·b, Σ (a − b)²) in float64, in one pass over both tensors."""
    x, y = _flat(a), _flat(b)
    if x.numel() != y.numel():
        raise ValueError(f"moments of tensors of {x.numel()} and {y.numel()} elements")
    aa = bb = ab = dd = 0.0
    for start in range(0, x.numel(), SLICE):
        u, v = x[start : start + SLICE].double(), y[start : start + SLICE].double()
        aa += float(torch.dot(u, u))
        bb += float(torch.dot(v, v))
        ab += float(torch.dot(u, v))
        dd += float((u - v).square_().sum())
    return aa, bb, ab, dd


def slices(*tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Consecutive slices of :data:`SLICE` elements of equally long tensors, flattened, side by side."""
    flat = [_flat(t) for t in tensors]
    count = flat[0].numel()
    if any(f.numel() != count for f in flat):
        raise ValueError(f"slices of tensors of {', '.join(str(f.numel()) for f in flat)} elements")
    for start in range(0, count, SLICE):
        yield tuple(f[start : start + SLICE] for f in flat)
