"""numscope._sums: float64 sums over slices equal the whole-tensor float64 sums (up to the order of the
additions), whatever the length against the slice."""

import math

import pytest
import torch

from numscope import _sums


@pytest.mark.parametrize("count", [1, 7, _sums.SLICE, _sums.SLICE + 1, 3 * _sums.SLICE - 5])
def test_sliced_sums_equal_the_whole_tensors_sums(count: int) -> None:
    generator = torch.Generator().manual_seed(count)
    a = torch.randn(count, generator=generator) * 1e3
    b = a + torch.randn(count, generator=generator)
    x, y = a.double(), b.double()
    expected = (float(x @ x), float(y @ y), float(x @ y), float((x - y).square().sum()))
    got = _sums.moments(a, b)
    for value, reference in zip(got, expected, strict=True):
        assert math.isclose(value, reference, rel_tol=1e-12)
    assert math.isclose(_sums.power(a), expected[0], rel_tol=1e-12)
    assert math.isclose(_sums.distance_power(a, b), expected[3], rel_tol=1e-12)


def test_the_difference_is_taken_in_float64() -> None:
    # 1 + 2^-23 and 1 differ by one float32 ulp: exact in float64, and squared it is far below float32's
    a = torch.full((3,), 1.0 + 2.0**-23)
    b = torch.ones(3)
    assert _sums.distance_power(a, b) == 3 * 2.0**-46


def test_shapes_are_flattened_and_lengths_must_match() -> None:
    a = torch.arange(12.0).reshape(3, 4)
    assert _sums.power(a) == float((torch.arange(12.0).double() ** 2).sum())
    with pytest.raises(ValueError, match="12 and 11 elements"):
        _sums.distance_power(a, torch.zeros(11))
    with pytest.raises(ValueError, match="12, 11 elements"):
        list(_sums.slices(a, torch.zeros(11)))


def test_a_float64_input_is_left_as_it_was() -> None:
    a = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    b = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)
    kept = a.clone(), b.clone()
    assert _sums.moments(a, b) == (14.0, 0.75, 1.0, 0.25 + 6.25 + 6.25)
    assert _sums.power(a) == 14.0 and _sums.distance_power(a, b) == 12.75
    assert torch.equal(a, kept[0]) and torch.equal(b, kept[1])
