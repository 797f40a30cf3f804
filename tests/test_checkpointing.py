"""Activation checkpointing, as users train: transformers' ``gradient_checkpointing_enable`` and
``torch.utils.checkpoint`` around layers, in both modes (reentrant and not). The recomputed forward is
quantized exactly as the first one, so gradients equal the same plan's without checkpointing bit for bit,
and an observer measures every operand once per step."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.test_architectures import (
    IDS,
    LanguageModel,
    _cnn,
    _llama,
    _loss,
    _lstm,
    _mixtral,
    _t5,
    _torch_transformer,
    _vit,
    _whisper,
)

import numscope
from numscope.convert import numerics_state_dict

MODES = [True, False]
MODE_IDS = ["reentrant", "non-reentrant"]


class Checkpointed(nn.Module):
    """A part of a model run under ``torch.utils.checkpoint`` (as a user's own model does it)."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner = inner
        self.reentrant = reentrant

    def forward(self, *args, **kwargs):
        # reentrant checkpointing takes no keyword arguments: they ride on the function
        return checkpoint(functools.partial(self.inner, **kwargs), *args, use_reentrant=self.reentrant)


def with_checkpointing(model: nn.Module, reentrant: bool) -> nn.Module:
    """Checkpoint each layer: transformers' own switch where the model has one, else wrap its parts."""
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
    elif isinstance(
        model, nn.Transformer
    ):  # the decoder: its memory input has a gradient (reentrant needs one)
        model.decoder = Checkpointed(model.decoder, reentrant)
    elif isinstance(model, LanguageModel):
        model.rnn = Checkpointed(model.rnn, reentrant)
    else:  # the CNN: its residual block and the strided convolution after it
        for index in (3, 4):
            model[index] = Checkpointed(model[index], reentrant)
    return model


def gradients(
    model: nn.Module, plan: numscope.Plan, steps: int = 1
) -> tuple[list[float], list[torch.Tensor]]:
    """Losses of ``steps`` SGD steps under ``plan`` and the last step's gradients, in parameter order."""
    numscope.convert(model, plan, generator=torch.Generator().manual_seed(5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = _loss(model)
        loss.backward()
        losses.append(loss.item())
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        optimizer.step()
    return losses, grads


def assert_same(plain: tuple, checkpointed: tuple) -> None:
    assert checkpointed[0] == plain[0]
    assert len(checkpointed[1]) == len(plain[1]) and plain[1]
    for index, (want, got) in enumerate(zip(plain[1], checkpointed[1], strict=True)):
        assert torch.equal(got, want), f"gradient {index} differs by {(got - want).abs().max().item():.3g}"


ARCHITECTURES = [_llama, _mixtral, _t5, _vit, _whisper, _cnn, _lstm, _torch_transformer]
ARCHITECTURE_IDS = ["gqa-llama", "moe", "t5", "vit", "whisper", "cnn", "lstm", "nn.Transformer"]


@pytest.mark.parametrize("reentrant", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("make", ARCHITECTURES, ids=ARCHITECTURE_IDS)
def test_checkpointed_gradients_are_bit_identical(make, reentrant: bool) -> None:
    """FP8 (current scaling): before, the non-reentrant mode failed with torch's CheckpointError and the
    reentrant one left the recomputed layers' backward GEMMs unquantized (Llama's gradients 17% off)."""
    plan = numscope.Plan.uniform("fp8")
    plain = gradients(make(), plan)
    checkpointed = gradients(with_checkpointing(make(), reentrant), plan)
    assert_same(plain, checkpointed)
    fp32 = gradients(make(), numscope.Plan.uniform("fp32"))
    assert any(not torch.equal(a, b) for a, b in zip(fp32[1], plain[1], strict=True))  # fp8 did something


STATEFUL = {
    # Transformer Engine's delayed scaling: the amax history moves on at every forward call
    "te_delayed": lambda: numscope.Plan.recipe("te_delayed"),
    # stochastic rounding in forward, from the quantizer's own generator
    "stochastic_forward": lambda: numscope.Plan.from_dict(
        {
            "numscope_plan": 1,
            "default": {"all": {"format": "fp8_e4m3", "rounding": "stochastic", "scaling": "tensor"}},
        }
    ),
    "mxfp8": lambda: numscope.Plan.uniform("mxfp8"),  # wgrad inputs prequantized in forward
    "te_nvfp4": lambda: numscope.Plan.recipe("te_nvfp4"),  # 2-D weight scales, RHT, stochastic gradients
}


@pytest.mark.parametrize("reentrant", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", list(STATEFUL))
def test_stateful_forward_quantization_is_replayed(name: str, reentrant: bool) -> None:
    """Three steps: the recomputation takes the forward's scale and random bits, and leaves the amax
    history and the generator as the forward left them (the later steps would differ otherwise)."""
    plain_model, checkpointed_model = _llama(), with_checkpointing(_llama(), reentrant)
    plain = gradients(plain_model, STATEFUL[name](), steps=3)
    checkpointed = gradients(checkpointed_model, STATEFUL[name](), steps=3)
    assert_same(plain, checkpointed)
    state, checkpointed_state = numerics_state_dict(plain_model), numerics_state_dict(checkpointed_model)
    assert state["scalers"].keys() == checkpointed_state["scalers"].keys()
    for key, scaler in state["scalers"].items():
        assert torch.equal(scaler["amax_history"], checkpointed_state["scalers"][key]["amax_history"]), key
    if name == "te_delayed":
        assert state["scalers"]  # the recipe keeps histories


def test_a_recomputation_without_its_forward_is_refused() -> None:
    """Replay needs the forward's records: two training forwards before one backward cannot be replayed."""
    model = with_checkpointing(_llama(), reentrant=False)
    numscope.convert(model, numscope.Plan.recipe("te_delayed"))
    first = _loss(model)
    model(input_ids=IDS.flip(1), labels=IDS.flip(1))  # a second training forward
    with pytest.raises(RuntimeError, match="activation checkpointing recomputes operand"):
        first.backward()


@pytest.mark.parametrize("reentrant", MODES, ids=MODE_IDS)
def test_the_observer_sees_every_operand_once(reentrant: bool) -> None:
    def analysis(model: nn.Module):
        with numscope.observe(model, ["fp8_e4m3", "mxfp8_e4m3", "bf16"]) as observer:
            for _ in range(2):
                _loss(model).backward()
                observer.step()
        return observer.analysis()

    plain, checkpointed = analysis(_llama()), analysis(with_checkpointing(_llama(), reentrant))
    assert plain.to_dict() == checkpointed.to_dict()
    dgrads = {key for key in plain.operands if key[1] == "dgrad"}
    assert "model.layers.0.mlp.down_proj" in {key[0] for key in dgrads}


@pytest.mark.parametrize("reentrant", MODES, ids=MODE_IDS)
def test_the_mixed_precision_recipe_under_checkpointing(reentrant: bool) -> None:
    """bf16 compute with fp32 ops and an fp8 plan: the recomputed forward keeps softmax and norms in fp32
    as the first one did (activations kept as autograd saves them: checkpointing keeps none there)."""

    def run(model: nn.Module) -> tuple[list[float], list[torch.Tensor]]:
        recipe = numscope.Recipe(model, plan="fp8", dtype=torch.bfloat16, activations=None, loss_scale=None)
        loss = _loss(model)
        recipe.backward(loss)
        return [loss.item()], [p.grad.clone() for p in model.parameters() if p.grad is not None]

    assert_same(run(_llama()), run(with_checkpointing(_llama(), reentrant)))


#: this session's numerics together (issue 28): TE's Four Over Six and NaN rule in forward, the MXFP4
#: recipe's fresh 64-wide Hadamard signs with stochastic rounding in backward
NEW_NUMERICS = {
    "numscope_plan": 1,
    "default": {
        "fprop": {"input": "nvfp4@4over6@mae@nan", "weight": "nvfp4@2d@4over6@mae@nan"},
        "backward": {"format": "mxfp4_e2m1", "rounding": "stochastic", "transform": "rht64:fresh"},
    },
}


@pytest.mark.parametrize("make", ARCHITECTURES, ids=ARCHITECTURE_IDS)
def test_the_new_numerics_run_checkpointed_on_every_architecture_bit_identically(make) -> None:
    plan = numscope.Plan.from_dict(NEW_NUMERICS)
    plain = gradients(make(), plan, steps=2)
    checkpointed = gradients(with_checkpointing(make(), False), plan, steps=2)
    assert_same(plain, checkpointed)
    assert all(torch.isfinite(g).all() for g in plain[1])
