"""numscope.Recipe: every switch off trains bit for bit as plain PyTorch, each switch on does its part,
and a run resumed from a checkpoint equals the uninterrupted one."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import BertForMaskedLM

import numscope
from numscope.convert import _quantizer, converted_plan
from numscope.train import (
    LossScaler,
    Recipe,
    allocator,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from tiny_models import tiny_bert

IDS = torch.randint(5, 100, (4, 16), generator=torch.Generator().manual_seed(0))
OFF = dict(dtype=torch.float32, fp32_ops=False, activations=None, loss_scale=None)


def bert(dropout: float = 0.1) -> BertForMaskedLM:
    return tiny_bert(dropout=dropout)


def train(model: nn.Module, recipe: Recipe | None, steps: int, lr: float = 1e-2) -> list[float]:
    params = recipe.parameters() if recipe is not None else list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=IDS, labels=IDS).loss
        if recipe is None:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            recipe.backward(loss)
            recipe.step(optimizer)
        losses.append(loss.item())
    return losses


def test_every_switch_off_is_plain_training_bit_for_bit() -> None:
    plain, wrapped = bert(), bert()
    expected = train(plain, None, 3)
    recipe = Recipe(wrapped, **OFF)
    assert train(wrapped, recipe, 3) == expected
    for (name, mine), theirs in zip(wrapped.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    assert repr(recipe) == (
        "Recipe(plan=none, dtype=float32, fp32_ops=off, activations=as computed, loss_scale=off)"
    )


def test_plan_switch_converts_the_gemms() -> None:
    baseline = train(bert(), None, 1)
    model = bert()
    recipe = Recipe(model, **{**OFF, "plan": "fp8"})
    assert converted_plan(model) == numscope.Plan.uniform("fp8")
    losses = train(model, recipe, 4)
    assert losses[0] != baseline[0] and losses[-1] < losses[0] - 0.5  # changed, and it trains


def test_dtype_switch_keeps_fp32_masters_behind_a_low_precision_model() -> None:
    model = bert(dropout=0.0)
    recipe = Recipe(model, **{**OFF, "dtype": torch.bfloat16})
    assert model.bert.encoder.layer[0].attention.self.query.weight.dtype == torch.bfloat16
    assert model.bert.embeddings.LayerNorm.weight.dtype == torch.float32  # normalisation kept in fp32
    assert {p.dtype for p in recipe.parameters()} == {torch.float32}
    assert model(input_ids=IDS).logits.dtype == torch.float32
    train(model, recipe, 2)
    for name, master in recipe.master.named_master_params():
        param = model.get_parameter(name)
        assert torch.equal(param, master.to(param.dtype)), name  # the model is the rounded master


class HandWrittenNorm(nn.Module):
    """A T5/LLaMA-style RMS norm written without casts, between two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(8, 64), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(h * (h.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt())


def test_fp32_ops_switch_keeps_a_norm_alive_where_fp16_overflows() -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)) * 1000  # h ~ 500: h² > 65504
    reference = HandWrittenNorm()(x)
    outputs = {}
    for fp32_ops in (False, True):
        model = HandWrittenNorm()
        Recipe(model, **{**OFF, "dtype": torch.float16, "fp32_ops": fp32_ops})
        outputs[fp32_ops] = model(x)
    collapsed = model.down.bias.float().expand(16, 4)  # the normalised activations flushed to zero
    assert torch.allclose(outputs[False], collapsed, atol=1e-3)
    assert (outputs[True] - reference).abs().max() < 0.02 < (outputs[False] - reference).abs().max()


def test_activations_switch_stores_what_autograd_saves_in_fp16() -> None:
    grads, stores = {}, {}
    for activations in (None, "fp16"):
        model = bert(dropout=0.0)
        recipe = Recipe(model, **{**OFF, "activations": activations})
        model(input_ids=IDS, labels=IDS).loss.backward()
        grads[activations] = model.bert.encoder.layer[0].intermediate.dense.weight.grad
        stores[activations] = recipe.activations
    assert stores[None] is None
    assert stores["fp16"].stored_tensors > 20 and stores["fp16"].stored_bytes > 0
    difference = (grads["fp16"] - grads[None]).abs().max() / grads[None].abs().max()
    assert 0 < difference < 1e-2  # backward computed from fp16-rounded activations


