"""Observer overhead on the tiny BERT MLM train step, as ratios to the plain step, in one run.

Model and batch as ``bench_train_step.py`` (BertForMaskedLM, hidden 128, 2 layers, seq 128, batch 32,
eager attention; forward + backward + AdamW step). The observer measures 8 candidate formats, as the
issue's benchmark asks (the observer's defaults, :data:`numscope.observe.DEFAULT_CANDIDATES`, less the two
MXFP6; ``--candidates default`` measures all 10, as ``numscope analyze`` and ``numscope demo`` do), on every
operand of every GEMM site. Rows:

* ``plain``: no observer (the baseline, 1.00x);
* ``every=10, step not sampled``: the median of the steps the observer skips (its handler's cost alone);
* ``every=10, sampled step``: the median of the steps it measures;
* ``every=10, averaged``: the median over 10-step windows of the window's time / 10 (the target: <= 1.1x);
* ``every=1``: every step measured.

The configurations are timed step by step in turn (a plain step, an every=10 step, in the first
``--every1-steps`` of each window also an every=1 step), so that a shared machine's load drifts affect
them alike. ``--profile`` also prints the top functions of one sampled step.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/bench_observer.py [--rounds R] [--threads T] [--profile]
[--size base]``

On a machine shared with other processes, OpenMP's worker threads spin between parallel regions and take
CPU from the Python thread that issues the observer's many small operations: ``--threads 1`` (or
``OMP_WAIT_POLICY=PASSIVE``) gives steadier ratios there; quote the load with the numbers.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import int_at_least, positive_int
from bench_train_step import SIZES, batch, make_model
from numscope.formats.spec import get_format
from numscope.observe import DEFAULT_CANDIDATES, Observer, observe

# the benchmark: 8 candidate formats (the observer's 10 defaults less the two MXFP6);
# --candidates default measures all 10, --candidates A B ... any list
BENCH_CANDIDATES = tuple(name for name in DEFAULT_CANDIDATES if not name.startswith("mxfp6"))
WINDOW = 10


def trainer(
    observer_every: int | None, size: str = "tiny", **options: Any
) -> tuple[Callable[[], None], Observer | None]:
    """One train step of a fresh model (and its observer, attached, when ``observer_every`` is set)."""
    model = make_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs = batch(size)
    observer = None
    if observer_every is not None:
        observer = observe(model, every=observer_every, **options).attach()  # candidates=, max_elements=

    def step() -> None:
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if observer is not None:
            observer.step()

    return step, observer


def timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def _format_name(name: str) -> str:
    """An argparse ``type``: a name ``numscope.format`` knows (or ``default``)."""
    if name != "default":
        try:
            get_format(name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return name


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=4, help="interleaved rounds (one window each)")
    parser.add_argument(
        "--every1-steps",
        type=int_at_least(0, WINDOW),
        default=3,
        help=f"every=1 steps per round, 0 to {WINDOW} (0: no every=1 row)",
    )
    parser.add_argument("--profile", action="store_true", help="profile one sampled step")
    parser.add_argument(
        "--size",
        choices=tuple(SIZES),
        default="tiny",
        help="tiny: the BERT of bench_train_step (default); base: BERT-base's shape (hidden 768, 12 layers, "
        "seq 128, batch 8; minutes per step on one thread)",
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--max-elements", type=positive_int, default=None, help="observer max_elements (default: its)"
    )
    parser.add_argument(
        "--candidates",
        nargs="+",
        metavar="FORMAT",
        type=_format_name,
        default=list(BENCH_CANDIDATES),
        help=f"formats the observer measures; 'default': its {len(DEFAULT_CANDIDATES)} defaults "
        f"(default: the {len(BENCH_CANDIDATES)} of the issue's benchmark, {' '.join(BENCH_CANDIDATES)})",
    )
    args = parser.parse_args(argv)
    if "default" in args.candidates:
        args.candidates = list(DEFAULT_CANDIDATES)
    return args


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    options: dict[str, Any] = {"candidates": list(args.candidates)}
    if args.max_elements is not None:
        options["max_elements"] = args.max_elements

    plain, _ = trainer(None, args.size)
    sparse, sparse_observer = trainer(WINDOW, args.size, **options)
    dense = trainer(1, args.size, **options)[0] if args.every1_steps else None
    for step in (plain, dense) if dense is not None else (plain,):  # warm-up (site discovery, allocator)
        step()
        step()
    for _ in range(WINDOW):  # a whole window: the next sparse step is a sampled one
        sparse()
    assert sparse_observer is not None and sparse_observer.sampling

    times: dict[str, list[float]] = {"plain": [], "skipped": [], "sampled": [], "window": [], "dense": []}
    for _ in range(args.rounds):
        window = []
        for index in range(WINDOW):  # step by step: plain, observed every 10, (observed every step)
            times["plain"].append(timed(plain))
            sampled = sparse_observer.sampling
            seconds = timed(sparse)
            window.append(seconds)
            times["sampled" if sampled else "skipped"].append(seconds)
            if dense is not None and index < args.every1_steps:
                times["dense"].append(timed(dense))
        times["window"].append(sum(window) / WINDOW)

    base = statistics.median(times["plain"])
    shape = SIZES[args.size]
    print(
        f"observer overhead, {args.size} BERT MLM: hidden {shape['hidden']}, {shape['layers']} layers, "
        f"seq {shape['seq']}, batch {shape['batch']}, vocab {shape['vocab']}; "
        f"{len(args.candidates)} candidates ({', '.join(args.candidates)}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; max_elements {sparse_observer.config.max_elements}; "
        f"{args.rounds} interleaved rounds; load {os.getloadavg()[0]:.2f}"
    )
    rows = [
        ("plain (no observer)", "plain"),
        (f"every={WINDOW}, step not sampled", "skipped"),
        (f"every={WINDOW}, sampled step", "sampled"),
        (f"every={WINDOW}, averaged (target <= 1.1x)", "window"),
        ("every=1", "dense"),
    ]
    for label, key in rows:
        if not times[key]:
            print(f"{label:40s} not timed (--every1-steps 0)")
            continue
        seconds = statistics.median(times[key])
        print(f"{label:40s} {seconds * 1e3:9.1f} ms  {seconds / base:6.2f}x  (n={len(times[key])})")

    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        (dense or sparse)()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
