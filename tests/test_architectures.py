"""The architectures people train, from tiny configs: mixture-of-experts (both of transformers' experts
implementations), T5, and the GEMMs numscope does not intercept (RNNs), which it says it skips."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import MixtralConfig, MixtralForCausalLM, T5Config, T5ForConditionalGeneration

import numscope
from numscope.sites import attach, sites

IDS = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(0))
EXPERTS = 4
EXPERT_SITES = {
    f"model.layers.0.mlp.experts.{weights}.{index}"
    for weights in ("gate_up_proj", "down_proj")
    for index in range(EXPERTS)
}


def mixtral(implementation: str) -> MixtralForCausalLM:
    torch.manual_seed(0)
    model = MixtralForCausalLM(
        MixtralConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=EXPERTS,
            num_experts_per_tok=2,
        )
    )
    model.set_experts_implementation(implementation)
    return model


def step(model, routed: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor], set[str]]:
    seen: set[str] = set()
    if routed:
        attach(model, lambda site, g, o, tensor, a: (seen.add(site.name), tensor)[1], name="identity")
    out = model(input_ids=IDS, labels=IDS)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}, seen


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_every_expert_is_a_stable_site(implementation: str) -> None:
    found = [site.name for site in sites(mixtral(implementation), {"input_ids": IDS})]
    experts = [
        f"model.layers.0.mlp.experts.{p}.{i}" for p in ("gate_up_proj", "down_proj") for i in range(EXPERTS)
    ]
    assert set(experts) <= set(found)
    assert "model.layers.0.mlp.gate" in found  # the router: its module's name, not an attention product
    assert not any(name.endswith(("gate.scores", "matmul0")) for name in found)
    (logits, grads, _), (routed_logits, routed_grads, seen) = (
        step(mixtral(implementation)),
        step(mixtral(implementation), routed=True),
    )
    assert seen >= EXPERT_SITES
    assert torch.allclose(logits, routed_logits, rtol=0, atol=1e-6)
    assert all(torch.allclose(grads[n], routed_grads[n], rtol=0, atol=1e-6) for n in grads)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_experts_train_and_are_observed_by_index(implementation: str) -> None:
    model = mixtral(implementation)
    plan = numscope.Plan.uniform("fp32").with_rule("*.experts.*", numscope.SiteSpec.uniform("fp8_e4m3"))
    numscope.convert(model, plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    observed = mixtral(implementation)
    with numscope.observe(observed, candidates=["bf16", "fp8_e4m3"], every=1) as observer:
        step(observed)
        observer.step()
    hit = {name for name in observer.analysis().sites() if ".experts." in name}
    assert hit and hit <= {
        f"model.layers.0.mlp.experts.{p}.{i}" for p in ("gate_up_proj", "down_proj") for i in range(4)
    }


def test_t5_sites_and_training() -> None:
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(
        T5Config(
            vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0
        )
    )
    names = [site.name for site in sites(model, {"input_ids": IDS, "labels": IDS})]
    assert "encoder.block.0.layer.0.SelfAttention.scores" in names
    assert "decoder.block.0.layer.1.EncDecAttention.context" in names and "lm_head" in names
    numscope.convert(model, numscope.Plan.uniform("mxfp8"))
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert torch.isfinite(loss)


class LanguageModel(nn.Module):
    def __init__(self, cell: type[nn.RNNBase], **kwargs) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.rnn = nn.Embedding(50, 16), cell(16, 16, **kwargs)
        width = 32 if kwargs.get("bidirectional") else 16
        self.head = nn.Linear(width, 50)

    def forward(self, ids):
        return self.head(self.rnn(self.embed(ids))[0])


RECURRENT = [
    (nn.LSTM, {"num_layers": 2, "bidirectional": True}),
    (nn.GRU, {"num_layers": 2, "batch_first": True, "dropout": 0.0}),
    (nn.RNN, {"nonlinearity": "relu"}),
    (nn.LSTM, {"bias": False}),
]


@pytest.mark.parametrize(
    "cell,kwargs", RECURRENT, ids=["lstm-2-bi", "gru-2-batch-first", "rnn-relu", "lstm-nobias"]
)
def test_recurrent_layers_are_unrolled_into_sites(cell, kwargs) -> None:
    ids = torch.randint(0, 50, (5, 3), generator=torch.Generator().manual_seed(1))
    results, seen = [], set()
    for routed in (False, True):
        model = LanguageModel(cell, **kwargs)
        if routed:
            attach(model, lambda site, g, o, tensor, a: (seen.add(site.name), tensor)[1], name="identity")
        model(ids).square().mean().backward()
        results.append((model(ids).detach(), {n: p.grad for n, p in model.named_parameters()}))
    (out, grads), (routed_out, routed_grads) = results
    # the fused kernel rebuilt from its GEMMs in ATen's order: equal to float32 rounding
    assert torch.allclose(out, routed_out, rtol=0, atol=1e-6)
    assert all(torch.allclose(grads[n], routed_grads[n], rtol=0, atol=1e-5) for n in grads)
    names = [site.name for site in sites(LanguageModel(cell, **kwargs), ids)]
    layers, directions = kwargs.get("num_layers", 1), 2 if kwargs.get("bidirectional") else 1
    suffixes = [f"l{layer}{'_reverse' * d}" for layer in range(layers) for d in range(directions)]
    expected = {f"rnn.{kind}_{suffix}" for suffix in suffixes for kind in ("ih", "hh")}
    assert set(names) == expected | {"head"} and seen == set(names)


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_a_recurrent_language_model_trains_and_is_observed(cell) -> None:
    ids = torch.randint(0, 50, (6, 4), generator=torch.Generator().manual_seed(2))
    model = LanguageModel(cell)
    numscope.convert(model, numscope.Plan.uniform("fp8"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(4):
        loss = nn.functional.cross_entropy(model(ids[:-1]).flatten(0, 1), ids[1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    observed = LanguageModel(cell)
    with numscope.observe(observed, candidates=["bf16", "fp8_e4m3"], every=1) as observer:
        observed(ids).sum().backward()
        observer.step()
    analysis = observer.analysis()
    assert {"rnn.ih_l0", "rnn.hh_l0"} <= set(analysis.sites())
    assert numscope.recommend(analysis).describe()


def test_what_is_not_unrolled_says_so() -> None:
    lstm = nn.LSTM(4, 8, proj_size=3)
    numscope.convert(lstm, numscope.Plan.uniform("fp8"))
    with pytest.warns(UserWarning, match="a packed sequence or projected LSTM, fused"):
        lstm(torch.randn(5, 2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per module and op, not at every step
        lstm(torch.randn(5, 2, 4))


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _torch_transformer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Transformer(32, 4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64, dropout=0.0)


def _lstm() -> nn.Module:
    return LanguageModel(nn.LSTM, num_layers=2)


@pytest.mark.parametrize(
    "make", [_llama, _torch_transformer, _lstm], ids=["gqa-llama", "nn.Transformer", "lstm"]
)
def test_compiled_mx_quantizers_with_inputs_kept_in_bfloat16_match_the_eager_reference(make) -> None:
    """The compiled MX quantizers quantize wgrad's inputs in forward and keep them as bfloat16: on GQA Llama,
    torch's own Transformer and an unrolled LSTM the gradients equal the eager reference's (which quantizes
    in backward)."""
    grads = {}
    for compiled in (True, False):
        model = make()
        numscope.convert(model, numscope.Plan.uniform("mxfp8"), compiled=compiled)
        if isinstance(model, nn.Transformer):
            source = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(1))
            target = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(2))
            loss = (model(source, target) - target).square().mean()
        elif isinstance(model, LanguageModel):
            loss = model(IDS % 50).square().mean()
        else:
            loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        grads[compiled] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for name, grad in grads[True].items():
        assert torch.equal(grad, grads[False][name]), name


def _mixtral() -> nn.Module:
    return mixtral("eager")


def _t5() -> nn.Module:
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0
    )
    return T5ForConditionalGeneration(config)


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, num_labels=3,
    )  # fmt: skip
    return ViTForImageClassification(config)


def _whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=100, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=16, max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1,
    )  # fmt: skip
    return WhisperForConditionalGeneration(config)


def _cnn() -> nn.Module:
    from tests.test_conv import resnet

    return resnet()


def _loss(model: nn.Module) -> torch.Tensor:
    """One loss of each architecture's own kind, from fixed inputs."""
    noise = torch.Generator().manual_seed(3)
    if isinstance(model, nn.Transformer):
        source, target = torch.randn(6, 2, 32, generator=noise), torch.randn(5, 2, 32, generator=noise)
        return (model(source, target) - target).square().mean()
    if isinstance(model, LanguageModel):
        return model(IDS % 50).square().mean()
    if isinstance(model, nn.Sequential):  # the CNN
        return model(torch.randn(2, 1, 8, 8, generator=noise)).square().mean()
    name = type(model).__name__
    if name.startswith("ViT"):
        pixels = torch.randn(2, 3, 16, 16, generator=noise)
        return model(pixel_values=pixels, labels=torch.tensor([0, 2])).loss
    if name.startswith("Whisper"):
        features = torch.randn(2, 8, 32, generator=noise)
        return model(input_features=features, labels=torch.randint(3, 100, (2, 5), generator=noise)).loss
    return model(input_ids=IDS, labels=IDS).loss


