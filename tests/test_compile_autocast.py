"""A converted model under ``torch.autocast`` and ``torch.compile``, as users train.

Autocast: a site does what autocast does to its GEMM (operands cast to bfloat16, the product accumulated in
float32, the result in bfloat16) with the plan's quantizers on the cast operands. Before, the site's float32
products ran under autocast and backward failed on mixed dtypes. Compile: the interception runs outside
dynamo, so a compiled converted model computes the eager bits (before, each site's quantizers were traced
and recompiled per site name, the first step of a one-layer Llama taking about a minute)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.test_architectures import _llama, _loss

import numscope
from numscope.sites import attach

BF16 = torch.bfloat16


class Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _layer(kind: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Linear(64, 32), (torch.randn(4, 8, 64),)
    if kind == "conv":
        return nn.Conv2d(32, 16, 3, padding=1), (torch.randn(2, 32, 6, 6),)
    return Attention(), tuple(torch.randn(2, 4, 8, 32) for _ in range(3))


@pytest.mark.parametrize("plan", ["fp8", "mxfp8"])
@pytest.mark.parametrize("kind", ["linear", "conv", "sdpa"])
def test_a_site_under_autocast_quantizes_the_cast_operands(kind: str, plan: str) -> None:
    """Bit for bit: the plan on operands rounded to bfloat16 beforehand, the float32 result rounded to
    bfloat16 (what autocast's bfloat16 GEMM with float32 accumulation gives, quantized as the plan says)."""
    layer, inputs = _layer(kind)
    reference, _ = _layer(kind)
    reference.load_state_dict({k: v.to(BF16).float() for k, v in layer.state_dict().items()})
    numscope.convert(layer, numscope.Plan.uniform(plan))
    numscope.convert(reference, numscope.Plan.uniform(plan))
    leaves = [x.clone().requires_grad_() for x in inputs]
    with torch.autocast("cpu", dtype=BF16):
        out = layer(*leaves)
    want = reference(*(x.to(BF16).float() for x in inputs)).to(BF16)
    assert out.dtype == BF16 and torch.equal(out, want)
    out.float().square().sum().backward()  # before: a dtype mismatch in the site's backward
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves)


def _step(model: nn.Module, autocast: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        loss = _loss(model)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]


def test_a_converted_llama_trains_under_autocast() -> None:
    identity = _llama()
    attach(identity, lambda site, gemm, operand, tensor, axis: tensor, name="identity")
    plain_loss, plain_grads = _step(_llama(), autocast=True)
    loss, grads = _step(identity, autocast=True)  # every GEMM through its site, unquantized
    assert torch.equal(loss, plain_loss)
    for got, want in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    model = _llama()
    numscope.convert(model, numscope.Plan.uniform("fp8"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss, grads = _step(model, autocast=True)
        losses.append(loss.item())
        optimizer.step()
    assert all(torch.isfinite(g).all() for g in grads) and losses[-1] < losses[0]


def test_a_compiled_converted_model_computes_the_eager_bits() -> None:
    def run(compiled: bool) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        model = _llama()
        numscope.convert(model, numscope.Plan.uniform("fp8"))
        forward = torch.compile(model) if compiled else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        results = []
        for _ in range(2):
            optimizer.zero_grad()
            loss = _loss(forward)
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
            optimizer.step()
        return results

    from torch._dynamo.utils import counters

    counters.clear()
    compiled = run(True)
    # the graphs between the sites, not one per site and quantizer (before: 94 graphs, recompilations cut
    # short by dynamo's limit)
    assert 0 < counters["stats"]["unique_graphs"] <= 10
    for (loss, grads), (eager_loss, eager_grads) in zip(compiled, run(False), strict=True):
        assert torch.equal(loss, eager_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads, strict=True))
