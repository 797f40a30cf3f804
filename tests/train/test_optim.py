"""AdamW with FP8 moments (:class:`numscope.train.AdamWFp8`) against torchao's own: the update
(``single_param_adam``) run eagerly by torchao on its FP8 state subclass, in a subprocess with torchao on the
path; the memory of the moments; a resume from the optimizer's state dict."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tests.test_cli import ws  # noqa: F401 (the CLI tests' workspace fixture)

from numscope.train.optim import AdamWFp8, OptimizerError, quantize_blocks

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
    from torchao.optim.subclass_fp8 import OptimStateFp8, quantize_fp8

    params, grads, out = torch.load(sys.argv[1])
    results = {"params": [], "exp_avg": [], "quantized": quantize_fp8(grads[0][0], 256)}
    for p, steps in zip(params, grads):
        big = p.numel() >= 4096 and p.numel() % 256 == 0
        new = (lambda: OptimStateFp8.zeros(p.shape, 256, p.device)) if big else (lambda: torch.zeros_like(p))
        exp_avg, exp_avg_sq, step = new(), new(), torch.tensor(0.0)
        for grad in steps:
            step += 1
            single_param_adam(p, grad, step, exp_avg, exp_avg_sq, None, torch.tensor(1e-3), 0.9, 0.999,
                              1e-2, 1e-8, True, False)
        results["params"].append(p)
        results["exp_avg"].append((exp_avg.codes, exp_avg.scale) if big else exp_avg)
    torch.save(results, out)
    """
)


def _inputs() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """A 64 × 128 weight (FP8 moments) and a 3 × 100 one (FP32 moments), and gradients over several
    binades, one per step."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(64, 128, generator=g), torch.randn(3, 100, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) * 10.0 ** -(k % 4) for k in range(STEPS)] for p in params]
    return params, grads


def _numscope(params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> tuple[list, AdamWFp8]:
    trained = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = AdamWFp8(trained, lr=1e-3)
    for step in range(STEPS):
        for p, steps in zip(trained, grads, strict=True):
            p.grad = steps[step]
        optimizer.step()
    return trained, optimizer


@pytest.mark.skipif(not (PEERS / "torchao").is_dir(), reason="./run installs torchao into .venv/peers")
def test_the_update_and_the_moments_are_torchaos_bit_for_bit(tmp_path: Path) -> None:
    """torchao's step is the same code under ``torch.compile``, whose fused kernel rounds some parameters
    1 ulp apart from its own eager run (measured: 1.2e-7 on N(0, 1) weights after 2 steps); numscope runs it
    eagerly, so it is compared with torchao's eager run."""
    params, grads = _inputs()
    torch.save(([p.clone() for p in params], grads, str(tmp_path / "out.pt")), tmp_path / "in.pt")
    script = tmp_path / "torchao_adam.py"
    script.write_text(TORCHAO)
    env = {"PYTHONPATH": str(PEERS), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "in.pt")], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reference = torch.load(tmp_path / "out.pt", weights_only=False)
    trained, optimizer = _numscope(params, grads)
    for mine, theirs in zip(trained, reference["params"], strict=True):
        assert torch.equal(mine.detach(), theirs)
    big = optimizer.state[trained[0]]["exp_avg"]
    codes, scale = reference["exp_avg"][0]
    assert torch.equal(big.codes.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(big.scale, scale)
    assert torch.equal(optimizer.state[trained[1]]["exp_avg"], reference["exp_avg"][1])
    mine_codes, mine_scale = quantize_blocks(grads[0][0], 256)
    assert torch.equal(mine_codes.view(torch.uint8), reference["quantized"][0].view(torch.uint8))
    assert torch.equal(mine_scale, reference["quantized"][1])


def test_the_moments_take_a_quarter_of_fp32s_and_resume_exactly() -> None:
    params, grads = _inputs()
    trained, optimizer = _numscope(params, grads)
    big, small = (p.numel() for p in params)
    assert optimizer.state_bytes() == 2 * (big + big // 256 * 4) + 2 * small * 4  # vs 8 bytes per element
    # two steps, the state dict saved and loaded into a fresh optimizer, the rest: as one run
    resumed = [torch.nn.Parameter(p.clone()) for p in params]
    first = AdamWFp8(resumed, lr=1e-3)
    for step in range(2):
        for p, steps in zip(resumed, grads, strict=True):
            p.grad = steps[step]
        first.step()
    second = AdamWFp8(resumed, lr=1e-3)
    second.load_state_dict(first.state_dict())
    assert second.state_bytes() == first.state_bytes()  # the codes stay one byte each
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
def test_bad_settings_are_refused(settings, message) -> None:
    with pytest.raises(OptimizerError, match=message):
        AdamWFp8([torch.nn.Parameter(torch.zeros(4))], **settings)


def test_train_with_fp8_moments_resumes_from_its_checkpoint_bit_for_bit(ws, monkeypatch) -> None:  # noqa: F811
    """``numscope train --optimizer adamw_fp8`` on a small BERT whose FFN weights have 16,384 elements (FP8
    moments), crashed after its checkpoint and resumed: the parameters of the run that never stopped."""
    from tests.test_cli import cli, flags

    import numscope

    (ws / "wide_bert.py").write_text(WIDE_BERT)
    model = f"{ws / 'wide_bert.py'}:stopping"
    args = [*flags(ws, model), "--plan", "fp8", "--optimizer", "adamw_fp8"]
    whole = cli("train", *args, "--out", ws / "runs" / "fp8-moments")
    assert whole.code == 0, whole.err
    monkeypatch.setenv("NUMSCOPE_TEST_STOP", "1")
    with pytest.raises(RuntimeError, match="the machine went away"):
        cli("train", *args, "--out", ws / "runs" / "fp8-moments-resumed")
    monkeypatch.delenv("NUMSCOPE_TEST_STOP")
    state = numscope.load_checkpoint(ws / "runs" / "fp8-moments-resumed" / "checkpoint.pt")["optimizer"]
    moments = [s["exp_avg"] for s in state["state"].values() if isinstance(s["exp_avg"], dict)]
    assert moments and all(m["codes"].dtype == torch.float8_e4m3fn for m in moments)
    resumed = cli("train", *args, "--out", ws / "runs" / "fp8-moments-resumed")
    assert resumed.code == 0, resumed.err
    first = numscope.load_checkpoint(ws / "runs" / "fp8-moments" / "model.pt")["model"]
    second = numscope.load_checkpoint(ws / "runs" / "fp8-moments-resumed" / "model.pt")["model"]
    assert all(torch.equal(first[name], second[name]) for name in first)
    plain = cli("train", *flags(ws, model), "--plan", "fp8", "--out", ws / "runs" / "adamw")
    assert plain.code == 0, plain.err
    other = numscope.load_checkpoint(ws / "runs" / "adamw" / "model.pt")["model"]
    assert not all(torch.equal(first[name], other[name]) for name in first)  # the moments' rounding shows
    bad = cli("train", *args[:-1], "adam8", "--out", ws / "runs" / "x")
    assert bad.code == 2 and "invalid choice: 'adam8'" in bad.err
