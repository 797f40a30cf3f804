"""Grouped-query attention (Llama, Mistral, Qwen2 with fewer key/value heads than query heads): every entry
point works, on transformers' default SDPA path (``enable_gqa``) and on the eager path (``repeat_kv``)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import numscope
from numscope.sites import attach, sdpa_reference

FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig),
    "mistral": (MistralForCausalLM, MistralConfig),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config),
}
IDS = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
LAYERS = 2


def model(family: str, impl: str, kv_heads: int = 2):
    torch.manual_seed(0)
    cls, config = FAMILIES[family]
    return cls(
        config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            attn_implementation=impl,
        )
    )


def step(net) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = net(input_ids=IDS, labels=IDS)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad for name, p in net.named_parameters()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_gqa_sites_and_identity(family: str, impl: str) -> None:
    reference, routed = model(family, impl), model(family, impl)
    seen: set[str] = set()

    def record(site, gemm, operand, tensor, axis):
        seen.add(site.name)
        return tensor

    attach(routed, record, name="record")
    (logits, grads), (routed_logits, routed_grads) = step(reference), step(routed)
    names = [site.name for site in numscope.sites(routed)]
    per_layer = ["q_proj", "k_proj", "v_proj", "scores", "context", "o_proj"]
    for layer in range(LAYERS):
        for name in per_layer:
            assert f"model.layers.{layer}.self_attn.{name}" in names
    # 4 attention projections + 2 attention products + 3 MLP GEMMs per layer, and the LM head
    assert len(names) == LAYERS * 9 + 1 and seen == set(names)
    if impl == "eager":  # the same products autograd issues: bit for bit
        assert torch.equal(logits, routed_logits)
        assert all(torch.equal(grads[name], routed_grads[name]) for name in grads)
    else:  # the fused SDPA kernel rebuilt as two GEMMs and an fp32 softmax: equal to float32 rounding
        assert torch.allclose(logits, routed_logits, rtol=0, atol=1e-5)
        assert all(torch.allclose(grads[name], routed_grads[name], rtol=0, atol=1e-6) for name in grads)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_gqa_convert_observe_recommend(impl: str, tmp_path) -> None:
    net = model("llama", impl)
    numscope.convert(net, numscope.Plan.uniform("fp32"))
    logits, _ = step(net)
    assert torch.equal(logits, step(model("llama", impl))[0])  # fp32: nothing quantized
    trained = model("llama", impl)
    numscope.convert(trained, numscope.Plan.uniform("fp8"))
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = trained(input_ids=IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    observed = model("llama", impl)
    with numscope.observe(observed, candidates=["bf16", "fp8_e4m3", "mxfp8_e4m3"], every=1) as observer:
        step(observed)
        observer.step()
    analysis = observer.analysis()
    assert "model.layers.0.self_attn.scores" in analysis.sites()
    plan = numscope.recommend(analysis)
    assert plan.describe()


def test_multi_query_attention_and_bad_head_counts() -> None:
    mqa, reference = model("llama", "sdpa", kv_heads=1), model("llama", "eager", kv_heads=1)
    attach(mqa, lambda site, gemm, operand, tensor, axis: tensor, name="identity")
    assert torch.allclose(step(mqa)[0], step(reference)[0], rtol=0, atol=1e-5)
    q, k = torch.randn(1, 6, 4, 8), torch.randn(1, 4, 4, 8)
    with pytest.raises(RuntimeError, match=r"query heads \(6\) must be a multiple of key heads \(4\)"):
        sdpa_reference(q, k, k, enable_gqa=True)
