"""Named recipes as plans: each builds, reads back from YAML, trains a real tiny BERT, and puts each operand
in the format, scaling and orientation its source describes (checked on one Linear against a hand
computation); the CLI lists them with their sources; the observer takes the new formats as candidates."""

from __future__ import annotations

import math
import os
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import BertForMaskedLM

import numscope
from numscope.cli import main as cli_main
from numscope.plan import Plan, PlanError, SiteSpec
from numscope.plan.recipes import ATTENTION_PATTERNS, NVFP4_BF16_TAIL, RECIPES, TE_RHT
from numscope.sites import accumulate_matmul
from tiny_models import tiny_bert

IDS = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(0))


def bert() -> BertForMaskedLM:
    return tiny_bert(max_position=64)


def train(model: nn.Module, loss_of, steps: int) -> list[float]:
    """The losses of ``steps`` AdamW steps on the loss ``loss_of()`` computes."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_every_recipe_has_a_source_and_round_trips() -> None:
    assert set(Plan.recipes()) == set(RECIPES) and len(RECIPES) >= 10
    for name, recipe in RECIPES.items():
        assert recipe.source and recipe.summary and recipe.notes, name
        plan = Plan.recipe(name)
        assert Plan.from_dict(plan.to_dict()) == plan, name
        assert Plan.named(name) == plan
    with pytest.raises(PlanError, match=r"unknown preset or recipe 'te_fp8'; .*allowed: fp32, .*te_delayed"):
        Plan.named("te_fp8")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_trains_a_tiny_bert(name: str) -> None:
    model = bert()
    site_names = [site.name for site in numscope.sites(model, {"input_ids": IDS})]
    numscope.convert(model, Plan.recipe(name, site_names), generator=torch.Generator().manual_seed(0))
    losses = train(model, lambda: model(input_ids=IDS, labels=IDS).loss, steps=4)
    assert all(math.isfinite(value) for value in losses) and losses[-1] < losses[0], losses


def test_attention_products_stay_high_and_optional_rules_match_nothing_silently() -> None:
    plan = Plan.recipe("te_current")
    assert plan.for_site("bert.encoder.layer.0.attention.self.scores").is_high
    assert plan.for_site("bert.encoder.layer.1.attention.self.context0").is_high
    assert not plan.for_site("bert.encoder.layer.0.attention.self.query").is_high
    plan.check_sites(["mlp.fc1", "mlp.fc2"])  # no attention here: the optional rules stay quiet
    strict = plan.with_rule("nothing.*", SiteSpec())
    with pytest.raises(PlanError, match=r"1 pattern\(s\) match no site: rules\[4\]\.match 'nothing\.\*'"):
        strict.check_sites(["mlp.fc1"])
    data = plan.to_dict()
    assert data["rules"][0]["optional"] is True and data["rules"][0]["match"] == ATTENTION_PATTERNS[0]
    with pytest.raises(PlanError, match=r"rules\[0\]\.optional must be a bool, got str"):
        Plan.from_dict({"numscope_plan": 1, "rules": [{"match": "x", "optional": "yes", "all": "bf16"}]})


def test_nvfp4_keeps_the_last_15_percent_of_linear_layers_in_bf16() -> None:
    model = bert()
    names = [site.name for site in numscope.sites(model, {"input_ids": IDS})]
    plan = Plan.recipe("te_nvfp4", names)
    linear = [n for n in names if not n.endswith(("scores", "context"))]
    kept = [n for n in linear if plan.for_site(n).operand("fprop", "input").format == "bf16"]
    assert kept == linear[-math.ceil(NVFP4_BF16_TAIL * len(linear)) :]
    assert "cls.predictions.decoder" in kept  # the LM head, last
    spec = plan.for_site(linear[0])
    assert spec.operand("fprop", "weight").format == "nvfp4@2d@nan"  # TE's NaN behaviour
    assert spec.operand("wgrad", "grad_output").rounding == "stochastic"
    assert spec.operand("wgrad", "input").transform == TE_RHT
    assert spec.operand("fprop", "input").transform is None
    assert len(Plan.recipe("te_nvfp4").rules) == len(ATTENTION_PATTERNS)  # without sites: no BF16 layers


def one_linear(name: str) -> tuple[nn.Linear, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Linear under the recipe, its input x, a fixed grad_output and its output (weight.grad is set)."""
    torch.manual_seed(0)
    layer = nn.Linear(256, 128)
    numscope.convert(layer, Plan.recipe(name))
    x = torch.randn(256, 256) * torch.linspace(0.01, 10, 256)[:, None]  # tokens at different magnitudes
    grad_output = torch.randn(256, 128)
    out = layer(x)
    out.backward(grad_output)
    return layer, x, grad_output, out


