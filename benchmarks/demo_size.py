"""How far the demo's FP32 BERT learns from context at a given size: the measurements behind its defaults.

Trains the demo's FP32 run (``numscope demo``'s data, model and loop) from each ``--seeds`` seed with the
sizes given, every other setting at the demo's default, and prints per run the validation loss, the
context-free loss (the training text's token frequencies, scored on the same masked tokens) and the
difference: how much the model learned from context. Issue 10 asks for at least 0.5 nats within the demo's
ten minutes. ``--plan`` trains another plan instead of FP32 (e.g. to see whether it escapes the
context-free plateau as FP32 does).

Run: ``HF_HUB_OFFLINE=1 python benchmarks/demo_size.py [--steps N] [--vocab-size V] [--seq-len L]
[--batch-size B] [--heads H] [--lr LR] [--mask-probability P] [--val-blocks N] [--seeds 0 1 2]``

Each run takes one thread; ``--jobs 2`` trains two at once. Wall times depend on the machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import positive_float, positive_int, probability

LOSS_SCALING = ("none", "static", "dynamic")  # numscope.run.config.LOSS_SCALING (tested equal)
SIZES = ("steps", "batch_size", "hidden", "layers", "heads", "intermediate", "seq_len", "vocab_size")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in SIZES:
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=positive_int, help="the demo's default if absent"
        )
    parser.add_argument("--lr", type=positive_float, help="peak learning rate (the demo's if absent)")
    parser.add_argument("--mask-probability", type=probability, help="training share of masked tokens")
    parser.add_argument("--val-blocks", type=positive_int, help="validation blocks (the demo's if absent)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds to train from (default 0)")
    parser.add_argument("--plan", default="fp32", help="the plan to train (default fp32)")
    parser.add_argument(
        "--loss-scaling", choices=LOSS_SCALING, default="none", help="loss scaling (default none)"
    )
    parser.add_argument("--jobs", type=positive_int, default=1, help="runs at once, one thread each")
    return parser.parse_args(argv)


def config_from(args: argparse.Namespace):  # -> DemoConfig
    from numscope.demo.main import DemoConfig

    config = DemoConfig()
    train = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr}
    train["mask_probability"] = args.mask_probability
    train = {key: value for key, value in train.items() if value is not None}
    if "steps" in train:
        train["eval_every"] = min(config.train.eval_every, train["steps"])
    sizes = {name: getattr(args, name) for name in SIZES[2:] if getattr(args, name) is not None}
    if args.val_blocks is not None:
        sizes["val_blocks"] = args.val_blocks
    return replace(config, train=replace(config.train, **train), **sizes)


def main() -> None:
    args = parse_args()
    import torch

    from numscope.demo.main import model_config, prepare_demo_data
    from numscope.run.config import RunSpec
    from numscope.run.data import unigram_loss
    from numscope.run.pool import RunPool

    torch.set_num_threads(1)
    config = config_from(args)
    data = prepare_demo_data(config)
    print(
        f"{config.layers} layers, hidden {config.hidden}, {config.heads} heads, FFN {config.intermediate}; "
        f"vocabulary {data.tokenizer.vocab_size}, blocks of {config.seq_len} tokens, {config.train.steps} "
        f"steps of {config.train.batch_size}, lr {config.train.lr:g}, {config.train.mask_probability:.0%} "
        f"masked in training; {data.val_blocks.shape[0]} validation blocks; plan {args.plan}, loss scaling "
        f"{args.loss_scaling}"
    )
    below = []
    with tempfile.TemporaryDirectory() as folder, RunPool(data, args.jobs, 1) as pool:
        started = time.perf_counter()
        for seed in args.seeds:
            train = replace(config.train, seed=seed)
            model = replace(model_config(config, data), seed=seed)
            spec = RunSpec(f"seed{seed}", args.plan, args.loss_scaling)
            pool.add(spec.name, spec=spec, model_config=model, cfg=train, out_dir=Path(folder) / spec.name)
        results = dict(pool.next_finished() for _ in args.seeds)
        wall = time.perf_counter() - started
    print("| seed | val loss | context-free | below context-free |")
    print("| --- | --- | --- | --- |")
    for seed in args.seeds:
        result = results[f"seed{seed}"]
        free = unigram_loss(data.train_blocks, data.val_blocks, data.tokenizer, seed)
        below.append(free - result.val_loss)
        print(f"| {seed} | {result.val_loss:.3f} | {free:.3f} | {free - result.val_loss:+.3f} |")
    spread = f" ± {statistics.stdev(below):.3f} (sd)" if len(below) > 1 else ""
    print(f"below context-free: mean {statistics.fmean(below):+.3f}{spread}; {wall:.0f} s for all runs")


if __name__ == "__main__":
    main()
