"""Activation storage: what autograd saves is really kept in fp16/bf16, parameters are not copied."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from numscope.train import store_activations


class Sine(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x)  # saves x; its backward is grad · cos(saved x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_computes_from_the_rounded_activation(dtype: torch.dtype) -> None:
    x = torch.linspace(-3, 3, 1001, dtype=torch.float32) + 1e-3
    model = Sine()
    handle, store = store_activations(model, dtype)
    leaf = x.clone().requires_grad_()
    model(leaf).backward(torch.ones_like(x))
    assert torch.equal(leaf.grad, torch.cos(x.to(dtype).float()))  # cos of the stored value, exactly
    assert not torch.equal(leaf.grad, torch.cos(x))
    assert store.stored_tensors == 1 and store.stored_bytes == x.numel() * 2
    handle.remove()
    leaf.grad = None
    model(leaf).backward(torch.ones_like(x))
    assert torch.equal(leaf.grad, torch.cos(x))


def test_parameters_are_not_copied_and_a_tensor_saved_twice_is_stored_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    handle, store = store_activations(model, "fp16")
    x = torch.randn(32, 64, requires_grad=True)
    model(x).sum().backward()
    # saved: x by the first Linear; Tanh's output by Tanh and again, as its input, by the second Linear:
    # two copies, not three; the weights are saved as themselves
    assert store.stored_tensors == 2
    assert store.stored_bytes == 2 * 32 * 64 * 2
    handle.remove()


def test_in_place_change_between_saves_gets_a_new_copy() -> None:
    class Twice(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 1.0
            first = torch.sin(y)
            y.mul_(2.0)
            return first + torch.sin(y)

    model = Twice()
    _, store = store_activations(model, torch.float16)
    x = torch.linspace(0.1, 1.0, 100, requires_grad=True)
    model(x).sum().backward()
    assert store.stored_tensors == 2
    expected = torch.cos(x.detach().half().float()) + 2 * torch.cos((x.detach() * 2).half().float())
    assert torch.allclose(x.grad, expected, rtol=0, atol=1e-6)


def test_bad_dtype_is_named() -> None:
    with pytest.raises(
        ValueError, match=r"must be one of fp16, bf16 \(or torch.float16, torch.bfloat16\), got 'fp8'"
    ):
        store_activations(nn.Linear(2, 2), "fp8")
    with pytest.raises(ValueError, match=r"got torch\.float32"):
        store_activations(nn.Linear(2, 2), torch.float32)


def test_dropout_masks_are_kept_in_bits_with_torchs_results() -> None:
    model = nn.Dropout(0.1)
    x = torch.randn(32, 64, requires_grad=True)
    torch.manual_seed(0)
    expected = model(x)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    results = {}
    for compact in (True, False):
        handle, store = store_activations(model, torch.float16, compact_dropout=compact)
        torch.manual_seed(0)
        out = model(x)
        results[compact] = (out, torch.autograd.grad(out.sum(), x)[0], store.kept_bytes)
        handle.remove()
    out, grad, kept = results[True]
    assert torch.equal(out, expected) and torch.equal(grad, expected_grad)
    assert kept == 32 * 64 // 8  # one bit per element
    out, grad, kept = results[False]
    # torch's CPU mask is a float32 tensor of 0 and 1/0.9: in fp16 its scale is rounded, and it takes 2 bytes
    assert torch.equal(out, expected) and not torch.equal(grad, expected_grad)
    assert kept == 32 * 64 * 2


@pytest.mark.parametrize("compiled", [False, True])
def test_a_quantized_operand_is_kept_exactly(compiled: bool) -> None:
    """What a plan's site keeps of a quantized operand (codes and their float32 descale, or the float32
    values) is not rounded again: the weight gradient is the plan's own, with or without the store."""
    import numscope

    torch.manual_seed(0)
    x = torch.randn(16, 48) * 3

    def weight_grad(store: bool) -> tuple[torch.Tensor, int]:
        torch.manual_seed(1)
        model = nn.Linear(48, 32)
        numscope.convert(model, numscope.Plan.uniform("fp8"), compiled=compiled)
        handle, activations = store_activations(model, torch.float16) if store else (None, None)
        model(x.clone().requires_grad_()).square().sum().backward()
        kept = 0 if activations is None else activations.kept_bytes
        if handle is not None:
            handle.remove()
        return model.weight.grad, kept

    plain, _ = weight_grad(False)
    stored, kept = weight_grad(True)
    assert torch.equal(stored, plain)
    # eager: the input's fp8 codes (1 byte each) and its descale; compiled: its float32 values
    assert kept == (16 * 48 * 4 if compiled else 16 * 48 + 4)