def test_loss_scale_switch_rescues_gradients_that_fp16_flushes() -> None:
    zero_fraction = {}
    for loss_scale in (None, "dynamic"):
        model = bert(dropout=0.0)
        recipe = Recipe(model, **{**OFF, "dtype": torch.float16, "loss_scale": loss_scale})
        loss = model(input_ids=IDS, labels=IDS).loss * 2.0**-14  # a loss whose gradients are tiny
        recipe.backward(loss)
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        zero_fraction[loss_scale] = (grads == 0).float().mean().item()
    assert zero_fraction["dynamic"] < 0.5 * zero_fraction[None]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(
        ValueError, match=r"dtype must be torch.float16, torch.bfloat16 or torch.float32, got torch.int8"
    ):
        Recipe(bert(), dtype=torch.int8)
    with pytest.raises(ValueError, match=r"loss_scale must be 'dynamic', a number .* got 'auto'"):
        Recipe(bert(), loss_scale="auto")
    with pytest.raises(TypeError, match=r"numscope\.Plan, a preset or recipe name, or None, got dict"):
        Recipe(bert(), plan={"fp8": True})
    with pytest.raises(ValueError, match="unknown preset or recipe 'fp9'"):
        Recipe(bert(), plan="fp9")
    with pytest.raises(ValueError, match=r"activations must be .working., fp16, bf16, fp32 .* got .fp8."):
        Recipe(bert(), activations="fp8")
    recipe = Recipe(bert(), **OFF)
    with pytest.raises(ValueError, match=r"recipe state lacks \['numerics'\]"):
        recipe.load_state_dict({"master": {}, "scaler": {}})


# ---------------------------------------------------------------------- bit-exact resume
def _full_recipe() -> tuple[BertForMaskedLM, Recipe, torch.optim.Optimizer]:
    """Every part on: fp16 model with fp32 masters, fp32 ops, fp16 activations, dynamic loss scaling, and
    a plan with delayed scaling (amax histories) and stochastic rounding (a generator), dropout on."""
    delayed = numscope.OperandSpec("fp8_e4m3", scaling=numscope.Scaling("delayed", history_len=4))
    stochastic = numscope.OperandSpec("fp8_e5m2", rounding="stochastic")
    spec = numscope.SiteSpec(
        {
            ("fprop", "input"): delayed,
            ("fprop", "weight"): delayed,
            ("dgrad", "grad_output"): stochastic,
            ("wgrad", "grad_output"): stochastic,
        }
    )
    model = bert(dropout=0.1)
    scaler = LossScaler(init_scale=2.0**20, growth_interval=2)  # too large at first: a skipped step
    recipe = Recipe(
        model, plan=numscope.Plan(spec), generator=torch.Generator().manual_seed(5), loss_scale=scaler
    )
    return model, recipe, torch.optim.AdamW(recipe.parameters(), lr=1e-2)


def _step(model: BertForMaskedLM, recipe: Recipe, optimizer: torch.optim.Optimizer) -> None:
    recipe.backward(model(input_ids=IDS, labels=IDS).loss)
    recipe.step(optimizer)


