"""Site discovery and the one autograd function: real tiny transformers models, exact comparisons."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import BertForMaskedLM, GPT2LMHeadModel

import numscope
from numscope.sites import Site, accumulate_matmul, attach, attached, sdpa_reference, sites
from tiny_models import tiny_bert, tiny_gpt2

IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def bert(impl: str) -> BertForMaskedLM:
    return tiny_bert(impl=impl)


def gpt2(impl: str) -> GPT2LMHeadModel:
    return tiny_gpt2(impl=impl)


def identity(site, gemm, operand, tensor, axis):
    return tensor


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_bert_sites_match_the_structure(impl: str) -> None:
    model = bert(impl)
    found = sites(model, {"input_ids": IDS})
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert (
        len(linears) == 2 * 6 + 2
    )  # per layer q, k, v, attention out, intermediate, output; head dense, decoder
    names = [s.name for s in found]
    assert len(names) == 2 * (6 + 2) + 2 == len(set(names))
    assert set(linears) <= set(names)
    for layer in range(2):
        prefix = f"bert.encoder.layer.{layer}.attention.self"
        assert f"{prefix}.scores" in names and f"{prefix}.context" in names
        assert (
            names.index(f"{prefix}.value")
            < names.index(f"{prefix}.scores")
            < names.index(f"{prefix}.context")
        )
    kinds = {s.name: s.kind for s in found}
    assert kinds["bert.encoder.layer.0.attention.self.scores"] == ("sdpa" if impl == "sdpa" else "matmul")
    assert sites(model)[0] == Site(
        "bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0.attention.self.query", "linear"
    )
    assert attached(model) == [] and not model._forward_hooks and not model._forward_pre_hooks


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gpt2_sites_match_the_structure(impl: str) -> None:
    found = sites(gpt2(impl), {"input_ids": IDS})
    names = [s.name for s in found]
    per_layer = ["attn.c_attn", "attn.scores", "attn.context", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    assert names == [f"transformer.h.{i}.{n}" for i in range(2) for n in per_layer] + ["lm_head"]
    assert {s.kind for s in found if s.name.endswith("c_fc")} == {"conv1d"}


@pytest.mark.parametrize("make,impl", [(bert, "eager"), (bert, "sdpa"), (gpt2, "eager"), (gpt2, "sdpa")])
def test_identity_handlers_are_bit_identical(make, impl) -> None:
    reference, routed = make(impl), make(impl)
    seen: list[tuple[str, str, str]] = []

    def record(site, gemm, operand, tensor, axis):
        seen.append((site.name, gemm, operand))
        return tensor

    handle = attach(routed, record, name="record")
    results = []
    for model in (reference, routed):
        torch.manual_seed(1)
        out = model(input_ids=IDS, labels=IDS)
        out.loss.backward()
        results.append((out.logits, {n: p.grad for n, p in model.named_parameters()}))
    assert torch.equal(results[0][0], results[1][0])
    for name, grad in results[0][1].items():
        assert torch.equal(grad, results[1][1][name]), name
    site_count = len(sites(routed))
    assert len(seen) == 6 * site_count  # two operands of each of three GEMMs
    handle.remove()
    assert attached(routed) == [] and not routed._forward_pre_hooks


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self.proj(x) @ other


def test_gemms_against_hand_computation() -> None:
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(5, 8, requires_grad=True)
    other = torch.randn(6, 3, requires_grad=True)
    grad = torch.randn(5, 3)
    fmt = "fp8_e4m3"
    calls: list[tuple[str, str, str, int]] = []

    def quantizer(site, gemm, operand, tensor, axis):
        calls.append((site.name, gemm, operand, axis))
        return numscope.quantize(tensor, fmt, scaling="tensor")

    attach(model, quantizer, name="q")
    y = model(x, other)
    y.backward(grad)
    q = lambda t: numscope.quantize(t, fmt, scaling="tensor")  # noqa: E731
    w, b = model.proj.weight.detach(), model.proj.bias.detach()
    h = q(x.detach()) @ q(w).t() + b
    assert torch.equal(y, q(h) @ q(other.detach()))
    dh = q(grad) @ q(other.detach()).t()
    assert torch.allclose(other.grad, q(h).t() @ q(grad), rtol=0, atol=1e-6)
    assert torch.allclose(model.proj.weight.grad, q(dh).t() @ q(x.detach()), rtol=0, atol=1e-6)
    assert torch.allclose(x.grad, q(dh) @ q(w), rtol=0, atol=1e-6)
    assert torch.allclose(model.proj.bias.grad, dh.sum(0), rtol=0, atol=1e-6)  # unquantized grad_output
    assert ("proj", "dgrad", "weight", 0) in calls and ("proj", "wgrad", "input", 0) in calls
    assert ("matmul0", "fprop", "weight", 0) in calls and ("matmul0", "wgrad", "input", 0) in calls


def test_mx_wgrad_blocks_run_along_tokens() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3, bias=False))
    x = torch.randn(64, 4, requires_grad=True)
    x.data[0] = 1000.0  # one huge token: along tokens it shares a block with 31 others, along features not
    seen = {}

    def mx(site, gemm, operand, tensor, axis):
        seen[(gemm, operand)] = (tuple(tensor.shape), axis)
        return numscope.quantize(tensor, "mxfp4", scaling=numscope.Scaling("block", axis=axis))

    attach(model, mx, name="mx")
    model(x).backward(torch.ones(64, 3))
    assert seen[("wgrad", "input")] == ((64, 4), 0)
    along_tokens = numscope.quantize(x.detach(), "mxfp4", scaling=numscope.Scaling("block", axis=0))
    along_features = numscope.quantize(x.detach(), "mxfp4", scaling=numscope.Scaling("block", axis=-1))
    assert not torch.equal(along_tokens, along_features)
    assert torch.allclose(model[0].weight.grad, torch.ones(64, 3).t() @ along_tokens, rtol=0, atol=1e-4)


def test_sdpa_reference_matches_torch() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 7, 8), torch.randn(2, 4, 9, 8), torch.randn(2, 4, 9, 5)
    bool_mask = torch.rand(7, 9) > 0.3
    bool_mask[:, 0] = True
    additive = torch.randn(2, 1, 7, 9)
    for kwargs in ({}, {"attn_mask": bool_mask}, {"attn_mask": additive}, {"scale": 0.3}):
        assert torch.allclose(
            sdpa_reference(q, k, v, **kwargs), F.scaled_dot_product_attention(q, k, v, **kwargs), atol=1e-5
        )
    q2, k2 = torch.randn(2, 4, 9, 8), torch.randn(2, 4, 9, 8)
    assert torch.allclose(
        sdpa_reference(q2, k2, v, is_causal=True),
        F.scaled_dot_product_attention(q2, k2, v, is_causal=True),
        atol=1e-5,
    )
    kg, vg = torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 5)
    expected = F.scaled_dot_product_attention(q, kg, vg, enable_gqa=True)
    assert torch.allclose(sdpa_reference(q, kg, vg, enable_gqa=True), expected, atol=1e-5)
    torch.manual_seed(3)
    dropped = sdpa_reference(q, k, v, dropout_p=0.5)
    assert not torch.allclose(dropped, sdpa_reference(q, k, v))
    assert torch.allclose(dropped.mean(), sdpa_reference(q, k, v).mean(), atol=0.2)


def test_accumulation_error_grows_with_length_in_bf16_and_fp16_only() -> None:
    torch.manual_seed(0)
    errors: dict[str, list[float]] = {"fp32": [], "bf16": [], "fp16": []}
    for length in (64, 4096):
        a = torch.rand(8, length)
        b = torch.rand(length, 8)
        exact = a.double() @ b.double()
        for acc in errors:
            relative = ((accumulate_matmul(a, b, acc).double() - exact).abs() / exact).max().item()
            errors[acc].append(relative)
    assert errors["fp32"][1] < 1e-5
    for acc in ("bf16", "fp16"):
        assert errors[acc][1] > 4 * errors[acc][0]
        assert errors[acc][1] > 100 * errors["fp32"][1]
    with pytest.raises(ValueError, match="unknown accumulate 'fp8'; allowed: fp32, bf16, fp16"):
        accumulate_matmul(a, b, "fp8")


@pytest.mark.parametrize("name", ["fp22", "bf16"])
def test_narrow_accumulation_in_row_slices_gives_the_whole_gemms_bits(monkeypatch, name: str) -> None:
    """Chunk sums in row slices, into the reused per-thread buffer, against every chunk sum at once in fresh
    memory: the same bits (torch's float32 sums of 32 products do not depend on the row count here), on the
    benchmarks' and BERT-base's shapes, a batched activation and a contraction that is no multiple of 32;
    and a result does not change when a later call reuses the buffer."""
    from numscope.sites import gemm

    generator = torch.Generator().manual_seed(0)
    cases = [
        ((512, 768), (768, 96)),
        ((300, 200), (200, 130)),
        ((3, 70, 64), (64, 40)),
        ((4096, 128), (128, 16)),
    ]
    monkeypatch.setattr(gemm, "PARTIALS_BYTES", 64 * 2**10)  # slices of SLICE_MIN_ROWS and more rows
    for a_shape, b_shape in cases:
        a, b = torch.randn(a_shape, generator=generator), torch.randn(b_shape, generator=generator)
        sliced = accumulate_matmul(a, b, name)
        with monkeypatch.context() as whole:
            whole.setattr(gemm, "PARTIALS_BYTES", 2**40)
            whole.setattr(gemm, "REUSE_PARTIALS", False)
            expected = accumulate_matmul(a, b, name)
        assert torch.equal(sliced.view(torch.int32), expected.view(torch.int32)), (a_shape, b_shape)
        kept = sliced.clone()
        accumulate_matmul(torch.randn(a_shape, generator=generator), b, name)
        assert torch.equal(sliced, kept)


def test_accumulate_option_reaches_every_gemm() -> None:
    torch.manual_seed(0)
    model = nn.Linear(256, 4)
    x = torch.rand(3, 256, requires_grad=True)

    class Bf16Sum:
        def __call__(self, site, gemm, operand, tensor, axis):
            return tensor

        def accumulate(self, site):
            return "bf16"

    attach(model, Bf16Sum(), name="acc")
    y = model(x)
    expected = accumulate_matmul(x.detach(), model.weight.detach().t(), "bf16") + model.bias.detach()
    assert torch.equal(y, expected)
    assert not torch.equal(y, F.linear(x, model.weight, model.bias))
    y.backward(torch.ones(3, 4))
    assert torch.equal(x.grad, accumulate_matmul(torch.ones(3, 4), model.weight.detach(), "bf16"))


def test_attach_errors_and_chain_order() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    order: list[str] = []

    def named(tag: str):
        def handler(site, gemm, operand, tensor, axis):
            order.append(tag)
            return tensor

        return handler

    first = attach(model, named("a"), name="a")
    attach(model, named("b"), name="b")
    with pytest.raises(ValueError, match="already attached"):
        attach(model, identity, name="a")
    with pytest.raises(ValueError, match="unknown storage 'fp8'"):
        attach(model, identity, name="c", storage="fp8")
    model(torch.ones(1, 2))
    assert order[:2] == ["a", "b"]
    first.remove()
    assert attached(model) == ["b"]
    assert list(model.state_dict()) == ["0.weight", "0.bias"]


def test_a_forward_interrupted_by_ctrl_c_leaves_no_interception_behind() -> None:
    """torch skips always_call hooks on KeyboardInterrupt; numscope must not keep intercepting after it."""
    from torch.overrides import _get_current_function_mode_stack

    model = bert("eager")
    seen: list[str] = []

    def record(site, gemm, operand, tensor, axis):
        seen.append(site.name)
        return tensor

    attach(model, record, name="record")
    model(input_ids=IDS)

    def interrupt(module, args):
        raise KeyboardInterrupt

    hook = model.bert.encoder.layer[0].attention.self.value.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(input_ids=IDS)
    hook.remove()
    seen.clear()
    torch.randn(4, 8) @ torch.randn(8, 3)  # a plain matmul: no site, no handler
    F.linear(torch.randn(2, 32), model.bert.encoder.layer[0].attention.self.value.weight)
    assert seen == []
    model(input_ids=IDS)  # the next forward is intercepted as usual and cleans up the stale mode
    assert seen and _get_current_function_mode_stack() == []


class _KeywordProducts(nn.Module):
    """Bloom's attention calls ``baddbmm(input, batch1=..., batch2=...)``; addmm by keyword too."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 8, 8) / 4)
        self.weight2 = nn.Parameter(torch.randn(8, 8) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.baddbmm(torch.zeros(3, 4, 8), batch1=x, batch2=self.weight)
        return torch.addmm(torch.zeros(4, 8), mat1=scores.sum(0), mat2=self.weight2)


def test_gemms_called_with_keyword_operands_are_sites_parsed_as_torch_parses_them() -> None:
    torch.manual_seed(0)
    model, x = _KeywordProducts(), torch.randn(3, 4, 8)
    reference = model(x)
    assert [site.kind for site in sites(model, x)] == ["matmul", "matmul"]
    numscope.convert(model, numscope.Plan.uniform("fp32"))
    assert torch.equal(model(x), reference)  # identical in fp32: the keyword operands are the product's
    numscope.unconvert(model)
    numscope.convert(model, numscope.Plan.uniform("fp8_e4m3"))
    quantized = model(x)
    assert not torch.equal(quantized, reference) and torch.allclose(quantized, reference, rtol=0.2, atol=0.1)
