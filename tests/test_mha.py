"""torch's own attention: ``nn.MultiheadAttention`` (self- and cross-attention, separate key/value sizes,
masks, attention weights) and ``nn.TransformerEncoder``/``nn.Transformer`` built on it. Its functional
forward runs unfused under numscope, so its projections and its two attention products are sites."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import numscope
from numscope.sites import attach, sites


def run(module: nn.Module, *inputs: torch.Tensor, routed: bool, **kwargs):
    """Output and parameter gradients, with a recording identity handler attached when ``routed``."""
    seen: set[str] = set()
    handle = None
    if routed:
        handle = attach(module, lambda site, g, o, tensor, a: (seen.add(site.name), tensor)[1], name="rec")
    out = module(*inputs, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    if handle is not None:
        handle.remove()
    return out.detach(), grads, seen


def mha(**kwargs) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(32, 4, **kwargs)


X = torch.randn(7, 3, 32, generator=torch.Generator().manual_seed(1))  # (length, batch, embed)
MEMORY = torch.randn(5, 3, 32, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize(
    "case,make,inputs,kwargs,projections",
    [
        ("self, weights", lambda: mha(), (X, X, X), {"need_weights": True}, ["in_proj"]),
        ("self, sdpa", lambda: mha(), (X, X, X), {"need_weights": False}, ["in_proj"]),
        (
            "self, mask",
            lambda: mha(),
            (X, X, X),
            {"attn_mask": torch.triu(torch.ones(7, 7, dtype=torch.bool), 1), "need_weights": True},
            ["in_proj"],
        ),
        ("cross", lambda: mha(), (X, MEMORY, MEMORY), {"need_weights": True}, ["in_proj_q", "in_proj_kv"]),
        (
            "separate sizes",
            lambda: mha(kdim=16, vdim=24),
            (X, torch.randn(5, 3, 16), torch.randn(5, 3, 24)),
            {"need_weights": True},
            ["q_proj", "k_proj", "v_proj"],
        ),
    ],
)
def test_multihead_attention_is_four_kinds_of_sites(case, make, inputs, kwargs, projections) -> None:
    reference, routed = make(), make()
    out, grads, _ = run(reference, *inputs, routed=False, **kwargs)
    routed_out, routed_grads, seen = run(routed, *inputs, routed=True, **kwargs)
    names = {f"{p}" for p in projections} | {"scores", "context", "out_proj"}
    assert seen == names
    assert {site.name for site in sites(routed, inputs)} == names
    if kwargs.get("need_weights"):  # bmm/baddbmm, softmax, bmm, linear: the same products, bit for bit
        assert torch.equal(out, routed_out)
        assert all(torch.equal(grads[name], routed_grads[name]) for name in grads), case
    else:  # SDPA rebuilt as two GEMMs and an fp32 softmax
        assert torch.allclose(out, routed_out, atol=1e-6)
        assert all(torch.allclose(grads[n], routed_grads[n], atol=1e-5) for n in grads)


def test_a_plan_reaches_multihead_attention() -> None:
    layer = mha()
    numscope.convert(layer, numscope.Plan.uniform("fp8"))
    quantized, _, _ = run(layer, X, X, X, routed=False, need_weights=True)
    plain, _, _ = run(mha(), X, X, X, routed=False, need_weights=True)
    assert not torch.allclose(quantized, plain, atol=1e-4)
    plan = numscope.Plan.uniform("fp32").with_rule("out_proj", numscope.SiteSpec.uniform("bf16"))
    only_out = mha()
    numscope.convert(only_out, plan)
    out, _, _ = run(only_out, X, X, X, routed=False, need_weights=True)
    by_hand = mha()
    attention, _ = by_hand(X, X, X, need_weights=True)  # recompute the output projection in bf16 by hand
    assert not torch.equal(out, attention.detach())


def transformer() -> nn.Transformer:
    torch.manual_seed(0)
    return nn.Transformer(32, 4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64, dropout=0.0)


def test_torch_transformer_sites_train_under_fp8_and_mxfp8() -> None:
    source, target = torch.randn(6, 2, 32), torch.randn(5, 2, 32)
    names = [site.name for site in sites(transformer(), (source, target))]
    assert (
        "encoder.layers.0.self_attn.in_proj" in names
        and "decoder.layers.0.multihead_attn.in_proj_kv" in names
    )
    assert "decoder.layers.0.multihead_attn.scores" in names and "decoder.layers.0.linear2" in names
    assert len(names) == (4 + 2) + (4 + 5 + 2)  # encoder: attention + FFN; decoder: two attentions + FFN
    for preset in ("fp8", "mxfp8"):
        model = transformer()
        numscope.convert(model, numscope.Plan.uniform(preset))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for _ in range(3):
            loss = (model(source, target) - target).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0], (preset, losses)


def test_the_encoder_fast_path_is_observed_in_evaluation() -> None:
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 1).eval()
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        fused = encoder(x)  # torch's fused fast path (no numscope attached)
    with numscope.observe(encoder, candidates=["bf16", "fp8_e4m3"], every=1, no_grad_forwards=True) as obs:
        with torch.no_grad():
            observed = encoder(x)
        obs.step()
    assert torch.allclose(fused, observed, atol=1e-5)
    assert "layers.0.self_attn.in_proj" in obs.analysis().sites()
