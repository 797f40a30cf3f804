"""How often a band of 3 seeds holds a fourth seed's gap at one step, per-step variance against pooled, on
synthetic gap curves whose seed-to-seed deviations follow an AR(1) process (correlation ``phi`` from one step
to the next: 0 white, 0.99 deviations that persist for about 100 steps). Monte Carlo over ``--bands`` bands
of 200 steps, judged at step 150; prints the coverage and the median half-width per setting::

    python examples/band_coverage.py --bands 400
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

from numscope.diagnose import Band, BandSettings


def curves(rng: random.Random, seeds: int, steps: int, phi: float) -> dict[int, list[float]]:
    out = {}
    for seed in range(seeds):
        value, curve = rng.gauss(0, 1), []
        for step in range(steps):
            value = phi * value + math.sqrt(1 - phi * phi) * rng.gauss(0, 1)
            curve.append(0.001 * step + 0.01 * value)
        out[seed] = curve
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bands", type=int, default=400)
    args = parser.parse_args()
    print("| level | phi | variance | coverage | median half-width |\n|---|---|---|---|---|")
    for level in (0.95, 0.99):
        for phi in (0.0, 0.9, 0.99, 0.999):
            for variance in ("step", "pooled"):
                rng, inside, halves = random.Random(1), 0, []
                for _ in range(args.bands):
                    made = curves(rng, 4, 200, phi)
                    held_out = made.pop(3)
                    band = Band(
                        "x", list(range(1, 201)), made, BandSettings(window=1, level=level, variance=variance)
                    )
                    inside += band.lower[150] <= held_out[150] <= band.upper[150]
                    halves.append((band.upper[150] - band.lower[150]) / 2)
                coverage, half = inside / args.bands, statistics.median(halves)
                print(f"| {level} | {phi} | {variance} | {coverage:.3f} | {half:.4f} |")


if __name__ == "__main__":
    main()
