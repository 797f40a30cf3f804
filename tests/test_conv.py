"""Convolutions as sites: Conv1d/2d/3d and ConvTranspose1d/2d/3d (groups, stride, padding, dilation), in a
small ResNet-like CNN with BatchNorm, a GAN generator, ViT's patch embedding and Whisper's front end."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numscope
from numscope.sites import attach, sites


def identity_run(make, x):
    """(output, grads) of the plain model and of the model with an identity handler, and what it saw."""
    results, seen = [], set()
    for routed in (False, True):
        model = make()
        if routed:
            attach(model, lambda s, g, o, t, a: (seen.add((s.name, g, o, a)), t)[1], name="identity")
        out = model(x)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    return results, seen


class Block(nn.Module):
    """A residual block: conv-BN-ReLU-conv-BN plus the input."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def resnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), Block(8),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, 10),
    )  # fmt: skip


def generator() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Unflatten(1, (16, 1, 1)), nn.ConvTranspose2d(16, 8, 4), nn.BatchNorm2d(8), nn.ReLU(),
        nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(4, 1, 3, stride=1, padding=1, dilation=1), nn.Tanh(),
    )  # fmt: skip


def various() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(4, 8, 5, stride=2, padding=3, dilation=2), nn.ReLU(),
        nn.ConvTranspose1d(8, 4, 3, stride=2, groups=2),
        nn.Unflatten(1, (4, 1)), nn.Unflatten(3, (1, -1)), nn.Conv3d(4, 2, (1, 1, 3), padding=(0, 0, 1)),
        nn.ConvTranspose3d(2, 2, (1, 1, 2), stride=(1, 1, 2)),
    )  # fmt: skip


@pytest.mark.parametrize(
    "make,x",
    [(resnet, torch.randn(4, 1, 8, 8)), (generator, torch.randn(4, 16)), (various, torch.randn(2, 4, 20))],
    ids=["resnet", "gan-generator", "conv1d-3d-transposed"],
)
def test_convolutions_are_sites_and_identity_is_bit_identical(make, x) -> None:
    [(out, grads), (routed_out, routed_grads)], seen = identity_run(make, x)
    assert torch.equal(out, routed_out)
    assert all(torch.equal(grads[name], routed_grads[name]) for name in grads)
    found = sites(make(), x)
    convolutions = [name for name, m in make().named_modules() if isinstance(m, nn.modules.conv._ConvNd)]
    assert [site.name for site in found if site.kind == "conv"] == convolutions
    # every operand of every GEMM, but dgrad of the first layer (its input needs no gradient)
    assert len(seen) == 6 * len(found) - 2


def test_the_contraction_axes_handed_to_the_handlers() -> None:
    _, seen = identity_run(generator, torch.randn(2, 16))
    axes = {(gemm, operand): axis for name, gemm, operand, axis in seen if name == "4"}  # ConvTranspose2d
    assert axes == {
        ("fprop", "input"): 1, ("fprop", "weight"): 0,  # C_in: the weight's first axis when transposed
        ("dgrad", "grad_output"): 1, ("dgrad", "weight"): 1,
        ("wgrad", "grad_output"): 0, ("wgrad", "input"): 0,
    }  # fmt: skip


def test_fprop_of_a_quantized_convolution_by_hand() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, padding=1)
    numscope.convert(conv, numscope.Plan.uniform("fp8"))
    x = torch.randn(2, 3, 6, 6)
    expected = F.conv2d(
        numscope.quantize(x, "fp8_e4m3", scaling="tensor"),
        numscope.quantize(conv.weight.detach(), "fp8_e4m3", scaling="tensor"),
        conv.bias.detach(),
        padding=1,
    )
    assert torch.equal(conv(x).detach(), expected)


@pytest.mark.parametrize("preset", ["fp8", "mxfp8"])
def test_a_cnn_trains_under_low_precision_plans(preset: str) -> None:
    model = resnet()
    numscope.convert(model, numscope.Plan.uniform(preset))
    x, labels = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(5):
        loss = F.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_a_cnn_is_observed_and_recommended() -> None:
    model = resnet()
    with numscope.observe(model, candidates=["bf16", "fp8_e4m3", "mxfp8_e4m3"], every=1) as observer:
        F.cross_entropy(model(torch.randn(8, 1, 8, 8)), torch.randint(0, 10, (8,))).backward()
        observer.step()
    analysis = observer.analysis()
    assert {"0", "3.conv1", "4"} <= set(analysis.sites())
    assert numscope.recommend(analysis).for_site("3.conv1").operands