def test_te_block_tiles_run_along_each_gemms_contraction_axis() -> None:
    layer, x, grad_output, out = one_linear("te_block")

    def q(tensor: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        scaling = numscope.Scaling("block", block_shape=shape, power_of_two=True)
        return numscope.quantize(tensor, "fp8_e4m3", scaling=scaling)

    weight = q(layer.weight.detach(), (128, 128))
    assert torch.equal(out.detach(), torch.addmm(layer.bias.detach(), q(x, (1, 128)), weight.t()))
    expected = q(grad_output, (128, 1)).t() @ q(x, (128, 1))  # 128 tokens per tile: along the contraction
    assert torch.allclose(layer.weight.grad, expected, rtol=1e-6, atol=1e-6)
    across = q(grad_output, (1, 128)).t() @ q(x, (1, 128))
    assert not torch.allclose(layer.weight.grad, across, rtol=1e-6, atol=1e-6)


def test_torchao_rowwise_scales_along_the_contraction_axis() -> None:
    layer, x, grad_output, out = one_linear("torchao_rowwise")

    def q(tensor: torch.Tensor, kind: str) -> torch.Tensor:
        return numscope.quantize(tensor, "fp8_e4m3", scaling=numscope.Scaling(kind, power_of_two=True))

    weight = layer.weight.detach()
    # the output GEMM accumulates fast (torchao's gemm_config_output default): fp22 without promotion
    product = numscope.sites.accumulate_matmul(q(x, "row"), q(weight, "row").t(), "fp22")
    assert torch.equal(out.detach(), product + layer.bias.detach())
    assert not torch.equal(out.detach(), torch.addmm(layer.bias.detach(), q(x, "row"), q(weight, "row").t()))
    expected = q(grad_output, "column").t() @ q(x, "column")
    assert torch.allclose(layer.weight.grad, expected, rtol=1e-6, atol=1e-6)


def _round_significant(value: Fraction, bits: int) -> Fraction:
    """``value`` rounded to ``bits`` significant bits, to nearest, ties to even (exact arithmetic)."""
    if value == 0:
        return value
    exponent = abs(value).numerator.bit_length() - abs(value).denominator.bit_length()
    if Fraction(2) ** exponent > abs(value):
        exponent -= 1
    unit = Fraction(2) ** (exponent - bits + 1)
    return round(value / unit) * unit  # Python's round of a Fraction: half to even


def _deepgemm_cast(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's casts (deep_gemm/utils/math.py at 38939a4): per tile of ``rows`` x 128, amax clamped at
    1e-4, sf = amax / 448, codes = e4m3(x * (1 / sf)); sf per element (expanded) and the codes."""
    m, k = x.shape
    tiles = x.reshape(m // rows, rows, k // 128, 128)
    amax = tiles.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = amax / 448.0
    codes = (tiles * (1.0 / sf)).to(torch.float8_e4m3fn).float()
    return codes.reshape(m, k), sf.expand_as(tiles).reshape(m, k)


def _deepgemm_gemm(ca, sa, cb, sb, rows: list[int]) -> torch.Tensor:
    """out[m, n] of DeepGEMM's promoted FP8 GEMM (a (M, K) by b (N, K)), in exact rational arithmetic:
    per run of 128 products, chunks of 32 summed exactly and rounded to E8M13 (14 significant bits, the
    accumulator numscope models), their sequential sums rounded so; then final = fma(sa · sb, partial,
    final) in float32 (the kernel's ``final_accum += scale_a * scale_b * accum``)."""
    n_out, k = cb.shape[0], ca.shape[1]
    out = torch.zeros(len(rows), n_out)
    for i, m in enumerate(rows):
        for n in range(n_out):
            total = Fraction(0)
            for run in range(k // 128):
                group = None
                for chunk in range(4):
                    ks = range(run * 128 + chunk * 32, run * 128 + chunk * 32 + 32)
                    exact = sum(Fraction(ca[m, j].item()) * Fraction(cb[n, j].item()) for j in ks)
                    part = _round_significant(exact, 14)
                    group = part if group is None else _round_significant(group + part, 14)
                scale = _round_significant(
                    Fraction(sa[m, run * 128].item()) * Fraction(sb[n, run * 128].item()), 24
                )
                total = _round_significant(scale * group + total, 24)
            out[i, n] = float(total)
    return out


def test_deepseek_v3_computes_as_deepgemm() -> None:
    """The recipe's fprop, dgrad and wgrad against DeepGEMM's casts and promoted GEMM written here."""
    layer, x, grad_output, out = one_linear("deepseek_v3")
    weight = layer.weight.detach()
    cx, sx = _deepgemm_cast(x, 1)  # per token, 1 x 128 along the contraction
    cw, sw = _deepgemm_cast(weight, 128)  # 128 x 128 blocks
    rows = [0, 1, 128, 255]  # tokens from 0.01 to 10 times the scale
    expected = _deepgemm_gemm(cx, sx, cw, sw, rows)
    assert torch.equal(out.detach()[rows], expected + layer.bias.detach())
    # wgrad: grad_output^T (128, tokens) by x (tokens, 256), both 1 x 128 along the tokens
    cg, sg = _deepgemm_cast(grad_output.t().contiguous(), 1)
    cxt, sxt = _deepgemm_cast(x.t().contiguous(), 1)
    assert torch.equal(layer.weight.grad[:2], _deepgemm_gemm(cg, sg, cxt, sxt, [0, 1]))

    # the scales at each promotion differ from scaling the operands first: the old model, by an ulp or so
    def old(t: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        scaling = numscope.Scaling("block", block_shape=shape, amax_epsilon=1e-4)
        return numscope.quantize(t, "fp8_e4m3", scaling=scaling)

    before = accumulate_matmul(old(x, (1, 128)), old(weight, (128, 128)).t(), "fp22_promote128")
    assert not torch.equal(out.detach() - layer.bias.detach(), before)
    assert Plan.recipe("deepseek_v3").default.accumulate == "fp22_promote128"


def test_cli_lists_the_recipes_and_shows_one(capsys) -> None:
    assert cli_main(["recipes"]) == 0
    listing = capsys.readouterr().out
    for name, recipe in RECIPES.items():
        assert name in listing and recipe.source in listing
    assert cli_main(["recipes", "deepseek_v3"]) == 0
    shown = capsys.readouterr().out
    assert "fp22_promote128" in shown and "block(block_shape=[1, 128], amax_epsilon=0.0001" in shown
    assert "emulated:" in shown
    assert cli_main(["recipes", "te_fp8"]) == 2
    assert "unknown recipe 'te_fp8'; known: te_delayed" in capsys.readouterr().err


def test_the_observer_takes_the_new_formats_as_candidates() -> None:
    model = bert()
    candidates = ["nvfp4", "nvfp4@4over6", "nvfp4@2d", "nvfp4@row", "mxfp8_e4m3@even", "mxint8@full"]
    with numscope.observe(model, candidates=candidates, every=1) as observer:
        model(input_ids=IDS, labels=IDS).loss.backward()
        observer.step()
    analysis = observer.analysis()
    key = ("bert.encoder.layer.0.intermediate.dense", "fprop", "input")
    sqnr = {name: analysis.metric_values(key, name, "sqnr_db")[0] for name in candidates}
    assert all(math.isfinite(value) for value in sqnr.values()), sqnr
    assert sqnr["nvfp4@4over6"] > sqnr["nvfp4"]  # Four Over Six lowers the error it chooses by


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_trains_a_gqa_llama_and_a_cnn(name: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from numscope.demo.cnn import small_cnn

    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    ids = IDS[:, :16]
    numscope.convert(llama, Plan.recipe(name, [s.name for s in numscope.sites(llama, {"input_ids": ids})]))
    cnn = small_cnn(8)
    images, labels = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    plan = Plan.recipe(name)
    models = [(llama, lambda: llama(input_ids=ids, labels=ids).loss)]
    numscope.convert(cnn, plan)
    if plan.default.accumulate == "fp32":
        models.append((cnn, lambda: nn.functional.cross_entropy(cnn(images), labels)))
    else:  # convolution accumulation is not emulated: the first call says so, clearly, instead of ignoring it
        with pytest.raises(ValueError, match="not emulated for convolutions"):
            cnn(images)
    for model, loss_of in models:
        losses = train(model, loss_of, steps=3)
        assert all(math.isfinite(value) for value in losses) and losses[-1] < losses[0], (name, losses)


def test_te_nvfp4_uses_transformer_engines_fixed_hadamard_signs() -> None:
    """TE's wgrad RHT: diag(signs) · H₁₆ / 4 with the sign vector hard-coded in TE's
    transformer_engine/pytorch/tensor/nvfp4_tensor.py (get_wgrad_sign_vector, TE 2.20.0.dev0), H₁₆
    Sylvester's; its reference applies it as x_blocks @ (D·H / 4)."""
    from numscope.formats.transform import Rotation

    signs = torch.tensor([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=torch.float32)
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < 16:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    spec = Plan.recipe("te_nvfp4").for_site("any.linear").operand("wgrad", "grad_output")
    assert torch.equal(Rotation.parse(spec.transform).matrix(), torch.diag(signs) @ hadamard / 4)
    assert not torch.equal(Rotation.parse("rht16").matrix(), torch.diag(signs) @ hadamard / 4)


def test_torchao_recipes_floor_the_amax_as_torchao_does() -> None:
    """torchao's amax_to_scale: scale = f32(max / clamp(amax, min=EPS)) in float64, EPS = 1e-12
    (torchao/float8/float8_utils.py), rowwise rounded down to a power of two. A row whose amax is 1e-14 is
    scaled by max / 1e-12, not max / 1e-14: its values land 100× lower on the E4M3 grid."""
    import ml_dtypes
    import numpy as np

    spread = 2.0 ** -torch.arange(0, 16, 0.25)  # 64 values over 16 binades: the small ones near E4M3's floor
    x = spread * torch.tensor([[1e-14], [1e-13], [1.0], [3e-12]])
    e4m3 = ml_dtypes.float8_e4m3fn

    def torchao(values: np.ndarray, power_of_two: bool) -> np.ndarray:
        amax = np.abs(values).max(axis=-1, keepdims=True).astype(np.float64)
        scale = (448.0 / np.maximum(amax, 1e-12)).astype(np.float32)
        if power_of_two:
            scale = np.exp2(np.floor(np.log2(scale))).astype(np.float32)
        return (np.clip(values * scale, -448, 448).astype(e4m3).astype(np.float32) / scale).astype(np.float32)

    rowwise = Plan.recipe("torchao_rowwise").for_site("fc").operand("fprop", "input")
    got = numscope.quantize(x, rowwise.format, scaling=rowwise.effective_scaling()).numpy()
    assert np.array_equal(got, torchao(x.numpy(), power_of_two=True))
    unfloored = numscope.quantize(x, "fp8_e4m3", scaling=numscope.Scaling("row", power_of_two=True)).numpy()
    assert not np.array_equal(unfloored[0], got[0]) and np.array_equal(unfloored[2:], got[2:])
    tensorwise = Plan.recipe("torchao_tensorwise").for_site("fc").operand("fprop", "input")
    assert tensorwise.effective_scaling().amax_epsilon == 1e-12


def test_deepseek_v3_keeps_its_head_and_gates_high_and_floors_tile_amaxes() -> None:
    """The report keeps the output head and the MoE gating in their original precision; DeepGEMM's casts
    clamp each tile's amax at 1e-4 (per_token_cast_to_fp8: amax.clamp(1e-4))."""
    names = [
        "model.layers.0.mlp.gate",
        "model.layers.0.mlp.experts.0",
        "model.layers.0.self_attn.scores",
        "lm_head",
    ]
    plan = Plan.recipe("deepseek_v3", names)
    assert plan.for_site("lm_head").is_high and plan.for_site("model.layers.0.mlp.gate").is_high
    expert = plan.for_site("model.layers.0.mlp.experts.0")
    assert not expert.is_high and expert.accumulate == "fp22_promote128"
    tile = expert.operand("fprop", "input").effective_scaling()
    assert tile.block_shape == (1, 128) and tile.amax_epsilon == 1e-4
    assert not Plan.recipe("deepseek_v3").for_site("lm_head").is_high  # the head is known from the sites only


def test_the_promotions_fused_multiply_add_rounds_once() -> None:
    """_fma32 against exact rational arithmetic, where float64 cannot hold the sum (exponents far apart)
    and on float32 ties, which a product rounded first would break differently."""
    from numscope.sites.gemm import _fma32

    generator = torch.Generator().manual_seed(0)
    s = torch.randn(4000, generator=generator) * torch.exp2(
        torch.randint(-30, 30, (4000,), generator=generator)
    )
    g = torch.randn(4000, generator=generator).float()
    g = numscope.quantize(g, "e8m13")
    t = torch.randn(4000, generator=generator) * torch.exp2(
        torch.randint(-60, 60, (4000,), generator=generator)
    )
    t[:1000] = -(s[:1000].double() * g[:1000].double()).float()  # near-cancellation
    got = _fma32(s, g, t)
    for i in range(4000):
        exact = Fraction(s[i].item()) * Fraction(g[i].item()) + Fraction(t[i].item())
        assert got[i].item() == float(_round_significant(exact, 24)), i
    two_step = s * g + t  # rounded twice: differs somewhere, or the test would not test anything
    assert not torch.equal(two_step, got)


def test_only_recipes_that_choose_layers_by_the_models_sites_need_them(tmp_path: Path) -> None:
    needing = {name for name in Plan.recipes() if Plan.needs_sites(name)}
    assert needing == {"te_nvfp4", "deepseek_v3"}
    names = ["a.linear", "b.linear", "lm_head"]
    for name in Plan.recipes():  # the flag says the truth: the plan changes with the sites exactly there
        assert (Plan.recipe(name, names).to_dict() != Plan.recipe(name).to_dict()) == (name in needing), name
    Plan.recipe("te_nvfp4").save(tmp_path / "te_nvfp4.yaml")
    assert not Plan.needs_sites(tmp_path / "te_nvfp4.yaml") and not Plan.needs_sites("fp8")
