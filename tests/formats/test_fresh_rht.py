"""A Hadamard transform with fresh signs per GEMM call (``rhtN:fresh``), as the MXFP4 recipe's code draws
them in every backward call (amazon-science/mxfp4-llm, Megatron-LM.patch: S = diag(signs)·H/√64, applied
to both operands of the GEMM; issue 28)."""

from __future__ import annotations

import pytest
import torch

import numscope
from numscope.formats.transform import Rotation
from numscope.plan import OperandSpec, Plan, SiteSpec


def quantized(tensor: torch.Tensor, axis: int, signs: torch.Tensor) -> torch.Tensor:
    """Qᵀ·MXFP4(Q·x) along ``axis`` with Q = diag(signs)·H₆₄/8, written here (not numscope's transform)."""
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < 64:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    q = (signs.double()[:, None] * hadamard / 8.0).float()
    moved = tensor.float().movedim(axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], -1, 64)
    rotated = (blocks @ q).reshape(moved.shape)
    cast = numscope.quantize(rotated, "mxfp4_e2m1", scaling=numscope.Scaling("block", axis=-1))
    back = (cast.reshape(*moved.shape[:-1], -1, 64) @ q.t()).reshape(moved.shape)
    return back.movedim(-1, axis)


def test_each_backward_call_draws_new_signs_shared_by_the_gemms_two_operands() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 64, bias=False)
    spec = OperandSpec("mxfp4_e2m1", transform="rht64:fresh")
    plan = Plan(SiteSpec({("dgrad", "grad_output"): spec, ("dgrad", "weight"): spec}))
    converted = numscope.convert(
        torch.nn.Linear(128, 64, bias=False), plan, generator=torch.Generator().manual_seed(5)
    )
    converted.load_state_dict(layer.state_dict())
    x = torch.randn(32, 128, requires_grad=True)
    grad = torch.randn(32, 64)
    draws = torch.Generator().manual_seed(5)  # the quantizer's generator, replayed here
    results = []
    for _ in range(2):
        x.grad = None
        converted(x).backward(grad)
        signs = torch.randint(0, 2, (64,), generator=draws) * 2 - 1
        expected = quantized(grad, -1, signs) @ quantized(layer.weight.detach(), 0, signs)
        assert torch.allclose(x.grad, expected, rtol=1e-5, atol=1e-6)
        results.append(x.grad.clone())
    assert not torch.equal(results[0], results[1])  # a new draw for each call
    unrotated = numscope.quantize(grad, "mxfp4_e2m1") @ numscope.quantize(
        layer.weight.detach(), "mxfp4_e2m1", scaling=numscope.Scaling("block", axis=0)
    )
    assert not torch.allclose(results[0], unrotated, rtol=1e-5, atol=1e-6)


def test_fresh_transforms_parse_and_name() -> None:
    rotation = Rotation.parse("RHT64:fresh")
    assert rotation.fresh and rotation.size == 64 and rotation.name == "rht64:fresh"
    assert OperandSpec("mxfp4_e2m1", transform="rht64:fresh").transform == "rht64:fresh"
    with pytest.raises(ValueError, match="'rhtN:fresh'"):
        Rotation.parse("rht64:new")
    with pytest.raises(ValueError, match="signs are 4 values"):
        Rotation(4, signs=(1, 0, 1, 1))
    plan = Plan.recipe("mxfp4_tseng2025")
    assert plan.default.operand("wgrad", "input").transform == "rht64:fresh"
