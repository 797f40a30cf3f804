"""AdamW with low-precision moments (:class:`numscope.train.AdamWFp8`, ``AdamW8bit``, ``AdamW4bit``) against
torchao's own: the update (``single_param_adam``) run eagerly by torchao on its FP8, 8-bit and 4-bit state
subclasses, in a subprocess with torchao on the path; the maps; the memory of the moments; a resume from the
optimizer's state dict."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.cli.test_cli import ws  # noqa: F401 (the CLI tests' workspace fixture)

from numscope.train.optim import (
    AdamW4bit,
    AdamW8bit,
    AdamWFp8,
    OptimizerError,
    dynamic_map,
    linear_map,
    quantize_blocks,
    quantize_map,
)

PEERS = Path(sys.prefix) / "peers"
WIDE_BERT = textwrap.dedent(
    """
    import os
    from transformers import BertConfig, BertForMaskedLM


    class Stopping(BertForMaskedLM):
        # crashes (as a lost machine would) on its 3rd training forward when NUMSCOPE_TEST_STOP is set
        def forward(self, *args, **kwargs):
            if self.training and os.environ.get("NUMSCOPE_TEST_STOP"):
                self.forwards = getattr(self, "forwards", 0) + 1
                if self.forwards == 3:
                    raise RuntimeError("the machine went away")
            return super().forward(*args, **kwargs)


    def stopping(vocab_size):
        config = BertConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=256, max_position_embeddings=64, attn_implementation="eager")
        return Stopping(config)
    """
)
STEPS = 5

TORCHAO = textwrap.dedent(
    """
    import sys, torch
    from torchao.optim.adam import single_param_adam
    from torchao.optim.quant_utils import create_dynamic_map
    from torchao.optim.subclass_4bit import OptimState4bit, get_qmap_unsigned
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8, quantize_fp8

    params, grads, out = torch.load(sys.argv[1])
    results = {"quantized": quantize_fp8(grads[0][0], 256), "maps": {
        "8 signed": create_dynamic_map(True), "8 unsigned": create_dynamic_map(False),
        "4 signed": create_dynamic_map(True, 3, 4), "4 unsigned": list(get_qmap_unsigned())}}
    for kind, block in (("fp8", 256), ("8bit", 256), ("4bit", 128)):
        trained, moments = [], []
        for p, steps in zip(params, grads):
            p = p.clone()
            big = p.numel() >= 4096 and p.numel() % block == 0
            if not big:
                new = lambda signed: torch.zeros_like(p)
            elif kind == "fp8":
                new = lambda signed: OptimStateFp8.zeros(p.shape, block, p.device)
            elif kind == "8bit":
                new = lambda signed: OptimState8bit.zeros(p.shape, signed, block, p.device)
            else:
                new = lambda signed: OptimState4bit.zeros(p.shape, signed, block, p.device)
            exp_avg, exp_avg_sq, step = new(True), new(False), torch.tensor(0.0)
            for grad in steps:
                step += 1
                single_param_adam(p, grad, step, exp_avg, exp_avg_sq, None, torch.tensor(1e-3), 0.9, 0.999,
                                  1e-2, 1e-8, True, False)
            trained.append(p)
            moments.append([(m.codes, m.scale) if big else m for m in (exp_avg, exp_avg_sq)])
        results[kind] = {"params": trained, "moments": moments}
    torch.save(results, out)
    """
)
OPTIMIZERS = {"fp8": AdamWFp8, "8bit": AdamW8bit, "4bit": AdamW4bit}


def _inputs() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """A 64 × 128 weight (FP8 moments) and a 3 × 100 one (FP32 moments), and gradients over several
    binades, one per step."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(64, 128, generator=g), torch.randn(3, 100, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) * 10.0 ** -(k % 4) for k in range(STEPS)] for p in params]
    return params, grads


def _numscope(
    params: list[torch.Tensor], grads: list[list[torch.Tensor]], kind: str = "fp8"
) -> tuple[list, Any]:
    trained = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = OPTIMIZERS[kind](trained, lr=1e-3)
    for step in range(STEPS):
        for p, steps in zip(trained, grads, strict=True):
            p.grad = steps[step]
        optimizer.step()
    return trained, optimizer


