"""``torch.einsum`` of two operands is the matmul it amounts to, and a site like any other: attention
written with einsum gets ``scores``/``context``, a projection ``matmulN``; plans quantize it exactly as the
same GEMM written with ``@``. An einsum that is not one matmul, and a bilinear product, warn that they run
past numscope."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import numscope
from numscope.sites import attach, sites
from numscope.sites.calls import _einsum_as_matmul


@pytest.mark.parametrize(
    "equation",
    [
        "ij,jk->ik",
        "bij,bjk->bik",
        "bhqd,bhkd->bhqk",
        "bhqk,bkhd->bqhd",
        "bsd,ed->bse",
        "i,i->",
        "ij,j",  # implicit output: the indices seen once, sorted
        "abc,cd->dba",
        "ijx,jky->ki",  # x and y are summed away before the GEMM
        "bn,bn->b",
        "i,j->ij",
        "b i j , b j k -> b i k",
    ],
)
def test_two_operand_einsum_is_one_matmul(equation: str) -> None:
    generator = torch.Generator().manual_seed(0)
    sizes = {c: 2 + ord(c) % 4 for c in "abcdehijknqsxy"}
    terms = equation.replace(" ", "").split("->")[0].split(",")
    operands = [torch.randn(*(sizes[c] for c in t), generator=generator, requires_grad=True) for t in terms]
    product = _einsum_as_matmul((equation, *operands), {})
    assert product is not None
    expected, got = torch.einsum(equation, *operands), product()
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for want, have in zip(
        torch.autograd.grad(expected.sum(), operands), torch.autograd.grad(got.sum(), operands), strict=True
    ):
        torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "args",
    [
        ("ii->i", torch.randn(3, 3)),  # one operand
        ("ij,jk,kl->il", torch.randn(2, 3), torch.randn(3, 4), torch.randn(4, 5)),  # three
        ("...ij,jk->...ik", torch.randn(2, 3), torch.randn(3, 4)),  # ellipsis
        ("ii,ij->j", torch.randn(3, 3), torch.randn(3, 4)),  # a diagonal
        ("bij,bjk->bik", torch.randn(1, 2, 3), torch.randn(5, 3, 4)),  # broadcasting a size-1 axis
        (torch.randn(2, 3), [0, 1], torch.randn(3, 4), [1, 2]),  # sublist form
    ],
)
def test_an_einsum_that_is_not_one_matmul_is_left_to_torch(args) -> None:
    assert _einsum_as_matmul(args, {}) is None


class EinsumAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(3, 16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (torch.einsum("bsd,ed->bse", x, w).unflatten(-1, (2, 8)) for w in self.qkv)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8**0.5
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).flatten(-2)


class MatmulAttention(EinsumAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = ((x @ w.T).unflatten(-1, (2, 8)).transpose(1, 2) for w in self.qkv)
        scores = q @ k.transpose(-1, -2) / 8**0.5
        return (scores.softmax(-1) @ v).transpose(1, 2).flatten(-2)


X = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))


def test_einsum_attention_is_sites_named_for_their_roles() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(EinsumAttention())
    assert [site.name for site in sites(model, (X,))] == [
        "0.qkv.0",  # a stacked weight indexed in forward: one site per index, as for MoE experts
        "0.qkv.1",
        "0.qkv.2",
        "0.scores",
        "0.context",
    ]
    seen: list[str] = []
    handle = attach(
        model, lambda site, gemm, operand, tensor, axis: (seen.append(site.name), tensor)[1], name="rec"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(X).sum().backward()
    handle.remove()
    assert not [w for w in caught if "does not intercept" in str(w.message)]
    assert set(seen) == {"0.qkv.0", "0.qkv.1", "0.qkv.2", "0.scores", "0.context"}


@pytest.mark.parametrize("plan", ["fp8", "mxfp8", "bf16"])
def test_a_plan_quantizes_einsum_as_it_quantizes_the_same_matmul(plan: str) -> None:
    torch.manual_seed(0)
    einsum = EinsumAttention()
    matmul = MatmulAttention()
    matmul.load_state_dict(einsum.state_dict())
    reference = EinsumAttention()
    reference.load_state_dict(einsum.state_dict())
    for model in (einsum, matmul):
        numscope.convert(model, numscope.Plan.uniform(plan))
    outputs = [model(X) for model in (einsum, matmul, reference)]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    assert (outputs[0] - outputs[2]).abs().max() > 1e-4  # the plan did reach the einsums
    grads = []
    for model, out in zip((einsum, matmul), outputs[:2], strict=True):
        out.square().sum().backward()
        grads.append(model.qkv.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)


class Unintercepted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bilinear = nn.Bilinear(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chained = torch.einsum("bi,ij,jk->bk", x, torch.eye(4), torch.eye(4))
        return self.bilinear(chained, x)


def test_what_runs_past_numscope_says_so_once() -> None:
    model = Unintercepted()
    numscope.convert(model, numscope.Plan.uniform("fp8"))
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="does not intercept") as caught:
        model(x)
    messages = [str(w.message) for w in caught if "does not intercept" in str(w.message)]
    assert any("an einsum that is not one matmul" in m for m in messages), messages
    assert any("a bilinear product" in m for m in messages), messages
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        model(x)
    assert not [w for w in again if "does not intercept" in str(w.message)]