ARCHITECTURES = [_llama, _mixtral, _t5, _vit, _whisper, _cnn, _lstm, _torch_transformer]
ARCHITECTURE_IDS = ["gqa-llama", "moe", "t5", "vit", "whisper", "cnn", "lstm", "nn.Transformer"]


@pytest.mark.parametrize("make", ARCHITECTURES, ids=ARCHITECTURE_IDS)
def test_one_pass_mx_gradients_and_the_loss_scaling_preset_on_every_architecture(make, monkeypatch) -> None:
    """This change's paths on the architectures people train: MXFP8 gradients quantized in both block
    directions in one pass give the gradients of two separate passes, bit for bit (and the one pass is
    taken wherever a Linear's gradient rows are whole blocks); the ``e5m2_grads`` preset trains (finite
    loss and gradients) and leaves the forward pass exactly as FP32."""
    from numscope.sites.gemm import _Call

    def gradients(plan: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = make()
        numscope.convert(model, numscope.Plan.uniform(plan))
        loss = _loss(model)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    announced = []
    announce = _Call.announce_gradient

    def recording(call, tensor):
        announced.append(tensor.shape)
        announce(call, tensor)

    monkeypatch.setattr(_Call, "announce_gradient", recording)
    one_pass = gradients("mxfp8")
    monkeypatch.setattr(_Call, "announce_gradient", lambda call, tensor: None)
    separate = gradients("mxfp8")
    assert one_pass[1].keys() == separate[1].keys() and one_pass[1]
    assert torch.equal(one_pass[0], separate[0])
    for name, grad in one_pass[1].items():
        assert torch.equal(grad, separate[1][name]), name
    if make is not _cnn:  # a CNN's only Linear has 10 outputs: no whole block of 32
        assert any(shape[-1] % 32 == 0 for shape in announced)
    monkeypatch.undo()

    e5m2_loss, e5m2_grads = gradients("e5m2_grads")
    fp32_loss, fp32_grads = gradients("fp32")
    # forward operands stay high: the same loss (to 2 ulps: Whisper's cross-attention products, computed by
    # their sites, differ from transformers' own matmul in the last bit, whatever the plan's gradients)
    torch.testing.assert_close(e5m2_loss, fp32_loss, rtol=1e-6, atol=0)
    assert e5m2_grads.keys() == fp32_grads.keys()
    assert all(torch.isfinite(grad).all() for grad in e5m2_grads.values())
    assert any(not torch.equal(e5m2_grads[n], fp32_grads[n]) for n in fp32_grads)  # gradients quantized
