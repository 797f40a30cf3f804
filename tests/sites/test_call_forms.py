"""Every way a model calls a GEMM: the forms that are sites (alpha/beta folded in, torch.linalg.matmul, a
module's weight used outside its F.linear), the forms that warn once naming module and op, and sites that
are listed only where they run (so that a rule naming a module whose GEMM runs under another name is an
error that names that GEMM, not a rule that silently does nothing)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import numscope
from numscope.plan import PlanError
from numscope.sites import attach, sites

X = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))


def identity_run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, set[str]]:
    seen: set[str] = set()
    attach(model, lambda site, gemm, operand, tensor, axis: (seen.add(site.name), tensor)[1], name="identity")
    return model(x), seen


class TransposedLinear(nn.Linear):
    """As transformers' FalconLinear: its own product with the weight transposed, not F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


class Parent(nn.Module):
    """As Mamba's mixer with dt_proj: a parent multiplies with a child Linear's weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 6)
        self.unused = nn.Linear(8, 8)  # never called
        self.out = TransposedLinear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.linear(x, self.proj.weight, self.proj.bias))


def test_a_modules_weight_is_its_site_wherever_it_is_multiplied() -> None:
    model = Parent()
    names = [site.name for site in sites(model, X)]
    assert names == ["proj", "out"]  # not "matmul0"s, and "unused" (never run) not listed
    plain = Parent()(X)
    out, seen = identity_run(Parent(), X)
    assert torch.equal(out, plain) and seen == {"proj", "out"}
    quantized = numscope.convert(
        Parent(), numscope.Plan.uniform("fp32").with_rule("out", numscope.SiteSpec.uniform("fp8_e4m3"))
    )
    assert not torch.equal(quantized(X), plain)  # the rule on the module reaches its GEMM


def test_a_rule_on_a_module_that_never_runs_is_an_error() -> None:
    with pytest.raises(PlanError, match=r"'unused'"):
        numscope.convert(
            Parent(),
            numscope.Plan.uniform("fp8").with_rule("unused", numscope.SiteSpec.uniform("bf16")),
            example_inputs=X,
        )


class OwnProduct(nn.Module):
    """A module (not a Linear) that multiplies by a parameter of its own: its GEMM is `<module>.matmul0`."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.w)


def test_a_rule_naming_a_module_points_to_its_gemms() -> None:
    model = nn.Sequential(OwnProduct())
    assert [site.name for site in sites(model, X)] == ["0.matmul0"]
    with pytest.raises(PlanError, match=r"the module's GEMMs run as '0\.matmul0': name those"):
        numscope.convert(
            model,
            numscope.Plan.uniform("fp32").with_rule("0", numscope.SiteSpec.uniform("fp8_e4m3")),
            example_inputs=X,
        )


def test_a_weight_normed_linear_is_its_own_site() -> None:
    torch.manual_seed(0)
    layer = nn.utils.parametrizations.weight_norm(nn.Linear(8, 4))
    model = nn.Sequential(layer)
    assert [site.name for site in sites(model, X)] == ["0"]
    plain = model(X)
    numscope.convert(model, numscope.Plan.uniform("fp8"))
    assert not torch.equal(model(X), plain)


class Scaled(nn.Module):
    def __init__(self, func: str, beta: float, alpha: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 6))
        self.bias = nn.Parameter(torch.randn(6))
        self.func, self.beta, self.alpha = func, beta, alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.func == "addmm":
            flat = x.reshape(-1, 8)
            return torch.addmm(self.bias, flat, self.w, beta=self.beta, alpha=self.alpha)
        batch = self.w.expand(x.shape[0], 8, 6)
        return torch.baddbmm(
            self.bias.expand(x.shape[0], x.shape[1], 6), x, batch, beta=self.beta, alpha=self.alpha
        )


