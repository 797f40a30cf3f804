"""Dropout with its mask kept in bits: torch's CPU outputs and gradients bit for bit, from the same draws."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from numscope.train.dropout import BitDropout, CompactDropout, pack_bits, unpack_bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (3, 5, 7), (4, 2, 16, 16)])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_equals_torch_dropout_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...], p: float) -> None:
    x = torch.randn(shape).to(dtype).requires_grad_()
    grad = torch.randn(shape).to(dtype)
    torch.manual_seed(7)
    expected = F.dropout(x, p, training=True)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    torch.manual_seed(7)
    got = BitDropout.apply(x, p)
    (got_grad,) = torch.autograd.grad(got, x, grad)
    assert torch.equal(got, expected) and torch.equal(got_grad, expected_grad)
    torch.manual_seed(7)  # and the generator moves on as torch's own dropout moves it
    F.dropout(x, p, training=True)
    after_torch = torch.rand(4)
    torch.manual_seed(7)
    BitDropout.apply(x, p)
    assert torch.equal(torch.rand(4), after_torch)


def test_non_contiguous_input() -> None:
    x = torch.randn(6, 10).t().requires_grad_()
    grad = torch.randn(10, 6)
    torch.manual_seed(3)
    expected = F.dropout(x, 0.3, training=True)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    torch.manual_seed(3)
    got = BitDropout.apply(x, 0.3)
    (got_grad,) = torch.autograd.grad(got, x, grad)
    assert torch.equal(got, expected) and torch.equal(got_grad, expected_grad)
    assert got.stride() == expected.stride()


@pytest.mark.parametrize("count", [1, 7, 8, 9, 1000])
def test_bits_round_trip(count: int) -> None:
    mask = torch.rand(count) > 0.5
    packed = pack_bits(mask.reshape(1, count))
    assert packed.dtype == torch.uint8 and packed.numel() == -(-count // 8)
    assert torch.equal(unpack_bits(packed, torch.Size((1, count))), mask.reshape(1, count))


def test_mode_keeps_one_bit_per_element_and_leaves_other_calls_to_torch() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), CompactDropout():
        F.dropout(x, 0.2, training=True)
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.uint8, 64 * 64 // 8)]
    with CompactDropout():
        assert torch.equal(F.dropout(x, 0.2, training=False), x)  # eval: torch's own (the input)
        with torch.no_grad():
            F.dropout(x, 0.2, training=True)  # nothing saved: torch's own
        y = x.detach().clone()
        F.dropout(y, 0.2, training=True, inplace=True)  # in place: torch's own
    torch.manual_seed(1)
    expected = nn.Dropout(0.25)(x)
    torch.manual_seed(1)
    with CompactDropout():
        got = nn.Dropout(0.25)(x)
    assert torch.equal(got, expected)
