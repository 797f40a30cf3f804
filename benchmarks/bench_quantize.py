"""Throughput of numscope.quantize, eager, native (the default) and compiled, against clone() and peers.

Rows per case: ``eager`` (the reference: native quantizers and fast path off), ``native`` (the default:
numscope's C quantizers, :mod:`numscope.formats.native`, built once before the first row), ``fast``
(``set_fast(True)`` with the native quantizers off: the ``torch.compile`` kernels).

Run: ``.venv/bin/python benchmarks/bench_quantize.py`` (16M float32 elements) or ``--quick`` (1M).
Each row is timed alternately with ``x.clone()`` (the memory-bandwidth limit: one read, one fresh
output), so that the load of a shared machine falls on both alike; the row prints its own median, the
median of the clones timed beside it, and the ratio of the two (``vs clone`` = clone ms / row ms, so the
columns can be checked against each other), in elapsed time and in this process's CPU time. On a machine
shared with other jobs, CPU time with ``--threads 1`` is the steadiest measure (elapsed time then also
counts other jobs' turns, and a multi-threaded op waits for its slowest thread). With ``--quick`` the
input fits in the last-level cache, so clone there is a cache, not a memory, figure. The first call of
a fast-path row (its compile) is reported separately and not timed. torchao and qtorch rows appear
where those are installed (``pip install -e '.[bench]'``); qtorch builds its C++ extension on first
import (a minute, once).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numscope
from _cli import positive_int, shape_2d
from numscope.formats import set_fast, set_native

CASES: list[tuple[str, str, str | None]] = [
    ("fp8_e4m3, tensor scaling", "fp8_e4m3", "tensor"),
    ("bf16", "bf16", None),
    ("mxfp8_e4m3", "mxfp8_e4m3", None),
    ("mxfp4_e2m1", "mxfp4_e2m1", None),
    ("nvfp4", "nvfp4", None),
    ("int8, tensor scaling", "int8", "tensor"),
]


def _malloc_trim() -> Callable[[], object]:
    """glibc's ``malloc_trim(0)`` (returns freed heap memory to the system), or a no-op elsewhere.

    Called before every timed call, so that each starts from the same allocator state: otherwise a clone
    timed after a row that left freed memory in the heap reuses it without page faults and looks several
    times faster than a clone timed after a row that did not.
    """
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0)


RELEASE_FREE_MEMORY = _malloc_trim()


def paired_seconds(
    function: Callable[[], object], reference: Callable[[], object], runs: int
) -> tuple[float, float, float, float]:
    """Median wall and CPU seconds of ``function`` and of ``reference``, timed alternately.

    Returns (wall, reference wall, cpu, reference cpu). CPU time is this process's (all its threads,
    user and system): on a machine shared with other jobs it counts the work, not the waiting.
    """
    function()
    reference()
    wall: tuple[list[float], list[float]] = ([], [])
    cpu: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for index, timed in enumerate((function, reference)):
            RELEASE_FREE_MEMORY()
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            timed()
            cpu[index].append(time.process_time() - start_cpu)
            wall[index].append(time.perf_counter() - start_wall)
    medians = [statistics.median(times) for times in (*wall, *cpu)]
    return medians[0], medians[1], medians[2], medians[3]


def _ms(seconds: float) -> str:
    """Milliseconds with three significant digits (at least a whole number of them)."""
    return f"{seconds * 1e3:.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.3g}"


def _missing(peer: str, error: ImportError) -> str:
    """The note of a skipped peer row: not installed, or installed but failing to import (and why)."""
    if importlib.util.find_spec(peer) is None:
        return "not installed (pip install -e '.[bench]')"
    return f"not importable: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def peers(x: torch.Tensor) -> list[tuple[str, Callable[[], object] | None, str]]:
    """(name, function or None, note) of every peer row; None where the peer cannot be imported."""

    def torch_tensor_fp8(values: torch.Tensor) -> torch.Tensor:
        scale = 448.0 / values.abs().amax()
        return (values * scale).to(torch.float8_e4m3fn).float() / scale

    compiled_fp8 = torch.compile(torch_tensor_fp8)
    rows: list[tuple[str, Callable[[], object] | None, str]] = [
        ("torch x.to(float8_e4m3fn).float()", lambda: x.to(torch.float8_e4m3fn).float(), ""),
        ("torch.compile'd per-tensor fp8 round trip", lambda: compiled_fp8(x), "amax, scale, .to(fp8)"),
    ]
    try:
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
    except ImportError as error:  # not installed, or installed but not importable here
        rows.append(("torchao MXTensor", None, _missing("torchao", error)))
    else:

        def to_mx(dtype: torch.dtype) -> Callable[[], object]:
            return lambda: MXTensor.to_mx(x, dtype, 32).dequantize(torch.float32)

        rows.append(("torchao MXTensor mxfp8_e4m3", to_mx(torch.float8_e4m3fn), ""))
        rows.append(("torchao MXTensor mxfp4_e2m1", to_mx(torch.float4_e2m1fn_x2), ""))
    try:
        from qtorch.quant import float_quantize
    except ImportError as error:
        rows.append(("qtorch float_quantize", None, _missing("qtorch", error)))
    else:
        rows.append(
            (
                "qtorch float_quantize e4m3",
                lambda: float_quantize(x, exp=4, man=3, rounding="nearest"),
                "no scaling",
            )
        )
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 1M-element input and fewer runs")
    parser.add_argument(
        "--runs", type=positive_int, default=None, help="timed runs per row (default 9, quick 5)"
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--shape",
        type=shape_2d,
        default=None,
        help="input shape ROWSxCOLS (default 4096x4096, quick 1024x1024)",
    )
    parser.add_argument("--only", default="", help="run only rows whose name contains this text")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows, cols = args.shape or ((1024, 1024) if args.quick else (4096, 4096))
    runs = args.runs or (5 if args.quick else 9)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    elements = x.numel()
    load_before = os.getloadavg()[0]
    table: list[tuple[str, ...]] = []

    def clone() -> torch.Tensor:
        return x.clone()

    def row(name: str, function: Callable[[], object] | None, note: str = "") -> None:
        if args.only not in name:
            return
        if function is None:  # a peer that cannot be imported here: skipped, with the reason
            table.append((name, *["-"] * 7, note))
            return
        wall, clone_wall, cpu, clone_cpu = paired_seconds(function, clone, runs)  # errors propagate
        table.append(
            (
                name,
                f"{elements / wall / 1e9:.3f}",
                _ms(wall),
                _ms(clone_wall),
                f"{clone_wall / wall:.2f}x",
                _ms(cpu),
                _ms(clone_cpu),
                f"{clone_cpu / cpu:.2f}x",
                note,
            )
        )

    row("x.clone()", clone, "against itself: the noise")
    for name, function, note in peers(x):
        row(name, function, note)
    for label, fmt, scaling in CASES:

        def run(fmt: str = fmt, scaling: str | None = scaling) -> torch.Tensor:
            return numscope.quantize(x, fmt, scaling=scaling)

        set_fast(False)
        set_native(False)
        row(f"numscope {label} (eager)", run)
        set_native(True)
        row(f"numscope {label} (native)", run, "the default")
        set_native(False)
        set_fast(True)
        if args.only in f"numscope {label} (fast)":
            start = time.perf_counter()
            run()
            row(f"numscope {label} (fast)", run, f"first call {time.perf_counter() - start:.1f} s")
    set_fast(False)
    set_native(True)

    header = ("what", "Gelem/s", "wall ms", "clone", "vs clone", "cpu ms", "clone", "vs clone", "note")
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    print(
        f"{elements:,} float32 elements, median of {runs} runs each, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(
        "Gelem/s and wall ms: elapsed time; cpu ms: this process's CPU time (all threads). clone: the "
        "clones timed alternately with that row; vs clone = clone / row (wall, then cpu)"
    )
    for line in [header, tuple("-" * w for w in widths), *table]:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
