"""Narrow (fp22) accumulation against a plain float32 matmul, per GEMM shape: what TE's and torchao's FP8
recipes pay for emulating their fast-accumulated GEMMs (``numscope.sites.accumulate_matmul``).

Shapes: BERT-base's GEMMs at 4 x 128 tokens (``base``) and the benchmarks' BERTs (``tiny``, ``demo``), as
(tokens, contraction, outputs). Rows per shape, timed in turn round after round: the plain matmul; fp22 as
numscope computes it (chunk sums in row slices of at most ``PARTIALS_BYTES``, into a reused buffer); and
fp22 as it was computed before (every chunk sum at once into fresh memory: ``PARTIALS_BYTES`` 256 MiB, one
row minimum, no reuse). Both fp22 rows give the same bits (checked here). Medians; ratios to the matmul.

Run: ``python benchmarks/bench_accumulate.py [--rounds N] [--threads T]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import positive_int
from numscope.sites import gemm

SHAPES: dict[str, tuple[int, int, int]] = {
    "base qkv/out": (512, 768, 768),
    "base ffn up": (512, 768, 3072),
    "base ffn down": (512, 3072, 768),
    "tiny ffn up": (4096, 128, 512),
    "tiny ffn down": (4096, 512, 128),
    "demo decoder": (2048, 128, 2000),
    "demo qkv": (2048, 128, 128),
    "demo ffn down": (2048, 256, 128),
}


def before(function: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``function`` run with the previous settings: every chunk sum at once, in fresh memory."""

    def run() -> torch.Tensor:
        kept = gemm.PARTIALS_BYTES, gemm.SLICE_MIN_ROWS, gemm.REUSE_PARTIALS
        gemm.PARTIALS_BYTES, gemm.SLICE_MIN_ROWS, gemm.REUSE_PARTIALS = 256 * 2**20, 1, False
        try:
            return function()
        finally:
            gemm.PARTIALS_BYTES, gemm.SLICE_MIN_ROWS, gemm.REUSE_PARTIALS = kept

    return run


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=7, help="timed calls per row, taken in turn")
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.rounds} rounds")
    print(f"{'shape':16s} {'(M, K, N)':>18s} {'matmul':>10s} {'fp22':>8s} {'before':>8s}")
    ratios: dict[str, list[float]] = {"fp22": [], "before": []}
    for name, (m, k, n) in SHAPES.items():
        generator = torch.Generator().manual_seed(0)
        a, b = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
        rows = {
            "matmul": lambda a=a, b=b: a @ b,
            "fp22": lambda a=a, b=b: gemm.accumulate_matmul(a, b, "fp22"),
            "before": before(lambda a=a, b=b: gemm.accumulate_matmul(a, b, "fp22")),
        }
        results = {label: row() for label, row in rows.items()}  # warm-up
        if not torch.equal(results["fp22"].view(torch.int32), results["before"].view(torch.int32)):
            raise SystemExit(f"{name}: the two fp22 paths gave different bits")
        times: dict[str, list[float]] = {label: [] for label in rows}
        for _ in range(args.rounds):
            for label, row in rows.items():
                start = time.perf_counter()
                row()
                times[label].append(time.perf_counter() - start)
        base = statistics.median(times["matmul"])
        fp22, old = (statistics.median(times[label]) / base for label in ("fp22", "before"))
        ratios["fp22"].append(fp22)
        ratios["before"].append(old)
        print(f"{name:16s} {(m, k, n)!s:>18s} {base * 1e3:7.1f} ms {fp22:7.2f}x {old:7.2f}x")
    means = {label: statistics.geometric_mean(values) for label, values in ratios.items()}
    print(f"{'geometric mean':16s} {'':>18s} {'':>10s} {means['fp22']:7.2f}x {means['before']:7.2f}x")


if __name__ == "__main__":
    main()
