"""Stochastic rounding is unbiased between the two neighbours of a value; rounding toward zero keeps the
neighbour of smaller magnitude. (Nearest rounding is checked bit for bit against ml_dtypes elsewhere.)"""

from __future__ import annotations

import pytest
import torch

import numscope

# in range for every format below (no saturation, which biases any rounding), with fractions between codes
VALUES = torch.tensor([1.1, -2.7, 0.3, 5.1, -0.2, 0.07])
DRAWS = 20_000


@pytest.mark.parametrize(
    "name", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "int8"]
)
def test_stochastic_rounding_is_unbiased_between_the_two_neighbours(name: str) -> None:
    toward_zero = numscope.quantize(VALUES, name, rounding="zero")
    draws = numscope.quantize(
        VALUES.expand(DRAWS, -1).contiguous(),
        name,
        rounding="stochastic",
        generator=torch.Generator().manual_seed(0),
    )
    assert (toward_zero.abs() <= VALUES.abs()).all()
    for column, value in enumerate(VALUES.tolist()):
        seen = sorted(set(draws[:, column].tolist()))
        low = toward_zero[column].item()
        if low == value:  # exact: stochastic rounding must not move it
            assert seen == [value], (name, value)
            continue
        assert len(seen) == 2 and low in seen, (name, value, seen)  # the neighbour toward zero and the other
        gap = abs(seen[1] - seen[0])
        assert min(seen) < value < max(seen), (name, value, seen)
        # the mean of DRAWS Bernoulli choices: standard error <= gap / (2 sqrt(DRAWS)) = gap / 283
        mean = draws[:, column].double().mean().item()
        assert abs(mean - value) < 0.03 * gap, (name, value, mean, gap)


def test_the_same_generator_replays_the_same_draws() -> None:
    x = torch.randn(64, 64)
    first = numscope.quantize(
        x, "fp8_e4m3", rounding="stochastic", generator=torch.Generator().manual_seed(3)
    )
    again = numscope.quantize(
        x, "fp8_e4m3", rounding="stochastic", generator=torch.Generator().manual_seed(3)
    )
    other = numscope.quantize(
        x, "fp8_e4m3", rounding="stochastic", generator=torch.Generator().manual_seed(4)
    )
    assert torch.equal(first, again) and not torch.equal(first, other)


@pytest.mark.parametrize("name", ["mxfp4_e2m1", "mxfp8_e4m3", "nvfp4"])
def test_block_formats_round_toward_zero_and_stochastically_within_the_block_scale(name: str) -> None:
    x = torch.randn(256, 64)
    nearest = numscope.quantize(x, name)
    toward_zero = numscope.quantize(x, name, rounding="zero")
    assert (toward_zero.abs() <= x.abs()).all() and (toward_zero.abs() <= nearest.abs()).all()
    draws = torch.stack(
        [
            numscope.quantize(x, name, rounding="stochastic", generator=torch.Generator().manual_seed(seed))
            for seed in range(64)
        ]
    )
    # every draw is one of the two neighbours: the one toward zero or the next one away from zero
    assert ((draws == toward_zero) | (draws.abs() > toward_zero.abs())).all()
    # unbiased: the mean draw's error away from zero averages out (rounding toward zero would make it
    # about minus half a gap everywhere)
    bias = ((draws.double().mean(0) - x.double()) * x.sign()).mean().abs().item()
    assert bias < 0.05 * (toward_zero - x).abs().double().mean().item()


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("fp4_e2m1", 0.0, 0.5), ("fp4_e2m1", 4.0, 6.0), ("fp16", 0.0, 2.0**-24), ("fp16", 1.0, 1.0 + 2.0**-10),
     ("int8", 0.0, 1.0), ("int8", 2.0, 3.0)],
)  # fmt: skip
def test_ties_away_rounds_the_largest_float_below_a_midpoint_down(name: str, low: float, high: float) -> None:
    """roundTiesToAway on the exact value: the midpoint goes away from zero, the float32 just below it
    goes down (floor(|x| + 0.5) rounded that float32 sum up to the next integer), for both signs."""
    import numpy as np

    middle = np.float32((low + high) / 2)
    below = np.nextafter(middle, np.float32(0))
    values = torch.tensor([middle, below, -middle, -below], dtype=torch.float32)
    out = numscope.quantize(values, name, rounding="nearest_away", scaling="none")
    assert out.tolist() == [high, low, -high, -low]
