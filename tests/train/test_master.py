"""MasterWeights: fp32 masters behind an fp16/bf16 model, with any optimizer and the LossScaler."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn

from numscope.train import LossScaler, MasterWeights


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 4, generator=generator), torch.randn(16, 2, generator=generator)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    inputs, targets = _batch(step)
    return nn.functional.mse_loss(model(inputs), targets)


def test_model_is_converted_and_returns_fp32():
    model = _mlp()
    master = MasterWeights(model, dtype=torch.float16)
    assert model[0].weight.dtype == torch.float16 and model[3].bias.dtype == torch.float16
    assert model[1].weight.dtype == torch.float32  # LayerNorm kept in fp32
    assert all(param.dtype == torch.float32 for param in master.master_params())
    assert any(weight is model[1].weight for weight in master.master_params())  # fp32: its own master
    seen = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen[name] = args[0].dtype

        return hook

    model[1].register_forward_pre_hook(record("norm_input"))
    model[3].register_forward_pre_hook(record("head_input"))
    output = model(torch.randn(2, 4))
    assert output.dtype == torch.float32
    assert seen == {"norm_input": torch.float32, "head_input": torch.float16}


def test_fp16_training_with_sgd_tracks_fp32_training_closer_than_plain_fp16():
    reference, model, plain = _mlp(), _mlp(), _mlp().half()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    master = MasterWeights(model, dtype=torch.float16)
    optimizer = torch.optim.SGD(master.master_params(), lr=0.1)
    for step in range(5):
        _loss(reference, step).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        _loss(model, step).backward()
        master.step(optimizer)
        inputs, targets = _batch(step)
        nn.functional.mse_loss(plain(inputs.half()).float(), targets).backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()

    def distance(weights) -> float:
        pairs = zip(weights, reference.parameters(), strict=True)
        return max((weight.float() - expected).abs().max().item() for weight, expected in pairs)

    assert distance(master.master_params()) < 3e-4
    assert distance(master.master_params()) < distance(plain.parameters()) / 3
    assert all(param.grad is None for param in model.parameters())


def test_master_weights_keep_updates_that_fp16_rounds_away():
    """The paper's argument: 1 + 1e-4 == 1 in fp16 (half an ulp of 1.0 is 2**-11), so plain fp16 SGD
    never moves; the fp32 master accumulates the updates and the fp16 copy follows."""
    one, tiny_update = torch.tensor(1.0, dtype=torch.float16), torch.tensor(1e-4, dtype=torch.float16)
    assert one + tiny_update == one

    def layer() -> nn.Module:
        linear = nn.Linear(1, 1, bias=False)
        nn.init.ones_(linear.weight)
        return linear

    plain = layer().half()
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=1e-4)
    mastered = layer()
    master = MasterWeights(mastered, dtype=torch.float16)
    optimizer = torch.optim.SGD(master.master_params(), lr=1e-4)
    inputs = torch.ones(1, 1)
    for _ in range(10):  # loss = -w, gradient -1: each step adds lr = 1e-4 to w
        (-plain(inputs.half()).float().sum()).backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
        (-mastered(inputs).sum()).backward()
        master.step(optimizer)
    assert plain.weight.item() == 1.0
    assert master.master_params()[0].item() == pytest.approx(1.001, abs=1e-6)
    assert mastered.weight.item() == torch.tensor(1.001).half().item() != 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_adamw_with_loss_scaler_trains(dtype):
    model = _mlp()
    master = MasterWeights(model, dtype=dtype)
    optimizer = torch.optim.AdamW(master.master_params(), lr=1e-2)
    scaler = LossScaler(init_scale=2.0**10)
    losses = []
    for step in range(8):
        loss = _loss(model, step % 2)
        losses.append(loss.item())
        scaler.scale(loss).backward()
        master.step(optimizer, scaler)
    assert losses[-1] < losses[0]
    assert scaler.skipped_steps == 0


def test_skipped_step_leaves_master_and_model_unchanged():
    model = _mlp()
    master = MasterWeights(model, dtype=torch.float16)
    optimizer = torch.optim.AdamW(master.master_params(), lr=1e-2)
    scaler = LossScaler(init_scale=2.0**8)
    scaler.scale(_loss(model, 0)).backward()
    master.step(optimizer, scaler)
    masters_before = copy.deepcopy(master.state_dict())
    model_before = copy.deepcopy(model.state_dict())
    scaler.scale(_loss(model, 1)).backward()
    model[0].weight.grad[0, 0] = float("inf")
    assert master.step(optimizer, scaler) is None
    assert scaler.last_overflow.parameters == ("0.weight",)
    assert scaler.get_scale() == 2.0**7
    assert all(torch.equal(master.state_dict()[name], value) for name, value in masters_before.items())
    assert all(torch.equal(model.state_dict()[name], value) for name, value in model_before.items())


def test_clipping_between_unscale_and_step_uses_unscaled_master_grads():
    reference, model = _mlp(), _mlp()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    master = MasterWeights(model, dtype=torch.float16)
    optimizer = torch.optim.SGD(master.master_params(), lr=0.1)
    scaler = LossScaler(init_scale=2.0**12)
    for step in range(3):
        _loss(reference, step).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.05)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        master.copy_grads_to_master()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(master.master_params(), max_norm=0.05)
        master.step(optimizer, scaler)
    for weight, expected in zip(master.master_params(), reference.parameters(), strict=True):
        torch.testing.assert_close(weight, expected, rtol=0, atol=3e-4)


def test_state_dict_round_trip_into_a_fresh_model():
    model = _mlp()
    master = MasterWeights(model, dtype=torch.float16)
    optimizer = torch.optim.SGD(master.master_params(), lr=0.1)
    _loss(model, 0).backward()
    master.step(optimizer)
    state = master.state_dict()
    fresh_model = _mlp()
    fresh = MasterWeights(fresh_model, dtype=torch.float16)
    fresh.load_state_dict(state)
    for name, weight in fresh.named_master_params():
        assert torch.equal(weight, state[name])
    for mine, theirs in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    with pytest.raises(KeyError, match=r"missing \['3.bias'\], unexpected \['head.bias'\]"):
        fresh.load_state_dict(
            {**{k: v for k, v in state.items() if k != "3.bias"}, "head.bias": state["3.bias"]}
        )


def test_disabled_mode_is_a_pass_through():
    reference, model = _mlp(), _mlp()
    master = MasterWeights(model, dtype=torch.float32)
    assert not master.enabled
    assert all(mine is param for mine, param in zip(master.master_params(), model.parameters(), strict=True))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(master.master_params(), lr=0.1)
    for step in range(3):
        _loss(reference, step).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        _loss(model, step).backward()
        master.step(optimizer)
    for mine, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, expected)


def test_keep_fp32_by_name_pattern_keeps_the_subtree():
    model = nn.Sequential(
        collections.OrderedDict(body=nn.Linear(4, 4), head=nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    )
    MasterWeights(model, dtype=torch.bfloat16, keep_fp32=["head"])
    assert model.body.weight.dtype == torch.bfloat16
    assert model.head[0].weight.dtype == model.head[1].weight.dtype == torch.float32
    assert model(torch.randn(3, 4)).dtype == torch.float32


def test_structured_inputs_and_outputs_are_cast():
    Pair = collections.namedtuple("Pair", ["first", "second"])

    class Structured(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, pair: Pair, *, extra: torch.Tensor) -> dict[str, object]:
            assert pair.first.dtype == extra.dtype == torch.float16
            return {"out": self.linear(pair.first + extra), "pair": Pair(pair.second, [pair.first])}

    model = Structured()
    MasterWeights(model, dtype=torch.float16)
    output = model(Pair(torch.randn(1, 2), torch.tensor([1, 2])), extra=torch.randn(1, 2))
    assert output["out"].dtype == torch.float32
    assert isinstance(output["pair"], Pair) and output["pair"].first.dtype == torch.int64
    assert output["pair"].second[0].dtype == torch.float32


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"dtype must be torch.float16 or torch.bfloat16.*got torch.float64"):
        MasterWeights(_mlp(), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"keep_fp32 pattern 'clasifier' matches no module"):
        MasterWeights(_mlp(), keep_fp32=["clasifier"])
    with pytest.raises(TypeError, match=r"keep_fp32 takes nn.Module subclasses and glob strings, got 3"):
        MasterWeights(_mlp(), keep_fp32=[3])
