"""Throughput of numscope.quantize, eager and compiled, against clone() and peer libraries.

Run: ``.venv/bin/python benchmarks/bench_quantize.py`` (16M float32 elements) or ``--quick``.
Every row is elements per second (median of several timed runs after a warm-up) and its ratio to
``x.clone()`` (the memory-bandwidth limit of this machine), timed alternately with the row so that the
load of a shared machine affects both alike. Compile time of the fast path is its first
call (per configuration), reported separately.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable

import torch

import numscope
from numscope.formats import set_fast

CASES: list[tuple[str, str, str | None]] = [
    ("fp8_e4m3, tensor scaling", "fp8_e4m3", "tensor"),
    ("bf16", "bf16", None),
    ("mxfp8_e4m3", "mxfp8_e4m3", None),
    ("mxfp4_e2m1", "mxfp4_e2m1", None),
    ("nvfp4", "nvfp4", None),
    ("int8, tensor scaling", "int8", "tensor"),
]


def paired_seconds(
    function: Callable[[], object], reference: Callable[[], object], runs: int
) -> tuple[float, float]:
    """Median seconds of ``function`` and of ``reference``, timed alternately so that load affects both."""
    function()
    reference()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for timed, bucket in ((function, times[0]), (reference, times[1])):
            start = time.perf_counter()
            timed()
            bucket.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def peers(x: torch.Tensor) -> list[tuple[str, Callable[[], object]]]:
    rows: list[tuple[str, Callable[[], object]]] = [
        ("torch x.to(float8_e4m3fn).float()", lambda: x.to(torch.float8_e4m3fn).float()),
    ]
    if importlib.util.find_spec("torchao") is not None:
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        def to_mx(dtype: torch.dtype) -> Callable[[], object]:
            return lambda: MXTensor.to_mx(x, dtype, 32).dequantize(torch.float32)

        rows.append(("torchao MXTensor mxfp8_e4m3", to_mx(torch.float8_e4m3fn)))
        rows.append(("torchao MXTensor mxfp4_e2m1", to_mx(torch.float4_e2m1fn_x2)))
    if importlib.util.find_spec("qtorch") is not None:
        from qtorch.quant import float_quantize

        rows.append(
            ("qtorch float_quantize e4m3", lambda: float_quantize(x, exp=4, man=3, rounding="nearest"))
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 1M-element input and fewer runs")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per row (default 7, quick 3)")
    args = parser.parse_args()
    rows, cols = (1024, 1024) if args.quick else (4096, 4096)
    runs = args.runs or (3 if args.quick else 7)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    elements = x.numel()
    table: list[tuple[str, str, str, str]] = []

    def clone() -> torch.Tensor:
        return x.clone()

    def row(name: str, function: Callable[[], object] | None, note: str = "") -> None:
        if function is None:
            table.append((name, "-", "-", note))
            return
        seconds, clone_seconds = paired_seconds(function, clone, runs)
        table.append((name, f"{elements / seconds / 1e9:.3f}", f"{clone_seconds / seconds:.2f}x", note))

    row("x.clone()", clone)
    for name, function in peers(x):
        try:
            row(name, function)
        except Exception as error:  # a peer that fails on this machine is reported, not fatal
            row(name, None, f"failed: {type(error).__name__}")
    for label, fmt, scaling in CASES:

        def run(fmt: str = fmt, scaling: str | None = scaling) -> torch.Tensor:
            return numscope.quantize(x, fmt, scaling=scaling)

        set_fast(False)
        row(f"numscope {label} (eager)", run)
        set_fast(True)
        start = time.perf_counter()
        run()
        compile_seconds = time.perf_counter() - start
        row(f"numscope {label} (fast)", run, f"first call {compile_seconds:.1f} s")
    set_fast(False)

    header = ("what", "Gelem/s", "vs clone", "note")
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(4)]
    print(f"{elements:,} float32 elements, {torch.get_num_threads()} threads, torch {torch.__version__}")
    for line in [header, tuple("-" * w for w in widths), *table]:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
