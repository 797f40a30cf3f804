"""The device path: what a GPU run executes, checked on the CPU.

numscope takes the *device path* (:func:`numscope.formats.path.host_path` false) for a tensor on a GPU, and
for a CPU tensor with the native quantizers off: torch operations and compiled kernels only. Three checks
stand in for a GPU here:

* every cast runs eagerly on a CUDA tensor under ``FakeTensorMode`` (the CPU build has no CUDA kernels:
  fake tensors carry the device and the shapes, and any tensor created on another device is seen);
* a converted model's training step on the ``meta`` device, for every named recipe: a meta tensor has no
  values, so any read back to the host (``.item()``, ``bool``, ``tolist``, ``torch.equal``) raises, and
  a dispatch mode records every tensor an operation creates: none may be a CPU tensor. (A fake CUDA model
  cannot be built on the CPU build: its parameters' initialisation has no fake kernel there.)
* the device path on the CPU trains every named recipe to the same bits as the CPU's own path.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import numscope
from numscope.formats import native
from numscope.formats.spec import BlockFormat
from numscope.plan import Plan
from numscope.plan.recipes import recipes
from tiny_models import tiny_bert, tiny_gpt2

RECIPES = [recipe.name for recipe in recipes()]
MX_OPTIONS = ("", "@rceil", "@ceil", "@even")
NVFP4_OPTIONS = ("", "@2d", "@row", "@4over6", "@4over6@mae", "@4over6@2d@mae", "@divide", "@nan")
ELEMENT_SCALINGS = (
    None,
    "tensor",
    "row",
    "column",
    "delayed",
    numscope.Scaling("block", block_shape=(1, 32)),
    numscope.Scaling("block", block_shape=(16, 16)),
)


class _CreatedOn(TorchDispatchMode):
    """Records the device of every tensor an operation returns while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.created.append((str(func), tensor.device.type))
        return out

    def elsewhere(self, device: str) -> list[str]:
        return sorted({func for func, created in self.created if created != device})


@pytest.fixture
def device_path(monkeypatch):
    """The device path on the CPU: the native quantizers off (as for a tensor on a GPU)."""
    monkeypatch.setattr(native, "_enabled", False)


def _cases(fmt) -> list[tuple[str, object, str]]:
    if isinstance(fmt, BlockFormat):
        options = NVFP4_OPTIONS if fmt.tensor_scale else MX_OPTIONS
        roundings = ("nearest", "stochastic")
        cases = [(fmt.name + option, None, rounding) for option in options for rounding in roundings]
        return [*cases, (fmt.name, numscope.Scaling("block", axis=0), "nearest")]
    roundings = ("nearest", "nearest_away", "zero", "stochastic")
    return [(fmt.name, scaling, rounding) for scaling in ELEMENT_SCALINGS for rounding in roundings]


@pytest.mark.parametrize("fmt", numscope.formats(), ids=lambda fmt: fmt.name)
def test_every_cast_runs_on_a_fake_cuda_tensor_and_creates_nothing_elsewhere(fmt, device_path) -> None:
    for name, scaling, rounding in _cases(fmt):
        with FakeTensorMode():
            x = torch.empty(64, 96, device="cuda")
            with _CreatedOn() as created:
                if scaling == "delayed":
                    delayed = numscope.Scaling("delayed", history_len=4)
                    scaling = numscope.DelayedScaler(delayed, device=x.device)
                    numscope.quantize(x, name, scaling=scaling, rounding=rounding)
                y = numscope.quantize(x, name, scaling=scaling, rounding=rounding)
        assert y.device.type == "cuda" and y.shape == x.shape, (name, scaling, rounding)
        assert not created.elsewhere("cuda"), (name, scaling, rounding, created.elsewhere("cuda"))


def _plan(name: str, model: nn.Module) -> Plan:
    if name in RECIPES:
        return Plan.recipe(name, [site.name for site in numscope.sites(model)])
    return Plan.uniform(name)


@pytest.mark.parametrize("build", [tiny_bert, tiny_gpt2], ids=["bert", "gpt2"])
@pytest.mark.parametrize("name", [*RECIPES, "fp8", "mxfp8", "nvfp4", "int8", "bf16"])
def test_a_converted_step_on_the_meta_device_reads_nothing_back_and_stays_there(build, name: str) -> None:
    """Every named recipe's training step (forward and backward, delayed histories, stochastic rounding,
    Hadamard transforms, fp22 accumulation and its promotion included) on the meta device: no read back
    to the host (it would raise) and no tensor made anywhere else, from the second step on (the first
    builds the scalers' histories and the transforms' matrices, on the model's device too)."""
    model = build()
    plan = _plan(name, model)
    model = model.to("meta")
    numscope.convert(model, plan, compiled=False)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    model(input_ids=ids, labels=ids).loss.backward()
    with _CreatedOn() as created:
        model(input_ids=ids, labels=ids).loss.backward()
    assert created.created and not created.elsewhere("meta"), created.elsewhere("meta")


def _train(name: str, steps: int = 3) -> list[torch.Tensor]:
    model = tiny_bert(dropout=0.0)
    numscope.convert(model, _plan(name, model), compiled=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [parameter.detach().clone() for parameter in model.parameters()]


@pytest.mark.skipif(not native.available(), reason="the native quantizers could not be built")
@pytest.mark.parametrize("name", [*RECIPES, "fp8", "mxfp8", "mxfp6", "mxfp4", "nvfp4", "int8", "fp16"])
def test_the_device_path_trains_every_recipe_to_the_cpu_paths_bits(name: str, monkeypatch) -> None:
    torch.manual_seed(0)
    host = _train(name)
    monkeypatch.setattr(native, "_enabled", False)
    torch.manual_seed(0)
    device = _train(name)
    for got, expected in zip(device, host, strict=True):
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), name