@pytest.fixture(scope="module")
def torchao_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """torchao's eager updates of :func:`_inputs` with each state format, and its maps."""
    if not (PEERS / "torchao").is_dir():
        pytest.skip("./run installs torchao into .venv/peers")
    folder = tmp_path_factory.mktemp("torchao")
    params, grads = _inputs()
    torch.save(([p.clone() for p in params], grads, str(folder / "out.pt")), folder / "in.pt")
    script = folder / "torchao_adam.py"
    script.write_text(TORCHAO)
    env = {"PYTHONPATH": str(PEERS), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, str(script), str(folder / "in.pt")], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(folder / "out.pt", weights_only=False)


@pytest.mark.parametrize("kind", ["fp8", "8bit", "4bit"])
def test_the_update_and_the_moments_are_torchaos_bit_for_bit(torchao_reference, kind: str) -> None:
    """torchao's step is the same code under ``torch.compile``, whose fused kernel rounds some parameters
    1 ulp apart from its own eager run (measured: 1.2e-7 on N(0, 1) weights after 2 steps); numscope runs it
    eagerly, so it is compared with torchao's eager run: the parameters and both moments' codes and scales."""
    params, grads = _inputs()
    reference = torchao_reference[kind]
    trained, optimizer = _numscope(params, grads, kind)
    for mine, theirs in zip(trained, reference["params"], strict=True):
        assert torch.equal(mine.detach(), theirs)
    for p, moments in zip(trained, reference["moments"], strict=True):
        for name, theirs in zip(("exp_avg", "exp_avg_sq"), moments, strict=True):
            mine = optimizer.state[p][name]
            if isinstance(theirs, torch.Tensor):  # a small parameter: FP32 moments
                assert torch.equal(mine, theirs)
                continue
            codes, scale = theirs
            assert torch.equal(mine.codes.view(torch.uint8).flatten(), codes.view(torch.uint8).flatten())
            assert torch.equal(mine.scale, scale)


def test_the_fp8_blocks_and_the_maps_are_torchaos(torchao_reference) -> None:
    _, grads = _inputs()
    mine_codes, mine_scale = quantize_blocks(grads[0][0], 256)
    assert torch.equal(mine_codes.view(torch.uint8), torchao_reference["quantized"][0].view(torch.uint8))
    assert torch.equal(mine_scale, torchao_reference["quantized"][1])
    maps = torchao_reference["maps"]
    assert dynamic_map(True, 8).tolist() == maps["8 signed"]
    assert dynamic_map(False, 8).tolist() == maps["8 unsigned"]
    assert dynamic_map(True, 4).tolist() == maps["4 signed"]
    assert linear_map(4).tolist() == maps["4 unsigned"]


def test_a_map_code_is_the_nearest_value_a_tie_going_up() -> None:
    qmap = dynamic_map(True, 8)
    midpoints = (qmap[:-1] + qmap[1:]) / 2
    nan_block = torch.cat([torch.tensor([float("nan")]), torch.zeros(255)])
    # three blocks of 256, the first two with amax 1 (scale 1): the map, its midpoints and 1; then a NaN
    codes, scale = quantize_map(torch.cat([qmap, midpoints, torch.ones(1), nan_block]), qmap, 256)
    assert scale[:2].tolist() == [1.0, 1.0]
    assert torch.equal(codes[:256].long(), torch.arange(256))  # every map value is its own code
    exact = midpoints - qmap[:-1] == (qmap[1:] - qmap[:-1]) * 0.5  # float32 midpoints that are exact ties
    assert exact.sum() > 100
    assert torch.equal(codes[256:511].long()[exact], torch.arange(1, 256)[exact])  # a tie to the larger
    assert codes[512] == 0  # NaN: the first code, as torchao's search gives