def test_convolutions_refuse_a_narrow_accumulator_and_say_what_they_skip() -> None:
    conv = nn.Conv2d(3, 4, 3)
    numscope.convert(conv, numscope.Plan(numscope.SiteSpec.uniform("bf16", accumulate="bf16")))
    with pytest.raises(ValueError, match="accumulate 'bf16' is not emulated for convolutions"):
        conv(torch.randn(1, 3, 5, 5))


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Conv2d(3, 4, 3, padding="same"),
        lambda: nn.Conv2d(
            3, 4, (4, 3), padding="same", dilation=(1, 2)
        ),  # odd total: one more zero at the end
        lambda: nn.Conv1d(3, 4, 4, padding="same"),
        lambda: nn.Conv2d(3, 4, 3, padding="valid"),
    ],
    ids=["same", "same-asymmetric", "same-1d", "valid"],
)
def test_string_padding_is_a_site(make) -> None:
    """Before, a 'same'/'valid' convolution was listed as a site but ran past the handlers with a warning."""
    torch.manual_seed(0)
    plain = make()
    x = torch.randn(2, 3, 7, 6) if isinstance(plain, nn.Conv2d) else torch.randn(2, 3, 9)
    seen = []
    identity = make()
    identity.load_state_dict(plain.state_dict())
    numscope.sites.attach(identity, lambda site, g, o, t, a: (seen.append((site.name, g)), t)[1], name="id")
    want, got = plain(x), identity(x)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-6)
    assert ("", "fprop") in seen  # the convolution's own site ran through the handler
    quantized = make()
    quantized.load_state_dict(plain.state_dict())
    numscope.convert(quantized, numscope.Plan.uniform("fp8"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = quantized(x)
    assert out.shape == want.shape and not torch.equal(out, want)


def test_vit_and_whisper_front_ends_are_sites() -> None:
    from transformers import (
        ViTConfig,
        ViTForImageClassification,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )

    torch.manual_seed(0)
    vit = ViTForImageClassification(
        ViTConfig(
            image_size=16,
            patch_size=4,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=3,
        )
    )
    pixels = torch.randn(2, 3, 16, 16)
    found = {site.name: site.kind for site in sites(vit, {"pixel_values": pixels})}
    assert found["vit.embeddings.patch_embeddings.projection"] == "conv"
    numscope.convert(vit, numscope.Plan.uniform("mxfp8"))
    vit(pixel_values=pixels, labels=torch.tensor([0, 2])).loss.backward()
    assert vit.vit.embeddings.patch_embeddings.projection.weight.grad is not None
    whisper = WhisperForConditionalGeneration(
        WhisperConfig(
            vocab_size=100,
            num_mel_bins=8,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_source_positions=16,
            max_target_positions=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        )
    )
    inputs = {"input_features": torch.randn(2, 8, 32), "decoder_input_ids": torch.randint(3, 100, (2, 5))}
    found = {site.name: site.kind for site in sites(whisper, inputs)}
    assert found["model.encoder.conv1"] == found["model.encoder.conv2"] == "conv"
    numscope.convert(whisper, numscope.Plan.uniform("fp8"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing in Whisper runs past numscope
        loss = whisper(**inputs, labels=inputs["decoder_input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss)


def _im2col_backward_error(x, weight, fmt, *, stride, padding, groups, quantize_x, quantize_w):
    """fprop's backward error of a Conv2d computed the long way: each group's im2col GEMM, per output
    entry |L·R − Q(L)·Q(R)| / (|L|·|R|) in float64; (mean, max, count) over the entries."""
    qx, qw = quantize_x(x, fmt).double(), quantize_w(weight, fmt).double()
    x, weight = x.double(), weight.double()
    out_channels, per_group = weight.shape[0], x.shape[1] // groups
    errors, magnitudes = [], []

    def cols(t, group):
        channels = t[:, group * per_group : (group + 1) * per_group]
        return F.unfold(channels, weight.shape[-2:], padding=padding, stride=stride)

    for g in range(groups):
        rows = slice(g * out_channels // groups, (g + 1) * out_channels // groups)
        w, w_q = weight[rows].flatten(1), qw[rows].flatten(1)
        exact, quantized = w @ cols(x, g), w_q @ cols(qx, g)
        magnitudes.append(w.abs() @ cols(x, g).abs())
        errors.append((exact - quantized).abs())
    error, magnitude = torch.cat(errors, 1).flatten(), torch.cat(magnitudes, 1).flatten()
    kept = magnitude > 0
    be = error[kept] / magnitude[kept]
    return be.mean().item(), be.max().item(), int(kept.sum())


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "mxfp8_e4m3", "mxfp4_e2m1"])
def test_the_backward_error_of_a_convolution_is_its_im2col_gemms(fmt: str) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, bias=False)
    x = torch.randn(3, 4, 7, 7, requires_grad=True)  # 3 batch entries: all enter the backward error
    with numscope.observe(conv, candidates=["bf16", fmt], every=1) as observer:
        conv(x).square().sum().backward()
        observer.step()
    analysis = observer.analysis()

    def along_channels(t, name):  # as the runtime: blocks along the contraction axis (channels here)
        scaling = "block" if name.startswith("mx") else "tensor"  # each format's default scaling
        return numscope.quantize(t.movedim(1, -1), name, scaling=scaling).movedim(-1, 1)

    mean, largest, count = _im2col_backward_error(
        x.detach(), conv.weight.detach(), fmt, stride=2, padding=1, groups=2,
        quantize_x=along_channels, quantize_w=along_channels,
    )  # fmt: skip
    recorded = analysis.backward_errors[("", "fprop")][(fmt, fmt)][0]
    assert recorded["count"] == count == 3 * 6 * 4 * 4
    assert recorded["mean"] == pytest.approx(mean, rel=1e-9) and recorded["max"] == pytest.approx(
        largest, rel=1e-9
    )
    dgrad = analysis.backward_errors[("", "dgrad")][(fmt, fmt)][0]
    assert dgrad["count"] + dgrad["excluded"] == x.numel() and 0 < dgrad["mean"] < 1
    # wgrad, the long way: dW = dY · im2col(x)ᵀ per group, both operands quantized along the batch axis
    grad_output = 2 * conv(x).detach()  # of out.square().sum()

    def along_batch(t, name):
        scaling = "block" if name.startswith("mx") else "tensor"
        return numscope.quantize(t.movedim(0, -1), name, scaling=scaling).movedim(-1, 0).double()

    qdy, qx = along_batch(grad_output, fmt), along_batch(x.detach(), fmt)
    dy, xd = grad_output.double(), x.detach().double()
    entries = []
    for g in range(2):
        rows = slice(3 * g, 3 * (g + 1))

        def cols(t, g=g):
            return F.unfold(t[:, 2 * g : 2 * g + 2], 3, padding=1, stride=2).transpose(1, 2).flatten(0, 1)

        def flat(t, rows=rows):
            return t[:, rows].flatten(2).transpose(0, 1).flatten(1)  # (C_out/g, N·L)

        exact, quantized = flat(dy) @ cols(xd), flat(qdy) @ cols(qx)
        entries.append(((exact - quantized).abs(), flat(dy).abs() @ cols(xd).abs()))
    error = torch.cat([e.flatten() for e, _ in entries])
    magnitude = torch.cat([m.flatten() for _, m in entries])
    wgrad = analysis.backward_errors[("", "wgrad")][(fmt, fmt)][0]
    assert wgrad["count"] == int((magnitude > 0).sum()) == conv.weight.numel()
    assert wgrad["mean"] == pytest.approx((error / magnitude).mean().item(), rel=1e-9)
    assert analysis.backward_errors[("", "fprop")][("bf16", "bf16")][0]["mean"] < recorded["mean"]


def test_a_transposed_convolutions_backward_error_is_measured_through_it() -> None:
    torch.manual_seed(0)
    up = nn.ConvTranspose2d(4, 2, 4, stride=2, padding=1, bias=False)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    with numscope.observe(up, candidates=["bf16", "mxfp8_e4m3"], every=1) as observer:
        up(x).square().sum().backward()
        observer.step()
    errors = observer.analysis().backward_errors
    out_entries = 2 * 2 * 10 * 10
    for gemm, entries in (("fprop", out_entries), ("dgrad", x.numel()), ("wgrad", up.weight.numel())):
        fp8 = errors[("", gemm)][("mxfp8_e4m3", "mxfp8_e4m3")][0]
        bf16 = errors[("", gemm)][("bf16", "bf16")][0]
        assert fp8["count"] + fp8["excluded"] == entries, gemm
        assert 0 < bf16["mean"] < fp8["mean"] < 0.1, gemm  # 8 mantissa bits beat 3
