"""Ops kept in fp32 under an fp16/bf16 model: results where fp16 overflows, GEMM dtypes, gradients, list."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from numscope.train import FP32_OPS, keep_fp32_ops
from numscope.train.fp32_ops import GEMM_OPS
from tiny_models import tiny_bert, tiny_gpt2


class Overflowing(nn.Module):
    """Ops whose fp16 result overflows on activations of a few hundred, as hand-written model code has."""

    def forward(self, x: torch.Tensor, logits: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "log_softmax": F.log_softmax(logits, dim=-1),  # logits ±6e4: log-probabilities below -65504
            "cross_entropy": F.cross_entropy(logits, target),
            "sum": x.abs().sum(),
            "rms_norm": x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt(),  # T5/LLaMA-style, no casts
            "exp": x.exp(),
        }


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 32, generator=generator) * 300).half()  # |x| up to ~1000: x² > 65504
    logits = (torch.rand(64, 32, generator=generator) * 1.2e5 - 6e4).half()
    return x, logits, torch.randint(0, 32, (64,), generator=generator)


def test_kept_ops_give_fp32_results_where_fp16_overflows() -> None:
    x, logits, target = _inputs()
    model = Overflowing()
    plain = model(x, logits, target)
    handle = keep_fp32_ops(model, torch.float16)
    kept = model(x, logits, target)
    reference = model(x.float(), logits.float(), target)  # the same fp16 values, computed in fp32
    for name, value in kept.items():
        assert value.dtype == torch.float32, name
        assert torch.equal(value, reference[name]), name
        assert not torch.equal(plain[name].float(), value), name
    assert not plain["sum"].isfinite() and kept["sum"].isfinite()  # |x| sums past 65504
    assert torch.all(plain["rms_norm"] == 0)  # x² = inf, rsqrt(inf) = 0: every activation flushed
    assert torch.allclose(kept["rms_norm"].pow(2).mean(-1), torch.ones(64))
    assert not plain["cross_entropy"].isfinite() and kept["cross_entropy"].isfinite()
    assert plain["log_softmax"].isinf().any() and kept["log_softmax"].isfinite().all()
    handle.remove()
    assert torch.equal(model(x, logits, target)["sum"], plain["sum"])


def test_backward_of_a_kept_op_runs_in_fp32_and_returns_to_fp16() -> None:
    x, _, _ = _inputs()
    model = nn.LogSoftmax(dim=-1)
    keep_fp32_ops(model, torch.float16)
    leaf = (x / 8).requires_grad_()
    out = model(leaf)
    out.backward(torch.ones_like(out))
    reference = (x / 8).float().requires_grad_()
    F.log_softmax(reference, dim=-1).backward(torch.ones(64, 32))
    assert out.dtype == torch.float32 and leaf.grad.dtype == torch.float16
    assert torch.equal(leaf.grad, reference.grad.half())


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, scores: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1)  # fp32 under the mode
        context = probs @ self.value(x)  # fp32 meets fp16
        return self.head(context.float())  # an fp32 input meets the fp16 Linear


def test_gemms_accumulate_in_fp32_and_return_the_working_dtype() -> None:
    torch.manual_seed(0)
    model = Attention().half()
    scores, x = torch.randn(8, 8).half(), torch.randn(8, 16).half()
    with pytest.raises(RuntimeError):
        model(scores, x)  # without the mode torch refuses to mix fp32 and fp16 in a GEMM
    keep_fp32_ops(model, torch.float16)
    out = model(scores, x)

    def linear(layer: nn.Linear, inputs: torch.Tensor) -> torch.Tensor:  # fp16 values, fp32 sums, fp16 out
        return F.linear(inputs.float(), layer.weight.float(), layer.bias.float()).half()

    probs = torch.softmax(scores.float(), dim=-1)
    expected = linear(model.head, (probs @ linear(model.value, x).float()).half())
    assert out.dtype == torch.float16 and torch.equal(out, expected)
    fp32_only = nn.Linear(4, 2)
    keep_fp32_ops(fp32_only, torch.float16)
    assert fp32_only(torch.ones(1, 4)).dtype == torch.float32  # an fp32 layer stays fp32


def test_gemm_gradients_accumulate_in_fp32_and_return_to_fp16() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(256, 8).half()
    keep_fp32_ops(layer, torch.float16)
    x = torch.randn(4, 256).half().requires_grad_()
    grad = torch.randn(4, 8).half()
    layer(x).backward(grad)
    weight = layer.weight.detach().float()
    assert x.grad.dtype == torch.float16 and torch.equal(x.grad, (grad.float() @ weight).half())
    assert torch.equal(layer.weight.grad, (grad.float().t() @ x.detach().float()).half())


def test_explicit_dtype_and_fp32_inputs_are_left_alone() -> None:
    class Explicit(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return F.softmax(x, dim=-1, dtype=torch.float16), x.sum()

    model = Explicit()
    keep_fp32_ops(model, torch.bfloat16)
    probs, total = model(torch.randn(4, 4).bfloat16())
    assert probs.dtype == torch.float16 and total.dtype == torch.float32
    assert model(torch.randn(4, 4).double())[1].dtype == torch.float64


def test_the_list_covers_autocasts_fp32_ops_and_the_papers_reductions() -> None:
    # torch.autocast's CUDA "autocast to float32" ops (aten/src/ATen/autocast_mode.h) that have a Python
    # entry point of the same name, and the paper's softmax / normalisation / reductions.
    autocast_fp32 = str.split(
        "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus "
        "layer_norm group_norm norm cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss "
        "hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss "
        "multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss "
        "binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp prod softmax log_softmax cumprod "
        "cumsum sum cross_entropy mean"
    )
    kept = {op for group in FP32_OPS.values() for op in group}
    for name in autocast_fp32:
        op = getattr(F, name, None) or getattr(torch, name)
        assert op in kept, name
    assert torch.linalg.vector_norm in kept and torch.linalg.matrix_norm in kept
    assert not kept & GEMM_OPS


def test_bad_arguments_are_named() -> None:
    with pytest.raises(
        ValueError, match=r"working dtype must be torch.float16 or torch.bfloat16, got torch.float32"
    ):
        keep_fp32_ops(nn.Linear(2, 2), torch.float32)
    with pytest.raises(TypeError, match=r"must be torch callables such as torch\.softmax, got 'exp'"):
        keep_fp32_ops(nn.Linear(2, 2), torch.float16, ops=["exp"])


def _transformer(kind: str) -> nn.Module:
    if kind == "gpt2":
        return tiny_gpt2(impl=None)
    return tiny_bert(impl=kind.removeprefix("bert-"))


@pytest.mark.parametrize("kind", ["bert-eager", "bert-sdpa", "gpt2"])
def test_sites_see_the_parameters_and_compute_as_the_mode_does(kind: str) -> None:
    """GEMM sites sit above the mode: they see the fp16 parameters themselves (their names and kinds as
    without the mode) and multiply float32 copies with the result in fp16, as the mode does, bit for bit."""
    import numscope

    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = {(site.name, site.kind) for site in numscope.sites(_transformer(kind), {"input_ids": ids})}
    seen, results = set(), []

    def record(site, gemm, operand, tensor, axis):
        seen.add((site.name, site.kind))
        return tensor

    for routed in (False, True):
        model = _transformer(kind).half()
        keep_fp32_ops(model, torch.float16)
        if routed:
            numscope.sites.attach(model, record, name="record")
        torch.manual_seed(1)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.logits, {n: p.grad for n, p in model.named_parameters()}))
    assert seen == expected
    assert results[1][0].dtype == torch.float16 and torch.equal(results[0][0], results[1][0])
    for name, grad in results[0][1].items():
        assert grad.dtype == torch.float16 and torch.equal(grad, results[1][1][name]), name