def test_resume_through_a_checkpoint_is_bit_exact(tmp_path) -> None:
    total, saved_at = 5, 2
    torch.manual_seed(11)
    model, recipe, optimizer = _full_recipe()
    for step in range(total):
        if step == saved_at:
            state = {"recipe": recipe.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state()}
            save_checkpoint(tmp_path / "run.pt", state)
        _step(model, recipe, optimizer)

    torch.manual_seed(999)  # the resumed process starts from unrelated random state
    resumed_model, resumed, resumed_optimizer = _full_recipe()
    state = load_checkpoint(tmp_path / "run.pt")
    resumed.load_state_dict(state["recipe"])
    resumed_optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    for _ in range(saved_at, total):
        _step(resumed_model, resumed, resumed_optimizer)

    assert recipe.scaler.skipped_steps >= 1  # the scaler's backoff is part of what was resumed
    assert resumed.scaler.state_dict() == recipe.scaler.state_dict()
    numerics, resumed_numerics = recipe.state_dict()["numerics"], resumed.state_dict()["numerics"]
    assert torch.equal(torch.as_tensor(numerics["generator"]), torch.as_tensor(resumed_numerics["generator"]))
    for key, scaler_state in numerics["scalers"].items():
        assert torch.equal(scaler_state["amax_history"], resumed_numerics["scalers"][key]["amax_history"]), (
            key
        )
    for (name, mine), theirs in zip(
        resumed.master.named_master_params(), recipe.master.master_params(), strict=True
    ):
        assert torch.equal(mine, theirs), name


def test_a_forward_interrupted_by_ctrl_c_leaves_no_context_behind() -> None:
    """torch skips always_call hooks on KeyboardInterrupt: the fp32-ops mode, the saved-tensor hooks and the
    sites' mode of the aborted forward must pass through until the next forward takes them off."""
    from torch.overrides import _get_current_function_mode_stack

    model = bert(dropout=0.0)
    recipe = Recipe(model, plan="fp8")
    model(input_ids=IDS, labels=IDS).loss.backward()

    def interrupt(module, args):
        raise KeyboardInterrupt

    hook = model.bert.encoder.layer[0].attention.self.value.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(input_ids=IDS, labels=IDS)
    hook.remove()
    stored = recipe.activations.stored_tensors
    assert torch.ones(3, dtype=torch.float16).exp().dtype == torch.float16  # no fp32 op outside the model
    leaf = torch.ones(3, requires_grad=True)
    (leaf * 2).exp().sum().backward()  # saves float32 tensors: none is packed into fp16
    assert recipe.activations.stored_tensors == stored
    model(input_ids=IDS, labels=IDS).loss.backward()  # the next forward runs as usual and cleans up
    assert _get_current_function_mode_stack() == []
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert torch.ones(3, dtype=torch.float16).exp().dtype == torch.float16


def test_fp32_ops_leave_sites_their_parameters_names_and_plan_rules() -> None:
    """Under fp32_ops the sites see the parameters themselves, not fp32 copies: every Linear keeps its site
    name and kind, a plan rule by module name applies, and the weight quantized for fprop serves dgrad."""
    expected = {site.name for site in numscope.sites(bert(dropout=0.0), {"input_ids": IDS})}
    int4 = numscope.SiteSpec.uniform(numscope.OperandSpec("int4", scaling="tensor"))
    model = bert(dropout=0.0)
    recipe = Recipe(model, plan=numscope.Plan(rules=(numscope.Rule("*.query", int4),)), dtype=torch.float16)
    quantizer = _quantizer(model)
    cast, keys = quantizer._cast, []
    quantizer._cast = lambda key, *args: keys.append(key) or cast(key, *args)
    seen: dict[tuple[str, str, str], tuple[str, torch.Tensor]] = {}

    def spy(site, gemm, operand, tensor, axis):
        seen[(site.name, gemm, operand)] = (site.kind, tensor.detach().clone())
        return tensor

    numscope.sites.attach(model, spy, name="spy")
    recipe.backward(model(input_ids=IDS, labels=IDS).loss)
    assert {name for name, _, _ in seen} == expected
    query, key = "bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0.attention.self.key"
    kind, weight = seen[(query, "fprop", "weight")]
    assert kind == "linear" and weight.dtype == torch.float32 and weight.unique().numel() <= 15  # int4
    assert seen[(key, "fprop", "weight")][1].unique().numel() > 100  # no rule: the fp16 weight as it is
    assert sorted(keys) == sorted(
        f"bert.encoder.layer.{layer}.attention.self.query/{gemm}/{operand}"
        for layer in (0, 1)
        for gemm, operand in (
            ("fprop", "input"),
            ("fprop", "weight"),
            ("dgrad", "grad_output"),
            ("wgrad", "input"),
        )
    )  # dgrad's weight reused from fprop (the parameter, though saved-tensor hooks return an alias of it)


