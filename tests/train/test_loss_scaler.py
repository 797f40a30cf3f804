"""LossScaler: GradScaler's state machine, fp16/bf16 gradients, static mode, bounds and diagnostics."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from numscope.train import LossScaler, underflow_report
from tiny_models import tiny_bert

INF, NAN = math.inf, math.nan


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).to(dtype)


def _backward(scaler, model: nn.Module, seed: int, bad_value: float | None = None) -> None:
    """One scaled backward on a fixed batch, optionally writing ``bad_value`` into one gradient."""
    generator = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    inputs = torch.randn(5, 3, generator=generator).to(dtype)
    loss = model(inputs).float().pow(2).mean()
    scaler.scale(loss).backward()
    if bad_value is not None:
        model[2].bias.grad[1] = bad_value


def _train(scaler, pattern: list[float | None]) -> tuple[list[float], nn.Module]:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scales = []
    for step, bad_value in enumerate(pattern):
        optimizer.zero_grad()
        _backward(scaler, model, seed=step, bad_value=bad_value)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, model


PATTERN = [None, None, None, INF, None, None, None, None, None, None, NAN, -INF, None, None, None, None]


@pytest.mark.parametrize(
    ("init_scale", "growth_factor", "backoff_factor"),
    [(2.0**16, 2.0, 0.5), (1000.0, 1.7, 0.3), (2.0**127, 2.0, 0.5)],
    ids=["defaults", "odd-factors", "growth-to-inf-refused"],
)
def test_scale_trajectory_and_params_match_grad_scaler(init_scale, growth_factor, backoff_factor):
    arguments = dict(
        init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=3
    )
    ours, our_model = _train(
        LossScaler(device="cpu", **arguments), PATTERN
    )  # GradScaler's arguments as they are
    theirs, their_model = _train(torch.amp.GradScaler(device="cpu", **arguments), PATTERN)
    assert ours == theirs
    assert len(set(ours)) > 2  # the pattern exercised growth and backoff
    for mine, reference in zip(our_model.parameters(), their_model.parameters(), strict=True):
        assert torch.equal(mine, reference)


def test_skipped_step_leaves_params_and_optimizer_state_unchanged():
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = LossScaler(init_scale=2.0**10)
    _backward(scaler, model, seed=0)
    scaler.step(optimizer)
    scaler.update()
    params_before = copy.deepcopy(list(model.parameters()))
    state_before = copy.deepcopy(optimizer.state_dict())
    optimizer.zero_grad()
    _backward(scaler, model, seed=1, bad_value=INF)
    assert scaler.step(optimizer) is None
    scaler.update()
    for after, before in zip(model.parameters(), params_before, strict=True):
        assert torch.equal(after, before)
    state_after = optimizer.state_dict()
    for key, value in state_before["state"].items():
        for name, tensor in value.items():
            assert torch.equal(state_after["state"][key][name], tensor)
    assert scaler.get_scale() == 2.0**9
    assert scaler.skipped_steps == 1


def test_step_returns_the_optimizer_result():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    optimizer.step = lambda: "stepped"
    scaler = LossScaler()
    _backward(scaler, model, seed=0)
    assert scaler.step(optimizer) == "stepped"


def test_static_mode_keeps_the_scale_and_still_skips():
    scales, _ = _train(LossScaler(init_scale=512.0, growth_interval=1, dynamic=False), PATTERN)
    assert scales == [512.0] * len(PATTERN)
    scaler = LossScaler(init_scale=512.0, dynamic=False)
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _backward(scaler, model, seed=0, bad_value=NAN)
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert not scaler.is_dynamic()


def test_min_and_max_scale_clamp():
    floor = LossScaler(init_scale=2.0**15, min_scale=2.0**14)
    scales, _ = _train(floor, [INF, INF, INF])
    assert scales == [2.0**14] * 3
    ceiling = LossScaler(init_scale=2.0**16, growth_interval=1, max_scale=2.0**17)
    scales, _ = _train(ceiling, [None, None, None])
    assert scales == [2.0**17] * 3


def test_state_dict_round_trip_and_grad_scaler_compatibility():
    arguments = dict(init_scale=2.0**12, growth_interval=3)
    scaler = LossScaler(**arguments)
    _train(scaler, PATTERN[:5])
    state = scaler.state_dict()
    restored = LossScaler()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    continued, _ = _train(scaler, PATTERN[5:])
    resumed, _ = _train(restored, PATTERN[5:])
    assert continued == resumed

    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(state)
    assert theirs.get_scale() == state["scale"]
    ours = LossScaler()
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == state["scale"]
    assert ours.state_dict()["_growth_tracker"] == state["_growth_tracker"]


def test_unscale_before_clipping_matches_an_unscaled_fp32_run():
    reference, scaled = _mlp(), _mlp()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaled_optimizer = torch.optim.SGD(scaled.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=2.0**20)
    for step in range(3):
        _backward(LossScaler(enabled=False), reference, seed=step)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        _backward(scaler, scaled, seed=step)
        scaler.unscale_(scaled_optimizer)
        torch.nn.utils.clip_grad_norm_(scaled.parameters(), max_norm=0.1)
        scaler.step(scaled_optimizer)
        scaler.update()
        scaled_optimizer.zero_grad()
    for mine, expected in zip(scaled.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, expected, rtol=1e-6, atol=1e-7)


def test_gradient_accumulation_over_two_micro_batches():
    reference, scaled = _mlp(), _mlp()
    scaler = LossScaler(init_scale=2.0**14)
    for seed in (0, 1):
        _backward(LossScaler(enabled=False), reference, seed=seed)
        _backward(scaler, scaled, seed=seed)
    optimizer = torch.optim.SGD(scaled.parameters(), lr=0.1)
    scaler.unscale_(optimizer)
    for mine, expected in zip(scaled.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, expected.grad, rtol=1e-6, atol=1e-8)
    scaler.step(optimizer)
    scaler.update()
    assert scaler.skipped_steps == 0


def test_scale_accepts_lists_and_tuples():
    scaler = LossScaler(init_scale=4.0)
    losses = [torch.tensor(1.0), torch.tensor(2.0)]
    assert [value.item() for value in scaler.scale(losses)] == [4.0, 8.0]
    assert isinstance(scaler.scale(tuple(losses)), tuple)
    with pytest.raises(TypeError, match="got int"):
        scaler.scale(3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradients_are_unscaled_in_fp32(dtype):
    model = _mlp(dtype)
    scaler = LossScaler(init_scale=2.0**8)
    _backward(scaler, model, seed=0)
    scaled_grads = [param.grad.clone() for param in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.unscale_(optimizer)
    for param, scaled_grad in zip(model.parameters(), scaled_grads, strict=True):
        assert param.grad.dtype == dtype
        assert torch.equal(param.grad, (scaled_grad.float() / 2.0**8).to(dtype))


def test_fp16_gradient_overflow_is_detected_and_named():
    model = _mlp(torch.float16)
    scaler = LossScaler(init_scale=2.0**24).track(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    inputs = torch.full((5, 3), 30.0, dtype=torch.float16)
    scaler.scale(model(inputs).float().pow(2).mean()).backward()
    scaler.step(optimizer)
    overflow = scaler.last_overflow
    assert overflow is not None and overflow.iteration == 0 and overflow.scale == 2.0**24
    assert "2.weight" in overflow.parameters
    scaler.update()
    assert scaler.get_scale() == 2.0**23
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_overflow_names_the_offending_parameter():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler().track(model)
    _backward(scaler, model, seed=0)
    scaler.step(optimizer)
    scaler.update()
    assert scaler.last_overflow is None
    optimizer.zero_grad()
    _backward(scaler, model, seed=1, bad_value=NAN)
    scaler.step(optimizer)
    assert scaler.last_overflow.parameters == ("2.bias",)
    assert scaler.last_overflow.iteration == 1
    scaler.update()

    untracked = LossScaler()
    optimizer.zero_grad()
    _backward(untracked, model, seed=2, bad_value=INF)
    untracked.step(optimizer)
    assert untracked.last_overflow.parameters == ("param_groups[0][3]",)


def test_found_inf_reduce_is_called_once_per_step_and_can_force_a_skip():
    calls = []

    def another_rank_overflowed(found_inf: torch.Tensor) -> torch.Tensor:
        calls.append(found_inf.clone())
        return torch.ones_like(found_inf)

    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(found_inf_reduce=another_rank_overflowed)
    _backward(scaler, model, seed=0)
    scaler.step(optimizer)
    scaler.update()
    assert len(calls) == 1 and calls[0].shape == (1,) and calls[0].item() == 0.0
    assert scaler.last_overflow.parameters == ()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_sparse_gradients_are_unscaled():
    torch.manual_seed(0)
    embedding = nn.Embedding(5, 3, sparse=True)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=1.0)
    scaler = LossScaler(init_scale=8.0)
    scaler.scale(embedding(torch.tensor([1, 1, 2])).sum()).backward()
    scaler.unscale_(optimizer)
    expected = torch.zeros(5, 3)
    expected[1], expected[2] = 2.0, 1.0
    assert torch.equal(embedding.weight.grad.to_dense(), expected)


def test_disabled_scaler_is_a_pass_through():
    scaler = LossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled() and scaler.state_dict() == {}
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model[2].weight.detach().clone()
    _backward(scaler, model, seed=0)
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(model[2].weight, before)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(growth_factor=0.5), r"growth_factor must be a finite number > 1.0, got 0.5"),
        (dict(growth_factor=1.0), r"growth_factor must be .* got 1.0"),
        (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\), got 1.0"),
        (dict(backoff_factor=0.0), r"backoff_factor must be in \(0, 1\), got 0.0"),
        (dict(init_scale=0.0), r"init_scale must be a number > 0 .* got 0.0"),
        (dict(init_scale=-1.0), r"init_scale .* got -1.0"),
        (dict(init_scale=1e39), r"init_scale .* float32 can hold, got 1e\+39"),
        (dict(growth_interval=0), r"growth_interval must be an int >= 1 \(steps\), got 0"),
        (dict(growth_interval=2.5), r"growth_interval .* got 2.5"),
        (dict(min_scale=4.0, max_scale=2.0, init_scale=3.0), r"min_scale must be <= max_scale"),
        (dict(min_scale=-1.0), r"min_scale must be None or a finite number > 0, got -1.0"),
        (dict(init_scale=1.0, min_scale=2.0), r"init_scale must lie in \[min_scale, max_scale\]"),
        (dict(device="gpu0"), r"device must name a torch device such as 'cpu' or 'cuda', got 'gpu0'"),
        (dict(device=3.5), r"device must name a torch device .* got 3.5"),
    ],
)
def test_bad_arguments_are_named(arguments, message):
    with pytest.raises(ValueError, match=message):
        LossScaler(**arguments)


def test_misordered_calls_raise():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler()
    with pytest.raises(RuntimeError, match="before step"):
        scaler.update()
    _backward(scaler, model, seed=0)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="closure"):
        scaler.step(optimizer, closure=lambda: None)
    scaler.update()
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(0.9)
    with pytest.raises(ValueError, match=r"new_scale must be a finite number > 0, got -2.0"):
        scaler.update(new_scale=-2.0)


def test_update_with_new_scale_sets_it():
    scaler = LossScaler()
    scaler.update(new_scale=torch.tensor(128.0))
    assert scaler.get_scale() == 128.0


def test_underflow_report_before_and_after_scaling():
    gradient = torch.tensor([1e-8, 1.0, 0.0, 1e-8, 2e-3])
    (row,) = underflow_report({"tiny": gradient}, scale=2.0**16, working_dtype=torch.float16)
    assert row.parameter == "tiny" and row.numel == 5 and row.nonzero == 4
    assert row.underflow_percent_unscaled == 50.0  # 1e-8 < 2**-24 flushes to zero in fp16
    assert row.underflow_percent_scaled == 0.0  # 1e-8 * 2**16 ≈ 6.6e-4 is representable
    assert row.overflow_percent_scaled == 25.0  # 1.0 * 2**16 exceeds 65504; 2e-3 * 2**16 does not
    assert row.min_abs_nonzero == pytest.approx(1e-8) and row.max_abs == 1.0
    assert row.as_dict()["underflow% unscaled"] == 50.0

    (bf16_row,) = underflow_report([("tiny", gradient)], scale=1.0, working_dtype=torch.bfloat16)
    assert bf16_row.underflow_percent_unscaled == 0.0  # bf16 has fp32's exponent range


def test_underflow_report_reads_a_models_gradients():
    model = _mlp()
    _backward(LossScaler(enabled=False), model, seed=0)
    model[0].bias.grad = None
    rows = underflow_report(model, scale=1024.0, working_dtype=torch.float16)
    assert [row.parameter for row in rows] == ["0.weight", "2.weight", "2.bias"]
    with pytest.raises(ValueError, match=r"working_dtype must be a floating torch.dtype"):
        underflow_report(model, scale=1.0, working_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"scale must be a finite number > 0, got 0.0"):
        underflow_report(model, scale=0.0, working_dtype=torch.float16)


def test_two_optimizers_skip_independently_and_back_off_once():
    model = _mlp()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    first_before, second_before = model[0].weight.detach().clone(), model[2].weight.detach().clone()
    scaler = LossScaler(init_scale=2.0**10).track(model)
    _backward(scaler, model, seed=0, bad_value=INF)
    scaler.step(first)
    scaler.step(second)
    scaler.update()
    assert not torch.equal(model[0].weight, first_before)
    assert torch.equal(model[2].weight, second_before)
    assert scaler.get_scale() == 2.0**9
    assert scaler.last_overflow.parameters == ("2.bias",)


def test_underflow_per_layer_of_a_tiny_bert_before_and_after_scaling():
    model = tiny_bert(max_position=512, impl=None)
    ids = torch.randint(5, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    (model(input_ids=ids, labels=ids).loss * 2.0**-20).backward()  # gradients as small as late in training
    rows = {row.parameter: row for row in underflow_report(model, scale=2.0**20, working_dtype=torch.float16)}
    assert len(rows) == sum(1 for p in model.parameters() if p.grad is not None)
    unscaled = {name: row.underflow_percent_unscaled for name, row in rows.items()}
    assert max(unscaled.values()) > 10.0 and min(unscaled.values()) < max(unscaled.values())  # per layer
    for name, row in rows.items():
        assert row.underflow_percent_scaled <= row.underflow_percent_unscaled, name
        assert row.overflow_percent_scaled == 0.0, name
    assert sum(row.underflow_percent_scaled for row in rows.values()) < 0.1 * sum(unscaled.values())
