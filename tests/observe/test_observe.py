"""The observer on a real tiny BERT masked LM and on a large Linear."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn
from transformers import BertForMaskedLM

import numscope
import tiny_models
from numscope.advisor import recommend
from numscope.analysis import Analysis
from numscope.metrics import operand_metrics
from numscope.observe import MIN_ROWS, Observer, observe
from numscope.observe.sampling import draw_rows
from numscope.plan import Plan
from numscope.sites import sites
from numscope.vocab import OPERANDS

CANDIDATES = ("bf16", "fp8_e4m3", "fp8_e5m2", "int8", "mxfp8_e4m3", "nvfp4")
BATCH, SEQ, VOCAB = 4, 16, 100


def tiny_bert(seed: int = 0) -> BertForMaskedLM:
    return tiny_models.tiny_bert(vocab_size=VOCAB, max_position=SEQ, seed=seed)


def batches(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
        masked = torch.rand(BATCH, SEQ, generator=generator) < 0.3
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        out.append({"input_ids": ids, "labels": labels})
    return out


def train(model: nn.Module, data: list[dict[str, torch.Tensor]], observer: Observer | None = None) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    torch.manual_seed(123)  # dropout draws from here: both runs must see the same stream
    for batch in data:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if observer is not None:
            observer.step()


@pytest.fixture(scope="module")
def observed() -> tuple[BertForMaskedLM, BertForMaskedLM, Analysis, list[str]]:
    data = batches(3)
    plain, watched = tiny_bert(), tiny_bert()
    names = [s.name for s in sites(watched, {"input_ids": data[0]["input_ids"]})]
    train(plain, data)
    with observe(watched, CANDIDATES, every=1, generator=torch.Generator().manual_seed(0)) as obs:
        train(watched, data, obs)
    return plain, watched, obs.analysis(), names


def test_every_site_gemm_and_operand_is_recorded(observed):
    _, _, analysis, names = observed
    assert any(name.endswith("attention.self.scores") for name in names)
    expected = {(name, gemm, operand) for name in names for gemm, ops in OPERANDS.items() for operand in ops}
    assert set(analysis.operands) == expected
    assert analysis.steps == [0, 1, 2]
    for key in expected:
        record = analysis.record(key, 1)
        assert set(record.metrics) == set(CANDIDATES)
        assert math.isfinite(record.metrics["fp8_e4m3"]["sqnr_db"])
        assert record.stats["amax"] > 0 and analysis.elements[key] == record.elements
        assert analysis.histograms[key].total == 3 * record.sampled
    for name in names:
        for gemm in OPERANDS:
            pairs = analysis.backward_errors[(name, gemm)]
            for label in CANDIDATES:
                assert {(label, "fp32"), ("fp32", label), (label, label)} <= set(pairs)
            assert ("fp8_e5m2", "fp8_e4m3") in pairs  # the fp8 hybrid's mixed pair, by default
            be = pairs[("fp8_e5m2", "fp32")][0]
            assert 0 < be["mean"] <= be["p99"] <= be["max"] < 1


def test_backward_error_orders_formats_by_precision(observed):
    _, _, analysis, names = observed
    site = next(n for n in names if n.endswith("intermediate.dense"))
    for gemm in OPERANDS:
        mean = {c: analysis.be_values((site, gemm), (c, c))[0] for c in ("bf16", "fp8_e4m3", "fp8_e5m2")}
        assert mean["bf16"] < mean["fp8_e4m3"] < mean["fp8_e5m2"]


def test_observing_changes_nothing(observed):
    plain, watched, _, _ = observed
    for (name, a), (_, b) in zip(plain.named_parameters(), watched.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert numscope.sites.attached(watched) == []  # the with-block detached the observer


def test_every_n_samples_only_those_steps():
    data = batches(3)
    model = tiny_bert()
    with observe(model, ("bf16", "fp8_e4m3"), every=2) as obs:
        train(model, data, obs)
        assert obs.current_step == 3 and not obs.sampling
    analysis = obs.analysis()
    assert analysis.steps == [0, 2]
    assert analysis.meta["every"] == 2


def test_memory_is_bounded_on_a_large_tensor():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(512, 64))
    x = torch.distributions.StudentT(4.0).sample((2048, 512)).requires_grad_()
    limit = 4096
    with observe(layer, ("bf16", "fp8_e4m3", "mxfp8_e4m3", "nvfp4"), max_elements=limit, be_rows=32) as obs:
        layer(x).square().mean().backward()
    analysis = obs.analysis()
    key = next(k for k in analysis.operands if k[1:] == ("fprop", "input"))
    record = analysis.record(key, 0)
    assert record.elements == x.numel() and record.sampled == limit
    assert analysis.histograms[key].total == limit
    # the sampled estimates agree with the metrics of the whole tensor
    full = operand_metrics(x.detach(), "fp8_e4m3", scaling="tensor")
    # 4096 samples of a Student-t(4) tensor: SQNR, a ratio of heavy-tailed sums, is estimated within ~2 dB
    assert record.metrics["fp8_e4m3"]["sqnr_db"] == pytest.approx(full["sqnr_db"], abs=2.0)
    full_mx = operand_metrics(x.detach(), "mxfp8_e4m3", scaling=numscope.Scaling("block", axis=-1))
    assert record.metrics["mxfp8_e4m3"]["sqnr_db"] == pytest.approx(full_mx["sqnr_db"], abs=2.0)
    be = analysis.be_values((key[0], "fprop"), ("fp8_e4m3", "fp32"))[0]
    assert 0 < be < 0.05


def test_monitoring_under_a_plan_sees_high_precision_operands():
    data = batches(2)
    model = tiny_bert()
    plan = Plan.uniform("fp8")
    with observe(model, ("bf16", "fp8_e4m3", "fp8_e5m2")) as obs:
        numscope.convert(model, plan)
        train(model, data, obs)
        numscope.unconvert(model)
    analysis = obs.analysis()
    key = next(k for k in analysis.operands if k[1:] == ("dgrad", "grad_output"))
    assert analysis.plan_formats[key] == "fp8_e5m2"
    record = analysis.record(key, 0)
    assert record.metrics["plan"] == record.metrics["fp8_e5m2"]
    assert math.isfinite(record.metrics["plan"]["sqnr_db"])  # the tensor seen was not already quantized


def _same_numbers(a: dict, b: dict) -> bool:
    """Equal nested dicts of floats, NaN equal to NaN (a metric undefined on a tensor is stored as NaN)."""
    if a.keys() != b.keys():
        return False
    return all(
        _same_numbers(a[k], b[k])
        if isinstance(a[k], dict)
        else (a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]))
        for k in a
    )


PLAN_SCALINGS = [
    numscope.Scaling("row"),
    numscope.Scaling("column"),
    numscope.Scaling("block", block_shape=(1, 16)),
    numscope.Scaling("block", block_shape=(8, 16)),
]


@pytest.mark.parametrize("scaling", PLAN_SCALINGS, ids=["row", "column", "tile 1x16", "tile 8x16"])
def test_plan_row_column_and_tile_scaling_are_measured_as_quantize_scales(scaling) -> None:
    from numscope.plan import OperandSpec, SiteSpec

    torch.manual_seed(0)
    layer = nn.Linear(40, 24, bias=False)
    x = torch.distributions.StudentT(3.0).sample((30, 40)).requires_grad_()
    plan = Plan(SiteSpec.uniform(OperandSpec("int8", scaling=scaling)))
    with observe(nn.Sequential(layer), ("bf16",), plan=plan) as obs:  # every tensor measured whole
        obs.model(x).sum().backward()
    for operand, tensor in (("input", x), ("weight", layer.weight)):
        found = obs.analysis().record(("0", "fprop", operand), 0).metrics["plan"]
        expected = operand_metrics(tensor.detach(), "int8", scaling)
        for name in ("sqnr_db", "rel_error", "cosine", "mse", "underflow%"):
            assert found[name] == pytest.approx(expected[name], rel=1e-12), name
        assert found["overflow%"] == 0.0  # per-row/column/tile scaling maps each amax onto the max


@pytest.mark.parametrize("scaling", PLAN_SCALINGS, ids=["row", "column", "tile 1x16", "tile 8x16"])
def test_plan_scaling_of_a_large_tensor_is_measured_on_the_sample(scaling) -> None:
    from numscope.plan import OperandSpec, SiteSpec

    torch.manual_seed(0)
    layer = nn.Linear(300, 64, bias=False)
    x = torch.randn(512, 300).requires_grad_()
    plan = Plan(SiteSpec.uniform(OperandSpec("int8", scaling=scaling)))
    limit = 4096
    with observe(nn.Sequential(layer), ("bf16", "mxfp8_e4m3"), plan=plan, max_elements=limit) as obs:
        obs.model(x).sum().backward()
    record = obs.analysis().record(("0", "fprop", "input"), 0)
    assert record.sampled == record.sample_size("plan") == limit < x.numel()
    # block formats: rows of the contraction axis (max_elements // K of them), weighed as such in merges
    assert record.sample_size("mxfp8_e4m3") == (limit // 300) * 300
    whole = operand_metrics(x.detach(), "int8", scaling)
    assert record.metrics["plan"]["sqnr_db"] == pytest.approx(whole["sqnr_db"], abs=0.5)


def test_observed_analysis_round_trips_and_recommends_a_convertible_plan(observed, tmp_path):
    _, watched, analysis, names = observed
    analysis.save(tmp_path / "analysis")
    again = Analysis.load(tmp_path / "analysis")
    assert _same_numbers(again.flat(), analysis.flat())
    plan = recommend(again)
    assert {rule.pattern for rule in plan.rules} == set(names)
    model = copy.deepcopy(watched)
    numscope.convert(model, plan)
    batch = batches(1)[0]
    assert torch.isfinite(model(**batch).loss)
    numscope.unconvert(model)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown format 'fp8_e4m4'"):
        observe(nn.Linear(2, 2), ("fp8_e4m4",))
    with pytest.raises(ValueError, match=r"pair \('fp8_e5m2', 'int8'\): 'int8' is not a candidate"):
        observe(nn.Linear(2, 2), ("fp8_e5m2", "fp8_e4m3"), pairs=[("fp8_e5m2", "int8")])
    with pytest.raises(ValueError, match="a pair is two candidate formats"):
        observe(nn.Linear(2, 2), ("fp8_e5m2",), pairs=["fp8_e5m2"])
    with pytest.raises(ValueError, match="every must be a positive int, got 0"):
        observe(nn.Linear(2, 2), every=0)


@pytest.mark.parametrize(
    "pair",
    [
        ("fp8_e4m3", "fp32"),
        ("fp32", "fp8_e5m2"),
        ("mxfp8_e4m3", "mxfp8_e4m3"),
        ("fp8_e5m2", "fp8_e4m3"),  # the default mixed pair (the fp8 hybrid's)
        ("mxfp8_e4m3", "fp8_e5m2"),  # one asked for
    ],
)
def test_backward_error_equals_the_float64_reference_when_every_row_is_measured(pair):
    torch.manual_seed(0)
    layer = nn.Linear(48, 24, bias=False)
    x = torch.distributions.StudentT(3.0).sample((40, 48)).requires_grad_()  # dgrad runs
    model = nn.Sequential(layer)
    pairs = None if pair != ("mxfp8_e4m3", "fp8_e5m2") else [pair]
    with observe(model, ("fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3"), be_rows=64, pairs=pairs) as obs:
        model(x).sum().backward()
    found = obs.analysis().backward_errors[("0", "fprop")][pair][0]
    scaling = {name: None if name == "fp32" else "auto" for name in pair}
    expected = numscope.metrics.backward_error(
        x, layer.weight.detach().T, pair[0], pair[1], scaling_a=scaling[pair[0]], scaling_b=scaling[pair[1]]
    )
    assert expected.count == 40 * 24 and expected.excluded == 0
    assert found["mean"] == pytest.approx(expected.mean, rel=1e-12)
    assert found["p99"] == pytest.approx(expected.p99, rel=1e-12)
    assert found["max"] == expected.max


def test_backward_error_leaves_out_the_entries_of_zero_gradient_rows():
    """A loss on some rows only (a masked-LM head) leaves the other rows of grad_output exactly 0: the dgrad
    entries there have |L|·|R| = 0 and are excluded, as in numscope.metrics.backward_error."""
    torch.manual_seed(0)
    layer = nn.Linear(48, 24, bias=False)
    x = torch.distributions.StudentT(3.0).sample((40, 48)).requires_grad_()  # dgrad runs
    model = nn.Sequential(layer)
    grad_output = torch.zeros(40, 24)
    grad_output[:10] = torch.randn(10, 24)
    with observe(model, ("fp8_e4m3",), be_rows=64) as obs:
        model(x).backward(grad_output)
    found = obs.analysis().backward_errors[("0", "dgrad")][("fp8_e4m3", "fp32")][0]
    expected = numscope.metrics.backward_error(
        grad_output, layer.weight.detach(), "fp8_e4m3", "fp32", scaling_b=None
    )
    assert expected.excluded == 30 * 48 and found["excluded"] == expected.excluded
    assert found["count"] == expected.count == 10 * 48
    assert found["mean"] == pytest.approx(expected.mean, rel=1e-12)
    assert found["max"] == expected.max


def test_a_gemm_called_twice_in_a_step_weighs_each_call_by_its_entries():
    torch.manual_seed(0)
    layer = nn.Linear(32, 16, bias=False)
    first, second = torch.randn(24, 32), torch.distributions.StudentT(2.0).sample((8, 32))

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.layer(a).sum() + self.layer(b).sum()

    with observe(Twice(), ("fp8_e4m3",), be_rows=64) as obs:
        obs.model(first, second).backward()
    found = obs.analysis().backward_errors[("layer", "fprop")][("fp8_e4m3", "fp32")][0]
    weight = layer.weight.detach().T
    parts = [
        numscope.metrics.backward_error(x, weight, "fp8_e4m3", "fp32", scaling_b=None)
        for x in (first, second)
    ]
    assert found["count"] == sum(p.count for p in parts) == 32 * 16
    expected = sum(p.mean * p.count for p in parts) / found["count"]
    assert found["mean"] == pytest.approx(expected, rel=1e-12)
    assert found["max"] == pytest.approx(max(p.max for p in parts), rel=1e-12)


def test_steps_that_are_not_sampled_run_without_interception():
    model = tiny_bert()
    intercepted = []
    model.bert.encoder.layer[0].attention.self.query.register_forward_pre_hook(
        lambda module, args: intercepted.append(torch._C._is_torch_function_mode_enabled())
    )
    with observe(model, ("bf16", "fp8_e4m3"), every=2) as obs:
        train(model, batches(4), obs)
    # discovery (step 0's extra forward) and the sampled steps 0 and 2 run under the site mode; 1 and 3 not
    assert intercepted[-4:] == [True, False, True, False]
    assert obs.analysis().steps == [0, 2]


def test_an_operand_in_two_gemms_is_measured_once_and_recorded_for_both(observed):
    _, _, analysis, names = observed
    site = next(n for n in names if n.endswith("intermediate.dense"))
    for first, second in (
        (("fprop", "weight"), ("dgrad", "weight")),
        (("dgrad", "grad_output"), ("wgrad", "grad_output")),
        (("fprop", "input"), ("wgrad", "input")),
    ):
        a, b = analysis.record((site, *first), 1), analysis.record((site, *second), 1)
        assert a.stats == b.stats and a.metrics["fp8_e4m3"] == b.metrics["fp8_e4m3"]
        assert analysis.histograms[(site, *first)] == analysis.histograms[(site, *second)]
        # block formats run their blocks along each GEMM's own contraction axis: measured apart
        assert a.metrics["mxfp8_e4m3"] != b.metrics["mxfp8_e4m3"]


class _LosesItsMemory(nn.Module):
    """Measures ``a``, moves ``a`` to new memory while it lives (as FSDP2 frees an unsharded parameter's
    storage after forward), then measures ``b``: other values at ``a``'s old address, at ``a``'s version."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 3), nn.Linear(4, 3)
        self.first, self.second = torch.randn(8, 4), 100 * torch.randn(8, 4)
        self.where: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = torch.zeros(8, 4)
        a = torch.empty(0).set_(b.untyped_storage(), 0, b.shape, b.stride())
        a.copy_(self.first)
        self.where.append((a.data_ptr(), a._version))
        y = self.l1(a)
        a.set_(torch.empty(8, 4))  # `a` still lives, elsewhere
        b.copy_(self.second)
        b.mul_(1.0)
        self.where.append((b.data_ptr(), b._version))
        return x + y.sum() + self.l2(b).sum()


