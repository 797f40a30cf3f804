"""Float64 sums over a model's flat gradient: whole-tensor float64 temporaries (how numscope's sensitivity
and forecast measurements summed before) against :mod:`numscope._sums`' slices, side by side.

Rows, each timed in turn round after round (medians; ratios old / new): Σ (a − b)², as the local
sensitivity's gain passes compare each pass's gradient with the reference; and the four sums the
one-at-a-time sensitivity takes per pass (‖a‖, ‖b‖, ⟨a, b⟩, ‖a − b‖). ``--elements`` defaults to
MPNet-110M's trainable parameters. Both ways' values are printed: equal up to the order of the float64
additions.

Run: ``python benchmarks/bench_sums.py [--elements N] [--rounds N] [--threads T]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import positive_int
from numscope import _sums


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=positive_int, default=109_486_651, help="vector length")
    parser.add_argument("--rounds", type=positive_int, default=5, help="timed rounds per row (default: 5)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (default: 1)")
    return parser.parse_args(argv)


def whole_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).pow(2).sum())


def whole_moments(a: torch.Tensor, b: torch.Tensor) -> tuple[float, ...]:
    x, y = a.double(), b.double()
    return float(x.norm()) ** 2, float(y.norm()) ** 2, float(x @ y), float((x - y).norm()) ** 2


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(args.elements, generator=generator)
    b = a + 1e-3 * torch.randn(args.elements, generator=generator)
    rows: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "sum (a-b)^2": (lambda: whole_distance(a, b), lambda: _sums.distance_power(a, b)),
        "norms, inner, distance": (lambda: whole_moments(a, b), lambda: _sums.moments(a, b)),
    }
    print(f"{args.elements:,} float32 elements, {args.threads} thread(s), {args.rounds} rounds, medians")
    print(f"{'row':<24} {'whole (s)':>10} {'sliced (s)':>11} {'ratio':>7}  values (whole; sliced)")
    for name, (old, new) in rows.items():
        times: dict[str, list[float]] = {"old": [], "new": []}
        values = {}
        for _ in range(args.rounds):
            for key, function in (("old", old), ("new", new)):
                began = time.perf_counter()
                values[key] = function()
                times[key].append(time.perf_counter() - began)
        before, after = statistics.median(times["old"]), statistics.median(times["new"])
        ratio = before / after
        print(f"{name:<24} {before:>10.3f} {after:>11.3f} {ratio:>6.1f}x  {values['old']}; {values['new']}")


if __name__ == "__main__":
    main()