@pytest.mark.parametrize("func", ["addmm", "baddbmm"])
@pytest.mark.parametrize("beta,alpha", [(0.5, 1.0), (1.0, 0.125), (0.0, 2.0)])
def test_alpha_and_beta_are_folded_around_a_site(func: str, beta: float, alpha: float) -> None:
    """Before, these calls were neither sites nor warned about: they ran unquantized, silently."""
    plain = Scaled(func, beta, alpha)(X)
    out, seen = identity_run(Scaled(func, beta, alpha), X)
    assert seen == {"matmul0"}
    torch.testing.assert_close(out, plain, rtol=1e-6, atol=1e-6)  # torch fuses the scaling; float32 rounding
    model = Scaled(func, beta, alpha)
    numscope.convert(model, numscope.Plan.uniform("fp8"))
    quantized = model(X)
    assert not torch.equal(quantized, plain)
    if beta == 0:  # torch ignores the input where beta is 0: a NaN there does not reach the result
        model.bias.data.fill_(float("nan"))
        assert torch.isfinite(model(X)).all()


def test_linalg_matmul_is_a_site() -> None:
    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.linalg.matmul(x, self.w)

    assert [site.name for site in sites(Module(), X)] == ["matmul0"]


FORMS = {
    "tensordot": lambda x, w: torch.tensordot(x, w, dims=([2], [0])),
    "mv": lambda x, w: torch.mv(w.T, x[0, 0]),
    "addbmm": lambda x, w: torch.addbmm(torch.zeros(5, 4), x, w.expand(3, 8, 4)),
    "multi_dot": lambda x, w: torch.linalg.multi_dot([x[0], w, torch.ones(4, 2)]),
    "chain_matmul": lambda x, w: torch.chain_matmul(x[0], w, torch.ones(4, 2)),
    "inner": lambda x, w: torch.inner(x, w.T),
    "out=": lambda x, w: torch.matmul(x[0], w.detach(), out=torch.empty(5, 4)),  # no autograd with out=
}


@pytest.mark.parametrize("form", list(FORMS))
def test_gemms_numscope_does_not_intercept_warn_once(form: str) -> None:
    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return FORMS[form](x, self.w)

    model = Module()
    numscope.convert(model, numscope.Plan.uniform("fp8"))
    with pytest.warns(UserWarning, match="numscope"):
        model(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(X)  # once per module and op


def test_a_plan_made_at_one_sequence_length_is_refused_at_a_longer_one() -> None:
    """Mamba's scan runs one GEMM per time step (sites <mixer>.matmul1 … matmulT): a plan made per site at
    T=4 names four steps; at T=6 the fifth step would silently fall to the default, so it is refused with
    the cause and both ways out (issue 27)."""
    from transformers import MambaConfig, MambaForCausalLM

    from numscope.plan import Plan, PlanError, SiteSpec
    from numscope.vocab import OPERAND_KEYS

    torch.manual_seed(0)
    config = MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=4, expand=2,
                         conv_kernel=4, intermediate_size=64)  # fmt: skip
    model = MambaForCausalLM(config)
    short, long = ({"input_ids": torch.randint(0, 64, (1, t))} for t in (4, 6))
    names = [site.name for site in numscope.sites(model, short)]
    plan = Plan.per_operand({(name, g, o): "bf16" for name in names for g, o in OPERAND_KEYS})
    converted = numscope.convert(MambaForCausalLM(config), plan)
    converted(**short)  # the length the plan was made at
    with pytest.raises(PlanError, match=r"mixer\.\w+\d' has no rule.*mixer\.matmul0 … .*mixer\.matmul4"):
        converted(**long)  # a step past the plan's, named as it first ran
    rediscovered = numscope.convert(MambaForCausalLM(config), plan)
    numscope.sites(rediscovered, long)  # found at this length: the step is matmul5
    with pytest.raises(PlanError, match=r"'backbone\.layers\.0\.mixer\.matmul5' has no rule"):
        rediscovered(**long)
    steps = plan.with_rule("backbone.layers.0.mixer.*", SiteSpec.uniform("bf16"))
    numscope.convert(MambaForCausalLM(config), steps)(**long)  # one rule for every step: runs