@pytest.mark.parametrize(
    ("kind", "code_bytes", "block"), [("fp8", 1.0, 256), ("8bit", 1.0, 256), ("4bit", 0.5, 128)]
)
def test_the_moments_take_a_quarter_or_an_eighth_of_fp32s_and_resume_exactly(kind, code_bytes, block) -> None:
    params, grads = _inputs()
    trained, optimizer = _numscope(params, grads, kind)
    big, small = (p.numel() for p in params)
    expected = 2 * (big * code_bytes + big // block * 4) + 2 * small * 4  # vs 8 bytes per element
    assert optimizer.state_bytes() == expected
    # two steps, the state dict saved and loaded into a fresh optimizer, the rest: as one run
    resumed = [torch.nn.Parameter(p.clone()) for p in params]
    first = OPTIMIZERS[kind](resumed, lr=1e-3)
    for step in range(2):
        for p, steps in zip(resumed, grads, strict=True):
            p.grad = steps[step]
        first.step()
    second = OPTIMIZERS[kind](resumed, lr=1e-3)
    second.load_state_dict(first.state_dict())
    assert second.state_bytes() == first.state_bytes()  # the codes keep their bytes
    for step in range(2, STEPS):
        for p, steps in zip(resumed, grads, strict=True):
            p.grad = steps[step]
        second.step()
    assert all(torch.equal(a, b) for a, b in zip(trained, resumed, strict=True))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lr": -1.0}, "lr must be"),
        ({"betas": (0.9, 1.0)}, "betas must be"),
        ({"block_size": 0}, "block_size"),
    ],
)
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_bad_settings_are_refused(settings, message, kind) -> None:
    with pytest.raises(OptimizerError, match=message):
        OPTIMIZERS[kind]([torch.nn.Parameter(torch.zeros(4))], **settings)


def test_four_bit_codes_need_an_even_block() -> None:
    with pytest.raises(OptimizerError, match="block_size must be even"):
        AdamW4bit([torch.nn.Parameter(torch.zeros(4))], block_size=63)


@pytest.mark.parametrize(
    ("optimizer", "codes"), [("adamw_fp8", torch.float8_e4m3fn), ("adamw_4bit", torch.uint8)]
)
def test_train_with_low_bit_moments_resumes_from_its_checkpoint_bit_for_bit(
    ws,  # noqa: F811
    monkeypatch,
    optimizer,
    codes,
) -> None:
    """``numscope train --optimizer adamw_fp8`` (or ``adamw_4bit``) on a small BERT whose FFN weights have
    16,384 elements (low-bit moments), crashed after its checkpoint and resumed: the parameters of the run
    that never stopped."""
    from tests.cli.test_cli import cli, flags

    import numscope

    (ws / "wide_bert.py").write_text(WIDE_BERT)
    model = f"{ws / 'wide_bert.py'}:stopping"
    args = [*flags(ws, model), "--plan", "fp8", "--optimizer", optimizer]
    whole = cli("train", *args, "--out", ws / "runs" / optimizer)
    assert whole.code == 0, whole.err
    monkeypatch.setenv("NUMSCOPE_TEST_STOP", "1")
    with pytest.raises(RuntimeError, match="the machine went away"):
        cli("train", *args, "--out", ws / "runs" / f"{optimizer}-resumed")
    monkeypatch.delenv("NUMSCOPE_TEST_STOP")
    state = numscope.load_checkpoint(ws / "runs" / f"{optimizer}-resumed" / "checkpoint.pt")["optimizer"]
    moments = [s["exp_avg"] for s in state["state"].values() if isinstance(s["exp_avg"], dict)]
    assert moments and all(m["codes"].dtype == codes for m in moments)
    resumed = cli("train", *args, "--out", ws / "runs" / f"{optimizer}-resumed")
    assert resumed.code == 0, resumed.err
    first = numscope.load_checkpoint(ws / "runs" / optimizer / "model.pt")["model"]
    second = numscope.load_checkpoint(ws / "runs" / f"{optimizer}-resumed" / "model.pt")["model"]
    assert all(torch.equal(first[name], second[name]) for name in first)
    plain = cli("train", *flags(ws, model), "--plan", "fp8", "--out", ws / "runs" / "adamw")
    assert plain.code == 0, plain.err
    other = numscope.load_checkpoint(ws / "runs" / "adamw" / "model.pt")["model"]
    assert not all(torch.equal(first[name], other[name]) for name in first)  # the moments' rounding shows
    bad = cli("train", *args[:-1], "adam8", "--out", ws / "runs" / "x")
    assert bad.code == 2 and "invalid choice: 'adam8'" in bad.err