def test_a_tensor_that_lost_its_memory_is_not_reused_for_the_one_now_there() -> None:
    model = _LosesItsMemory()
    with observe(model, ("bf16", "fp8_e4m3"), every=1, no_grad_forwards=True) as obs:
        with torch.no_grad():
            model(torch.zeros(()))
        analysis = obs.analysis()
    assert model.where[-2] == model.where[-1]  # the same address and version: a reuse by identity alone
    first, second = (analysis.record((name, "fprop", "input"), 0) for name in ("l1", "l2"))
    assert first.stats["amax"] == float(model.first.abs().max())
    assert second.stats["amax"] == float(model.second.abs().max())


def test_retained_samples_are_bounded_on_a_large_tensor():
    layer = nn.Sequential(nn.Linear(1024, 8))
    x = torch.randn(4096, 1024, requires_grad=True)
    limit = 2048
    with observe(layer, ("bf16", "fp8_e4m3", "mxfp8_e4m3"), max_elements=limit, be_rows=16) as obs:
        layer(x).square().mean().backward()
        kept = [shared.sample.numel() for shared in obs._shared.values()]
        rows = draw_rows(x.detach(), -1, None, limit, 16, obs.generator)
        rows_along_tokens = draw_rows(x.detach(), 0, None, limit, 16, obs.generator)
    assert kept and max(kept) == limit  # element samples: max_elements each, whatever the tensor's size
    # whole rows along the contraction axis: max_elements // K of them, at least MIN_ROWS
    assert rows.values.shape == (1, max(MIN_ROWS, limit // 1024), 1024)
    assert rows_along_tokens.values.shape == (1, max(MIN_ROWS, limit // 4096), 4096)
    assert rows.for_be(rows.values).shape[1] <= 16
    assert obs.analysis().record(("0", "fprop", "input"), 0).elements == x.numel()


@pytest.mark.parametrize("no_grad_forwards", [False, True])
def test_forwards_without_gradients_are_measured_only_when_asked(no_grad_forwards: bool) -> None:
    model = tiny_bert()
    batch = batches(1)[0]
    with observe(model, candidates=("bf16",), every=1, no_grad_forwards=no_grad_forwards) as obs:
        with torch.no_grad():  # an evaluation, no training step
            model(input_ids=batch["input_ids"])
        analysis = obs.analysis()
    query = ("bert.encoder.layer.0.attention.self.query", "fprop", "input")
    assert (query in analysis.elements) == no_grad_forwards
    assert analysis.steps == ([0] if no_grad_forwards else [])


@pytest.mark.parametrize("no_grad_forwards", [False, True])
def test_an_evaluation_on_a_sampled_step_runs_without_interception(no_grad_forwards: bool) -> None:
    model = tiny_bert()
    intercepted = []
    model.bert.encoder.layer[0].attention.self.query.register_forward_pre_hook(
        lambda module, args: intercepted.append(torch._C._is_torch_function_mode_enabled())
    )
    batch = batches(1)[0]
    with observe(model, ("bf16",), every=1, no_grad_forwards=no_grad_forwards) as obs:
        assert obs.sampling
        model(**batch).loss.backward()  # a training forward (the first one also finds the sites)
        with torch.no_grad():  # an evaluation in the same, sampled step
            model(input_ids=batch["input_ids"])
    assert intercepted[-2] is True and intercepted[-1] is no_grad_forwards


def test_state_dict_resumes_observing_as_if_never_interrupted() -> None:
    data = batches(4)
    whole_model = tiny_bert()
    with observe(whole_model, CANDIDATES, every=1, max_elements=256, be_rows=8) as obs:
        train(whole_model, data, obs)
        whole = obs.analysis()

    first = tiny_bert()
    with observe(first, CANDIDATES, every=1, max_elements=256, be_rows=8) as obs:
        optimizer = torch.optim.AdamW(first.parameters(), lr=1e-3)
        torch.manual_seed(123)
        for batch in data[:2]:
            first(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            obs.step()
        state = copy.deepcopy(obs.state_dict())
        weights, moments, dropout = first.state_dict(), optimizer.state_dict(), torch.get_rng_state()
    second = tiny_bert(seed=5)  # a fresh process: other weights until the checkpoint is loaded
    second.load_state_dict(weights)
    with observe(second, CANDIDATES, every=1, max_elements=256, be_rows=8) as obs:
        obs.load_state_dict(state)
        optimizer = torch.optim.AdamW(second.parameters(), lr=1e-3)
        optimizer.load_state_dict(moments)
        torch.set_rng_state(dropout)
        for batch in data[2:]:
            second(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            obs.step()
        resumed = obs.analysis()
    # as JSON text: NaN statistics (of all-zero samples) compare equal there, every float exactly
    assert json.dumps(resumed.to_dict()) == json.dumps(whole.to_dict())
    assert resumed.steps == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="recorded with candidates"):
        observe(tiny_bert(), ("bf16",)).load_state_dict(state)


def test_one_default_candidate_list_for_observe_analyze_and_the_demo() -> None:
    from numscope import workflow
    from numscope.demo.main import DemoConfig
    from numscope.observe import DEFAULT_CANDIDATES, ObserveConfig

    assert ObserveConfig().candidates == DEFAULT_CANDIDATES
    assert workflow.DEFAULT_CANDIDATES == DEFAULT_CANDIDATES == DemoConfig().candidates
