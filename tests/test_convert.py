"""numscope.convert on real tiny models: identity under fp32, autocast-like under bf16, fp8 trains."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import BertForMaskedLM, GPT2LMHeadModel

import numscope
from numscope.convert import (
    _Quantizer,
    _quantizer,
    _rounds_to_max,
    cast_operand,
    convert,
    converted_plan,
    load_numerics_state_dict,
    numerics_state_dict,
    site_sizes,
    unconvert,
)
from numscope.formats.cast import native_dtype
from numscope.formats.scaling import DelayedScaler
from numscope.plan import OperandSpec, Plan, PlanError, SiteSpec
from numscope.sites import Site
from tiny_models import tiny_bert, tiny_gpt2

IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def bert(impl: str = "eager", dropout: float = 0.1) -> BertForMaskedLM:
    return tiny_bert(impl=impl, dropout=dropout)


def run(model: nn.Module, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    out = model(input_ids=IDS, labels=IDS)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), grads


def gpt2(impl: str = "eager", dropout: float = 0.1) -> GPT2LMHeadModel:
    return tiny_gpt2(impl=impl, dropout=dropout)


@pytest.mark.parametrize("make", [bert, gpt2])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_fp32_plan_is_bit_identical_and_unconvert_restores(make, impl: str) -> None:
    model = make(impl=impl)
    reference = run(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    convert(model, Plan.uniform("fp32"), example_inputs={"input_ids": IDS})
    converted = run(model)
    assert torch.equal(reference[0], converted[0])
    assert all(torch.equal(reference[1][n], converted[1][n]) for n in reference[1])
    quantized = convert(unconvert(model), Plan.uniform("fp8"))
    assert not torch.equal(run(quantized)[0], reference[0])
    unconvert(model)
    restored = run(model)
    assert torch.equal(restored[0], reference[0])
    assert list(model.state_dict()) == list(state) and not model._forward_pre_hooks


@pytest.mark.parametrize("make", [bert, gpt2])
def test_bf16_plan_is_close_to_autocast(make) -> None:
    model = make(dropout=0.0)
    exact, exact_grads = run(model)
    with torch.autocast("cpu", torch.bfloat16):
        autocast, autocast_grads = run(model)
    convert(model, Plan.uniform("bf16"))
    planned, planned_grads = run(model)
    autocast_error = (autocast.float() - exact).abs().max().item()
    plan_error = (planned - exact).abs().max().item()
    assert 0 < plan_error <= 2 * autocast_error
    assert torch.allclose(planned, autocast.float(), atol=4 * autocast_error)
    largest = max(grad.norm() for grad in exact_grads.values())
    for name, grad in exact_grads.items():
        if grad.norm() < 1e-3 * largest:  # the key bias: softmax is blind to it, its gradient is rounding
            continue
        autocast_relative = ((autocast_grads[name] - grad).norm() / grad.norm()).item()
        plan_relative = ((planned_grads[name] - grad).norm() / grad.norm()).item()
        assert 0 < plan_relative <= 2 * autocast_relative, name


@pytest.mark.parametrize("make", [bert, gpt2])
def test_fp8_plan_changes_outputs_and_trains(make) -> None:
    model = make(dropout=0.0)
    exact = run(model)[0]
    convert(model, Plan.uniform("fp8"), example_inputs={"input_ids": IDS})
    assert not torch.equal(run(model)[0], exact)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    sizes = site_sizes(model)
    first = "bert.encoder.layer.0.attention.self.query" if make is bert else "transformer.h.0.attn.c_attn"
    assert sizes[first][("fprop", "input")] == 2 * 16 * 32
    assert 8 <= converted_plan(model).average_bits(sizes) < 8.5


@pytest.mark.parametrize("accumulate", ["bf16", "fp16"])
def test_a_plans_accumulate_reaches_fprop_dgrad_and_wgrad(accumulate: str) -> None:
    """From a plan file's ``accumulate`` key to every GEMM of a converted layer: outputs and both gradients
    equal the emulated narrow-accumulator products (and differ from fp32 accumulation). 512 rows make the
    wgrad sum long enough for the narrow accumulator to show."""
    from numscope.sites import accumulate_matmul

    torch.manual_seed(0)
    layer = nn.Linear(256, 4, bias=False)
    x = torch.rand(512, 256, requires_grad=True)
    dy = torch.rand(512, 4)
    w = layer.weight.detach()
    plan = Plan.from_dict({"numscope_plan": 1, "default": {"all": "high", "accumulate": accumulate}})
    convert(layer, plan)
    y = layer(x)
    y.backward(dy)
    assert torch.equal(y, accumulate_matmul(x.detach(), w.t(), accumulate))  # fprop
    assert torch.equal(x.grad, accumulate_matmul(dy, w, accumulate))  # dgrad
    assert torch.equal(layer.weight.grad, accumulate_matmul(x.detach().t(), dy, accumulate).t())  # wgrad
    exact_wgrad = dy.double().t() @ x.detach().double()
    fp32_error = ((dy.t() @ x.detach()).double() - exact_wgrad).abs().max()
    assert ((layer.weight.grad.double() - exact_wgrad).abs().max() > 10 * fp32_error).item()


def test_clear_errors() -> None:
    model = bert()
    plan = Plan.uniform("fp8").with_rule("*.attention.selfish.scores", SiteSpec())
    with pytest.raises(PlanError, match="selfish"):
        convert(model, plan, example_inputs={"input_ids": IDS})
    assert not model._forward_pre_hooks
    convert(model, plan)  # matmul sites are not known yet: the first forward checks
    with pytest.raises(PlanError, match="selfish"):
        model(input_ids=IDS)
    unconvert(model)
    convert(model, Plan.uniform("fp8"))
    with pytest.raises(ValueError, match=r"already converted; call numscope\.unconvert"):
        convert(model, Plan.uniform("fp8"))
    unconvert(model)
    with pytest.raises(ValueError, match="not converted"):
        unconvert(model)


def test_delayed_scaling_and_generator_state_round_trip() -> None:
    delayed = OperandSpec("fp8_e4m3", scaling=numscope.Scaling("delayed", history_len=4))
    stochastic = OperandSpec("fp8_e5m2", rounding="stochastic")
    spec = SiteSpec(
        {
            ("fprop", "input"): delayed,
            ("fprop", "weight"): delayed,
            ("dgrad", "grad_output"): stochastic,
            ("wgrad", "grad_output"): stochastic,
        }
    )
    plan = Plan(spec)

    def trained(steps: int, state=None):
        model = bert(dropout=0.0)
        generator = torch.Generator().manual_seed(5)
        convert(model, plan, generator=generator)
        if state is not None:
            model.load_state_dict(state[0])
            load_numerics_state_dict(model, state[1])
        for _ in range(steps):
            run(model)
        return model

    first = trained(2)
    saved = ({k: v.clone() for k, v in first.state_dict().items()}, numerics_state_dict(first))
    key = "bert.encoder.layer.0.attention.self.query/fprop/input"
    assert saved[1]["scalers"][key]["steps"] == 2
    continued = run(first)
    resumed = run(trained(0, saved))
    assert torch.equal(continued[0], resumed[0])
    assert all(torch.equal(continued[1][n], resumed[1][n]) for n in continued[1])
    fresh = run(trained(0))  # the stochastic rounding draws from the generator's first state again
    assert not all(torch.equal(continued[1][n], fresh[1][n]) for n in continued[1])
    with pytest.raises(ValueError, match="different plan"):
        load_numerics_state_dict(convert(bert(), Plan.uniform("fp8")), saved[1])


def _grid_and_ties(fmt: str) -> torch.Tensor:
    """Every finite value of ``fmt``, the midpoints between neighbours and their float32 neighbours."""
    dtype = native_dtype(numscope.get_format(fmt))
    bits = 8 if dtype.itemsize == 1 else 16
    codes = torch.arange(-(2 ** (bits - 1)), 2 ** (bits - 1), dtype=torch.int32)
    codes = codes.to(torch.int8 if bits == 8 else torch.int16)
    grid = codes.view(dtype).double()
    grid = grid[grid.isfinite()].unique()
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    return torch.cat([grid.float(), mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1)])


@pytest.mark.parametrize("library", [True, False], ids=["native-quantizers", "torch-casts"])
@pytest.mark.parametrize("overflow", ["saturate", "propagate"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp16", "bf16", "fp8_e4m3fnuz", "fp8_e5m2fnuz"])
def test_native_cast_path_equals_quantize(monkeypatch, fmt: str, overflow: str, library: bool) -> None:
    """convert's element casts that keep codes (the native quantizers' codes, or torch's own dtype casts
    with them off) against the eager reference."""
    from numscope.formats import native

    torch.manual_seed(0)
    x = torch.randn(4096) * torch.logspace(-20, 20, 4096) ** 0.5
    special = x.clone()
    special[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 7e4])
    ties = _grid_and_ties(fmt)
    big = numscope.get_format(fmt).max
    above_max = torch.linspace(big, _rounds_to_max(numscope.get_format(fmt)), 64)[:-1]  # round down to max
    for scaling in (None, numscope.Scaling("tensor"), numscope.Scaling("delayed", history_len=2)):
        spec = OperandSpec(fmt, scaling=scaling if scaling is not None else "none", overflow=overflow)
        delayed = scaling is not None and scaling.kind == "delayed"
        scaler = DelayedScaler(scaling) if delayed else None  # one per side, each with its own history
        reference = DelayedScaler(scaling) if delayed else scaling
        for values in (x, special, x * 1e-6, ties, torch.cat([ties, ties * 1.5 + big]), above_max):
            monkeypatch.setattr(native, "_enabled", False)
            expected = numscope.quantize(values, fmt, scaling=reference, overflow=overflow)
            monkeypatch.setattr(native, "_enabled", library)
            got, codes, descale = cast_operand(spec, values, -1, delayed=scaler)
            # the codes a site keeps for backward: they unpack to got
            assert (codes is not None) == (overflow == "saturate" or fmt in ("fp16", "bf16", "fp8_e5m2"))
            if codes is not None:
                unpacked = codes.float() if descale is None else codes.float() * descale
                assert torch.equal(unpacked.nan_to_num(1.5), got.nan_to_num(1.5))
            assert torch.equal(got.isnan(), expected.isnan())
            assert torch.equal(got.nan_to_num(1.5), expected.nan_to_num(1.5)), (fmt, overflow, scaling)
            # signs of zeros and infinities; a NaN's sign is no value (IEEE 754 leaves it unspecified for
            # conversions: torch's bfloat16 cast gives a negative NaN, numscope's quantizers keep the input's)
            numbers = ~got.isnan()
            assert torch.equal(torch.signbit(got[numbers]), torch.signbit(expected[numbers]))


@pytest.mark.parametrize(
    ("fmt", "scaling"),
    [("fp8_e4m3", "none"), ("fp8_e5m2", "tensor"), ("bf16", "none"), ("int8", "row"), ("mxfp8_e4m3", None)],
)
def test_a_float64_operand_is_quantized_as_quantize_does(fmt: str, scaling: str | None) -> None:
    """A float64 operand (a model in double precision) is rounded once, to the format's nearest value, as
    numscope.quantize rounds it: not first to float32's nearest (which lands values just off a midpoint of
    the format's grid on the midpoint, and a second rounding then goes to even, the wrong way)."""
    grid = _grid_and_ties("fp8_e4m3" if fmt.startswith(("mx", "int")) else fmt).double()
    grid = grid[(grid > 0) & (grid < 200)]
    nudged = torch.cat([grid * (1 + 2.0**-40), grid * (1 - 2.0**-40), -grid * (1 + 2.0**-40)])
    x = nudged[: nudged.numel() // 32 * 32].reshape(-1, 32)
    spec = OperandSpec(fmt, scaling=scaling)
    got = cast_operand(spec, x, -1).values
    expected = numscope.quantize(x, fmt, scaling=spec.effective_scaling())
    assert got.dtype == torch.float32
    assert torch.equal(got.double(), expected)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp16"])
def test_native_cast_path_with_a_margin_near_float32s_max_equals_quantize(fmt: str) -> None:
    # 2^8 / scale overflows float32 here: E4M3 leaves its fp16 decode for the plain descale
    x = torch.tensor([3.0e38, -1.0e38, 1.0, -2.5e-30, 0.0, 7.0e37])
    scaling = numscope.Scaling("tensor", margin=3)
    spec = OperandSpec(fmt, scaling=scaling, overflow="saturate")
    got = _Quantizer(Plan(SiteSpec.uniform(spec)), None)(Site("s", "s", "linear"), "fprop", "input", x, -1)
    expected = numscope.quantize(x, fmt, scaling=scaling, overflow="saturate")
    assert torch.equal(got, expected) and torch.equal(torch.signbit(got), torch.signbit(expected))


@pytest.mark.parametrize("scaling", ["none", "tensor"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "bf16"])
def test_a_saturating_cast_on_the_device_path_reads_nothing_back(monkeypatch, fmt: str, scaling: str) -> None:
    # each host read of a tensor is a synchronisation on an accelerator: none per quantized operand on the
    # device path (torch's own casts; the native quantizers are CPU code, off here)
    from numscope.formats import native

    monkeypatch.setattr(native, "_enabled", False)
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__"):
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _method=method, _name=name):
            reads.append(_name)
            return _method(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    spec = OperandSpec(fmt, scaling=scaling, overflow="saturate")
    quantizer = _Quantizer(Plan(SiteSpec.uniform(spec)), None)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    quantizer(Site("s", "s", "linear"), "fprop", "input", x, -1)
    assert not reads, reads


def test_weight_grad_and_input_reuse_is_bit_identical() -> None:
    model = bert(dropout=0.0)
    convert(model, Plan.uniform("fp8"))
    quantizer = _quantizer(model)
    cast = quantizer._cast
    keys: list[str] = []

    def counting(key, *args):
        keys.append(key)
        return cast(key, *args)

    quantizer._cast = counting
    reused = run(model)
    assert len(quantizer._kept.weights) == 14  # every Linear site kept its fprop weight for dgrad
    site_count = len(numscope.sites(model))
    assert sum(key.endswith("/fprop/input") for key in keys) == site_count
    assert not any(key.endswith("/wgrad/input") for key in keys)  # fprop's quantized input is kept
    assert not any(key.endswith("/dgrad/weight") for key in keys)  # fprop's weight: Linear's parameter
    # reused, the attention products' activation weight kept in its codes; grad_output shared
    assert len(keys) == 3 * site_count
    quantizer = _Quantizer(Plan.uniform("fp8"), None)
    unconvert(model)
    model = bert(dropout=0.0)
    numscope.sites.attach(
        model,
        lambda s, g, o, t, a: (
            cast_operand(quantizer.spec(s).operand(g, o), t, a).values
            if not quantizer.spec(s).operand(g, o).is_high
            else t
        ),
        name="plain",
    )
    plain = run(model)
    assert torch.equal(reused[0], plain[0])
    assert all(torch.equal(reused[1][n], plain[1][n]) for n in plain[1])


@pytest.mark.parametrize(
    "spec",
    [
        OperandSpec("fp8_e4m3", scaling="tensor"),
        OperandSpec("fp8_e4m3", scaling=numscope.Scaling("delayed")),
        OperandSpec("int8", scaling="row"),
        OperandSpec("mxfp8_e4m3"),
        OperandSpec("nvfp4"),
    ],
    ids=lambda spec: f"{spec.format}-{spec.effective_scaling().kind if spec.effective_scaling() else 'none'}",
)
def test_a_site_with_no_rows_trains(spec: OperandSpec) -> None:
    """A head over masked positions only, on a batch without a masked token: every GEMM operand of the site
    but the weight is empty (dgrad's and wgrad's too) and their delayed scalers record nothing."""
    torch.manual_seed(0)
    head = nn.Linear(32, 16)
    convert(head, Plan(SiteSpec.uniform(spec)))
    hidden = torch.randn(4, 32, requires_grad=True)
    out = head(hidden[torch.zeros(4, dtype=torch.bool)])
    out.sum().backward()
    assert out.shape == (0, 16) and not hidden.grad.any() and not head.weight.grad.any()
    for key, scaler in _quantizer(head).scalers.items():
        assert scaler.steps == (1 if key.endswith("weight") else 0), key


def test_block_format_plans_compile_their_quantizers_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from numscope.formats import fast, native

    monkeypatch.delenv("NUMSCOPE_FAST", raising=False)
    monkeypatch.setattr(fast, "_enabled", False)  # the process-wide switch off: "auto" decides alone
    monkeypatch.setattr(native, "_enabled", False)  # else the native quantizers take MX before torch.compile
    results = []
    for compiled in ("auto", False):
        torch.manual_seed(0)
        layer = nn.Linear(64, 32)
        convert(layer, Plan.uniform("mxfp8"), compiled=compiled)
        assert _quantizer(layer).compiled is (compiled == "auto")
        out = layer(torch.randn(8, 64, generator=torch.Generator().manual_seed(1)))
        out.sum().backward()
        results.append((out.detach(), layer.weight.grad))
    assert any(name == "block" for name, _ in fast.compiled_configurations())
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert _quantizer(convert(nn.Linear(4, 4), Plan.uniform("fp8"))).compiled is False  # element casts
    monkeypatch.setenv("NUMSCOPE_FAST", "1")
    assert _quantizer(convert(nn.Linear(4, 4), Plan.uniform("fp8"))).compiled is None  # the variable decides
    with pytest.raises(ValueError, match="compiled must be 'auto', True or False, got 'yes'"):
        convert(nn.Linear(4, 4), Plan.uniform("mxfp8"), compiled="yes")


@pytest.mark.parametrize(
    "preset,dtype", [("fp8", torch.float8_e4m3fn), ("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
def test_a_quantized_input_is_kept_for_wgrad_in_its_own_codes(preset, dtype, monkeypatch) -> None:
    def step(pack: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        if not pack:
            monkeypatch.setattr(_Quantizer, "pack", lambda self, site, tensor: None)
        torch.manual_seed(0)
        layer = nn.Linear(32, 16)
        convert(layer, Plan.uniform(preset))
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
            out = layer(x)
        out.backward(torch.randn(64, 16, generator=torch.Generator().manual_seed(2)))
        return [t for t in saved if t.shape == x.shape], layer.weight.grad

    packed, grad = step(True)
    plain, plain_grad = step(False)
    assert [t.dtype for t in packed] == [dtype]  # the input kept in the format's codes, 1 or 2 bytes
    assert [t.dtype for t in plain] == [torch.float32]
    assert torch.equal(grad, plain_grad)  # unpacked bit for bit


def _two_linears_step(
    preset: str, early: bool, monkeypatch, **options
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """One step of Linear-GELU-Linear under ``preset`` (``convert`` options): the tensors saved for backward
    and both weight gradients; ``early=False`` quantizes wgrad's input in backward instead of forward."""
    with monkeypatch.context() as patch:
        if not early:
            patch.setattr(_Quantizer, "prequantizes_wgrad_input", lambda self, site: False)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 32))
        convert(model, Plan.uniform(preset), **options)
        x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
            out = model(x)
        out.square().sum().backward()
    return saved, model[0].weight.grad, model[2].weight.grad


@pytest.mark.parametrize("preset", ["mxfp8", "mxfp4", "nvfp4"])
def test_a_block_format_input_is_quantized_for_wgrad_in_forward_and_kept_in_codes(
    preset, monkeypatch
) -> None:
    def step(early: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        return _two_linears_step(preset, early, monkeypatch, compiled=False, low_memory=True)

    saved, first, second = step(True)
    plain_saved, plain_first, plain_second = step(False)
    assert torch.equal(first, plain_first) and torch.equal(second, plain_second)  # the same bits
    gelu_out = [t for t in plain_saved if t.shape == (4, 16, 48) and t.dtype == torch.float32]
    assert len(gelu_out) == 2  # GELU's input and the second Linear's raw input, float32
    codes = [t for t in saved if t.dtype == torch.uint8 and t.numel() == 64 * 64]
    assert codes and len([t for t in saved if t.shape == (4, 16, 48)]) == 1  # only GELU's own input


@pytest.mark.parametrize("preset", ["mxfp8", "mxfp4"])
def test_compiled_mx_quantizers_keep_the_quantized_wgrad_input(preset, monkeypatch) -> None:
    """An MX plan's compiled quantizers (the device path) quantize wgrad's input in forward and keep its
    float32 values instead of the raw input: the same gradients as quantizing it in backward (and as the
    eager reference)."""

    from numscope.formats import native

    monkeypatch.setattr(native, "_enabled", False)  # the torch.compile path (the native one keeps codes)

    def step(early: bool, compiled: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        return _two_linears_step(preset, early, monkeypatch, compiled=compiled)

    saved, first, second = step(True, True)
    _, late_first, late_second = step(False, True)
    _, eager_first, eager_second = step(True, False)  # eager: nothing prequantized, the reference
    assert torch.equal(first, late_first) and torch.equal(second, late_second)
    assert torch.equal(first, eager_first) and torch.equal(second, eager_second)
    inputs = {(64, 64), (64, 48)}  # both Linears' inputs, tokens first
    kept = [t for t in saved if t.dtype == torch.float32 and tuple(t.shape) in inputs]
    assert [tuple(t.shape) for t in kept] == [(64, 64), (64, 48)]
    assert not [t for t in saved if t.dtype == torch.float32 and t.shape == (4, 16, 64)]  # no raw input


@pytest.mark.parametrize("preset", ["mxfp8", "mxfp4", "nvfp4"])
def test_native_block_codes_keep_the_wgrad_input(preset, monkeypatch) -> None:
    """With the native quantizers (the default) an MX or NVFP4 plan keeps wgrad's input as element codes
    and scale codes (one byte, and one per block), and gives the gradients of quantizing it in backward and
    of the eager reference, bit for bit."""
    from numscope.formats import native

    saved, first, second = _two_linears_step(preset, True, monkeypatch, compiled=False)
    _, late_first, late_second = _two_linears_step(preset, False, monkeypatch, compiled=False)
    monkeypatch.setattr(native, "_enabled", False)
    _, eager_first, eager_second = _two_linears_step(preset, True, monkeypatch, compiled=False)
    assert torch.equal(first, late_first) and torch.equal(second, late_second)
    assert torch.equal(first, eager_first) and torch.equal(second, eager_second)
    codes = [tuple(t.shape) for t in saved if t.dtype == torch.uint8]
    blocks = (
        64 // numscope.get_format(Plan.uniform(preset).default.operand("wgrad", "input").format).block_size
    )
    assert codes == [(64, 64), (blocks, 64), (64, 48), (blocks, 48)]  # each Linear's element and scale codes
    assert not [t for t in saved if t.dtype == torch.float32 and t.shape == (4, 16, 64)]  # no raw input


def test_a_value_below_bfloat16s_grid_is_kept_exactly(monkeypatch) -> None:
    """An MX value bfloat16 cannot hold (a tiny block's subnormal element) is kept as it is: the compiled
    path keeps the quantized input in float32, bit for bit what quantizing it in backward gives."""
    from numscope.formats import native

    monkeypatch.setattr(native, "_enabled", False)
    layer = nn.Linear(32, 8)
    convert(layer, Plan.uniform("mxfp8"), compiled=True)
    x = torch.ones(4, 32)
    # the first feature's block along the tokens: amax 2^-117 gives the E8M0 scale 2^(-117 - 8) = 2^-125, and
    # 2^-134 is E4M3's smallest subnormal (2^-9) times that: an MX value below bfloat16's grid (2^-133)
    x[:, 0] = torch.tensor([2.0**-117, 2.0**-134, 0.0, 0.0])
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        out = layer(x.requires_grad_())
    out.sum().backward()
    assert not [t for t in saved if t.dtype == torch.bfloat16]
    kept = [t for t in saved if t.dtype == torch.float32 and t.shape == (4, 32)]
    expected = numscope.quantize(x.detach(), "mxfp8", scaling=numscope.Scaling("block", axis=0))
    assert kept and torch.equal(kept[0].view(torch.int32), expected.view(torch.int32))
    assert kept[0][1, 0] == 2.0**-134


@pytest.mark.parametrize("library", [False, True], ids=["compiled-float32", "native-codes"])
def test_an_input_of_several_sites_is_prequantized_once(monkeypatch, library: bool) -> None:
    """Q, K and V's projections take one input: its copy for wgrad (the compiled path's float32 values, or
    the native quantizers' codes) is made and kept once."""
    from numscope.formats import native

    monkeypatch.setattr(native, "_enabled", library)

    class QKV(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(64, 32), nn.Linear(64, 32), nn.Linear(64, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(x) * self.k(x) + self.v(x)

    model = QKV()
    convert(model, Plan.uniform("mxfp8"), compiled=True)
    x = torch.randn(2, 24, 64, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        out = model(x)
    out.sum().backward()
    kept = {
        t.untyped_storage().data_ptr()
        for t in saved
        if (t.dtype == torch.uint8 if library else (t.dtype == torch.float32 and t.shape == (48, 64)))
    }
    assert len(kept) == (2 if library else 1)  # the element codes and the scale codes, or the float32 copy


@pytest.mark.parametrize("preset", ["mxfp8", "mxfp4"])
def test_both_block_directions_of_a_gradient_in_one_pass_give_the_same_training(preset, monkeypatch) -> None:
    """dgrad and wgrad take each gradient in an MX format along different axes; announced, the quantizer
    makes both copies in one pass (native.block_both). Outputs and every gradient equal those of two
    separate quantizations, bit for bit, and the one pass is taken at every Linear site."""
    from numscope.formats import native
    from numscope.sites.gemm import _Call

    passes: list[bool] = []
    block_both = native.block_both

    def counted(x, fmt, tensor_amax=None):
        result = block_both(x, fmt, tensor_amax)
        passes.append(result is not None)
        return result

    monkeypatch.setattr(native, "block_both", counted)
    model = bert(dropout=0.0)
    convert(model, Plan.uniform(preset))
    fused = run(model)
    # every Linear whose gradient rows are whole blocks (the tiny vocabulary's decoder is not: 2 passes)
    linear_sites = sum(isinstance(m, nn.Linear) and m.out_features % 32 == 0 for m in model.modules())
    assert linear_sites >= 10 and len(passes) == linear_sites and all(passes)

    monkeypatch.setattr(_Call, "announce_gradient", lambda self, tensor: None)
    model = bert(dropout=0.0)
    convert(model, Plan.uniform(preset))
    separate = run(model)
    assert len(passes) == linear_sites  # nothing announced: no single pass
    assert torch.equal(fused[0], separate[0])
    assert all(torch.equal(fused[1][n], separate[1][n]) for n in separate[1])


def test_convert_takes_a_plan_by_the_name_or_file_plan_takes(tmp_path) -> None:
    inputs = {"input_ids": torch.randint(5, 96, (2, 16))}
    by_name, by_plan = bert(dropout=0.0), bert(dropout=0.0)
    by_plan.load_state_dict(by_name.state_dict())
    numscope.convert(by_name, "fp8")
    numscope.convert(by_plan, Plan.named("fp8"))
    assert converted_plan(by_name) == Plan.named("fp8")
    assert torch.equal(by_name(**inputs).logits, by_plan(**inputs).logits)
    Plan.named("mxfp4").save(tmp_path / "plan.yaml")
    assert converted_plan(numscope.convert(bert(), tmp_path / "plan.yaml")) == Plan.named("mxfp4")
    with pytest.raises(PlanError, match=r"te_nvfp4.*keeps high by their place.*example_inputs="):
        numscope.convert(bert(), "te_nvfp4")
    placed = numscope.convert(bert(), "te_nvfp4", example_inputs=inputs)
    head = converted_plan(placed).for_site("cls.predictions.decoder")
    assert {spec.format for spec in head.operands.values()} == {"bf16"}  # the last layers stay in BF16
    with pytest.raises(PlanError, match="unknown preset or recipe 'fp9'"):
        numscope.convert(bert(), "fp9")
    with pytest.raises(TypeError, match="a preset or recipe name, or a YAML path; got int"):
        numscope.convert(bert(), 8)


def test_cast_operand_asks_for_the_state_it_needs() -> None:
    """The stateless cast takes a delayed scaler and a fresh transform's signs as arguments and says so when
    one is missing, rather than making up a history or a draw of its own."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    delayed = OperandSpec("fp8_e4m3", scaling=numscope.Scaling("delayed"))
    with pytest.raises(ValueError, match="DelayedScaler"):
        cast_operand(delayed, x, -1)
    scaler, reference = DelayedScaler(delayed.effective_scaling()), DelayedScaler(delayed.effective_scaling())
    assert torch.equal(
        cast_operand(delayed, x, -1, delayed=scaler).values,
        numscope.quantize(x, "fp8_e4m3", scaling=reference),
    )
    fresh = OperandSpec("mxfp4_e2m1", transform="rht64:fresh")
    with pytest.raises(ValueError, match="signs"):
        cast_operand(fresh, x.reshape(4, 64), -1)
    signs = fresh.rotation().draw_signs(torch.Generator().manual_seed(1))
    rotated = cast_operand(fresh, x.reshape(4, 64), -1, signs=signs)
    assert rotated.codes is None and rotated.values.shape == (4, 64)  # codes of the rotated values: none
