"""How ``numscope band`` judges: false alarms on genuine runs of held-out seeds, and how soon a planted jump
is found, for each setting of the smoothing window, the level, the persistence and the variance (per step,
or pooled over steps).

Builds the band of a plan on seeds 0..2 (``numscope.diagnose.band``), trains FP32 and the plan on each
held-out seed, judges each genuine pair, then the same pairs with the plan's loss raised by each jump from
the middle step on: each absolute ``--jumps`` and each ``--gap-multiples`` of the recipe's own gap (the
band's mean smoothed gap at the last step). Writes ``band_study.json`` into ``--out`` and prints one row per
setting. Example (the numbers in docs/results/diagnose.md)::

    python examples/band_study.py --model tiny-bert --text wiki.txt --plan fp8 --steps 300 --held-out 20 \\
        --out runs/band_study
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace
from pathlib import Path

from numscope.diagnose import Band, BandSettings, band
from numscope.run import DataSettings, TrainConfig, runner
from numscope.run.loop import read_log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-bert")
    parser.add_argument("--text", nargs="+", required=True)
    parser.add_argument("--plan", default="fp8")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--held-out", type=int, default=20, help="genuine pairs judged (seeds 3, 4, …)")
    parser.add_argument("--jumps", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.3])
    parser.add_argument("--gap-multiples", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument(
        "--settings",
        choices=("all", "defaults"),
        default="all",
        help="every window × level × persistence, or the defaults only (both variances)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    data = DataSettings(text=tuple(args.text), vocab_size=args.vocab_size, seq_len=32, val_blocks=64,
                        cache_dir=str(args.out / "cache"))  # fmt: skip
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, eval_every=args.steps, warmup_steps=10,
                         checkpoint_every=10**6)  # fmt: skip
    band(args.model, data, args.out / "band", plan=args.plan, config=config, settings=BandSettings(seeds=3))
    pairs = []
    for seed in range(3, 3 + args.held_out):
        logs = {}
        for name, plan in (("fp32", "fp32"), ("plan", args.plan)):
            folder = args.out / f"seed{seed}" / name
            runner.train(args.model, data, folder, plan=plan, config=replace(config, seed=seed), name=name)
            logs[name] = {row["step"]: row["loss"] for row in read_log(folder / "log.csv")}
        pairs.append(logs)
    at = args.steps // 2
    gap = Band.load(args.out / "band").mean[-1]  # the recipe's own gap at the end (smoothed)
    jumps = [*args.jumps, *(round(m * abs(gap), 6) for m in args.gap_multiples)]
    grid = itertools.product((1, 10, 25), (0.95, 0.99), (1, 5, 10), ("step", "pooled"))
    if args.settings == "defaults":
        grid = ((10, 0.99, 5, variance) for variance in ("step", "pooled"))
    rows = []
    for window, level, persist, variance in grid:
        chosen = BandSettings(window=window, level=level, persist=persist, variance=variance)
        judged = Band.load(args.out / "band", chosen)
        alarms = sum(not judged.compare(p["fp32"], p["plan"]).inside for p in pairs)
        found = {}
        for jump in jumps:
            delays, onsets = [], []
            for pair in pairs:
                bug = {step: loss + (jump if step >= at else 0.0) for step, loss in pair["plan"].items()}
                verdict = judged.compare(pair["fp32"], bug)
                if not verdict.inside and verdict.left_at >= at:  # found, not a false alarm before it
                    delays.append(verdict.left_at - at)
                    onsets.append(verdict.onset - at)
            found[str(jump)] = {"found": len(delays), "delay": delays, "onset_error": onsets}
        halves = [(u - lo) / 2 for lo, u in zip(judged.lower, judged.upper, strict=True)]
        row = {"window": window, "level": level, "persist": persist, "variance": variance,
               "false_alarms": alarms, "jumps": found, "half_width_at": halves[at - 1],
               "half_width_last": halves[-1], "widest": max(halves)}  # fmt: skip
        rows.append(row)
        summary = ", ".join(
            f"+{jump}: {f['found']}/{len(pairs)} (delay {max(f['delay'], default=0)})"
            for jump, f in found.items()
        )
        print(
            f"window {window:2d} level {level} persist {persist:2d} variance {variance:6s}: "
            f"±{halves[at - 1]:.4f} at step {at}; false alarms {alarms}/{len(pairs)}; {summary}"
        )
    (args.out / "band_study.json").write_text(
        json.dumps({"held_out": len(pairs), "at": at, "gap": gap, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
