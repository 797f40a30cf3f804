"""Median train-step time (forward + backward + AdamW step) of a tiny BERT MLM under several numerics.

Model: BertForMaskedLM, hidden 128, 2 layers, 2 heads, intermediate 512, vocab 8192, seq 128, batch 32,
eager attention. Rows: fp32; bf16 autocast (``torch.autocast("cpu", torch.bfloat16)``); the plans
``fp16`` (+ ``numscope.LossScaler``), ``fp8``, ``mxfp8``, ``mxfp4`` through ``numscope.convert``; torchao's
``convert_to_float8_training`` (emulated) where torchao is installed. Each is printed as a ratio to the
fp32 step, all in one run.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/bench_train_step.py [--steps N] [--warmup W]``
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
from transformers import BertConfig, BertForMaskedLM

import numscope
from numscope.convert import convert

VOCAB, HIDDEN, LAYERS, SEQ, BATCH = 8192, 128, 2, 128, 32


def make_model() -> BertForMaskedLM:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        intermediate_size=4 * HIDDEN,
        max_position_embeddings=SEQ,
        attn_implementation="eager",
    )
    return BertForMaskedLM(config)


def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.where(torch.rand(BATCH, SEQ, generator=generator) < 0.15, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "labels": labels}


def step_fn(model: torch.nn.Module, context: Callable[[], contextlib.AbstractContextManager], scaler=None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs = batch()

    def step() -> None:
        with context():
            loss = model(**inputs).loss
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def median_time(step: Callable[[], None], warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rows() -> list[tuple[str, Callable[[], Callable[[], None]] | None, str]]:
    plain = contextlib.nullcontext
    out: list[tuple[str, Callable[[], Callable[[], None]] | None, str]] = [
        ("fp32", lambda: step_fn(make_model(), plain), ""),
        ("bf16 autocast", lambda: step_fn(make_model(), lambda: torch.autocast("cpu", torch.bfloat16)), ""),
    ]
    try:
        loss_scaler = numscope.LossScaler
    except (AttributeError, ImportError):
        out.append(("fp16 plan + LossScaler", None, "numscope.LossScaler not available"))
    else:
        out.append(
            (
                "fp16 plan + LossScaler",
                lambda: step_fn(convert(make_model(), numscope.Plan.uniform("fp16")), plain, loss_scaler()),
                "",
            )
        )
    for name in ("fp8", "mxfp8", "mxfp4"):
        out.append(
            (
                f"{name} plan",
                lambda name=name: step_fn(convert(make_model(), numscope.Plan.uniform(name)), plain),
                "",
            )
        )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        out.append(("torchao float8 emulate", None, "torchao not installed"))
    else:
        out.append(
            (
                "torchao float8 emulate",
                lambda: step_fn(
                    convert_to_float8_training(make_model(), config=Float8LinearConfig(emulate=True)), plain
                ),
                "",
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(
        f"tiny BERT MLM: hidden {HIDDEN}, {LAYERS} layers, seq {SEQ}, batch {BATCH}, vocab {VOCAB}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.steps} steps"
    )
    baseline = None
    for name, build, note in rows():
        if build is None:
            print(f"{name:28s}  skipped: {note}")
            continue
        seconds = median_time(build(), args.warmup, args.steps)
        baseline = seconds if baseline is None else baseline
        print(f"{name:28s}  {seconds * 1e3:8.1f} ms  {seconds / baseline:5.2f}x fp32")


if __name__ == "__main__":
    main()