FP8 = numscope.SiteSpec.uniform("fp8_e4m3")


def _untouched(model: nn.Module, reference: nn.Module) -> bool:
    """Whether ``model`` has the parameters of ``reference`` (values and dtypes) and no hooks at all."""
    hooks = any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    return not hooks and all(
        mine.dtype == theirs.dtype and torch.equal(mine, theirs)
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True)
    )


@pytest.mark.parametrize(
    "arguments, error",
    [
        (dict(activations="fp32x"), r"activations must be 'working', fp16, bf16, fp32 .* got 'fp32x'"),
        (dict(activations=torch.float8_e4m3fn), r"activations must be .* got torch.float8_e4m3fn"),
        (dict(fp32_ops=["exp"]), r"fp32 ops must be torch callables such as torch\.softmax, got 'exp'"),
        (dict(fp32_ops=3), r"fp32 ops must be an iterable of torch callables .* got 3"),
        (dict(plan="fp8", keep_fp32=["no.such.module"]), r"keep_fp32 pattern 'no.such.module' matches no"),
        (dict(plan=numscope.Plan(rules=(numscope.Rule("*.no_such_site", FP8),)), example_inputs=IDS),
         r"no_such_site"),
        (dict(return_freed_memory="yes"), r"return_freed_memory must be True, False or None; got 'yes'"),
    ],
)  # fmt: skip
def test_bad_arguments_leave_the_model_untouched(arguments: dict, error: str) -> None:
    model = bert()
    with pytest.raises((ValueError, TypeError), match=error):
        Recipe(model, dtype=torch.float16, **arguments)
    assert _untouched(model, bert())
    assert numscope.sites.attached(model) == []


@pytest.mark.parametrize("activations", ["fp32", torch.float32, None])
def test_fp32_activations_keep_them_as_computed(activations) -> None:
    recipe = Recipe(bert(), dtype=torch.float16, activations=activations)
    assert recipe.activations is None


@pytest.mark.filterwarnings("error:numscope fast path:RuntimeWarning")  # compiles under the fp32-ops mode
def test_fp8_plan_in_an_fp16_model_keeps_codes_and_the_same_gradients_compiled_or_not() -> None:
    """A quantized fp16 GEMM input is kept for wgrad in its fp8 codes (not the raw fp16 activation) and
    nothing a plan's site keeps is rounded again by the activation store: the eager path (codes) and the
    compiled one (float32 values, no codes) give the same loss and gradients bit for bit."""
    results = {}
    for compiled in (False, True):
        model = bert(dropout=0.1)
        recipe = Recipe(model, plan="fp8", dtype=torch.float16, loss_scale=1024.0, compiled=compiled)
        torch.manual_seed(2)
        loss = model(input_ids=IDS, labels=IDS).loss
        recipe.backward(loss)
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results[compiled] = (loss.detach(), grads, recipe.activations.kept_bytes)
    (eager_loss, eager_grads, eager_kept), (compiled_loss, compiled_grads, compiled_kept) = results.values()
    assert torch.equal(eager_loss, compiled_loss)
    assert eager_grads.keys() == compiled_grads.keys() and len(eager_grads) > 30
    for name, grad in eager_grads.items():
        assert torch.equal(grad, compiled_grads[name]), name
    assert eager_kept < 0.8 * compiled_kept


@pytest.mark.skipif(allocator._mallopt() is None, reason="needs glibc (Linux)")
def test_a_recipe_that_stores_in_low_precision_returns_freed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert Recipe(bert(), dtype=torch.float16).returns_freed_memory
    assert Recipe(bert(), **OFF, return_freed_memory=True).returns_freed_memory
    assert not Recipe(bert(), **OFF).returns_freed_memory  # plain fp32 leaves the allocator alone
    assert not Recipe(bert(), dtype=torch.bfloat16, return_freed_memory=False).returns_freed_memory
    assert allocator.fixed_threshold() == allocator.DEFAULT_THRESHOLD
