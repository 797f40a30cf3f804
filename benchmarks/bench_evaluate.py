"""Median time of a masked-LM evaluation (``numscope.run.data.evaluate_mlm``) with the vocabulary projection
on the scored rows alone against the same evaluation projecting every row, under FP32 and under plans (the
two ways in turn, round after round, after a warm-up).

A ``transformers`` masked LM scores 15% of the positions; ``evaluate_mlm`` runs its output projection
(``get_output_embeddings()``) on those rows only where that gives them bit for bit (no plan, or one that
casts the projection's input element by element: the BF16 a stack keeps its LM head in). This prints, per
row, the median seconds of both ways, their ratio, and whether the two losses are equal (they must be).

Model (``--size``, as ``bench_train_step.py``): ``tiny`` BertForMaskedLM (hidden 128, 2 layers, vocabulary
8,192) or ``base`` (BERT-base's shape, 12 layers, hidden 768, vocabulary 30,522: MPNet-110M's size), random
weights, built by ``bench_train_step.make_model``; ``--blocks`` validation blocks of the size's sequence
length, scored in chunks of 16 as the forecast measures them. Rows (``--rows``): ``fp32``, and each
Transformer Engine recipe given as ``numscope forecast`` measures it (``numscope.forecast.stack_plans``:
modules TE's kernels cannot take at their shape kept high, as the LM head whose vocabulary is not a multiple
of 16; the GEMMs it keeps high in BF16, ``--around bf16``).

Run: ``HF_HUB_OFFLINE=1 python benchmarks/bench_evaluate.py [--size tiny|base] [--blocks N] [--rounds N]
[--threads T] [--rows fp32,te_mxfp8,te_current]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import positive_int
from bench_train_step import SIZES, make_model
from numscope.convert import convert, unconvert
from numscope.forecast import stack_plans
from numscope.plan import OperandSpec
from numscope.run import data as data_module
from numscope.run.tokenizer import TokenizerInfo
from numscope.sites import sites

CHUNK = 16
"""Validation blocks per forward, as ``numscope forecast`` scores them."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("tiny", "base"), default="tiny")
    parser.add_argument("--blocks", type=positive_int, default=32, help="validation blocks (default: 32)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="timed rounds per row (default: 3)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (default: 1)")
    parser.add_argument(
        "--rows", default="fp32,te_mxfp8,te_current", help="fp32 and plans (default: %(default)s)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    model = make_model(args.size).eval()
    vocab = size["vocab"]
    info = TokenizerInfo(vocab_size=vocab, pad_id=0, unk_id=1, cls_id=2, sep_id=3, mask_id=4)
    blocks = torch.randint(5, vocab, (args.blocks, size["seq"]), generator=torch.Generator().manual_seed(0))
    found = [(site.name, site.kind) for site in sites(model, {"input_ids": blocks[:2]})]
    modules = dict(model.named_modules())
    shapes = {name: tuple(modules[name].weight.shape) for name, kind in found if kind == "linear"}
    recipes = {entry.name: entry.plan for entry in stack_plans("te", found, shapes)}
    scored_rows = data_module._scored_rows_decoder

    def once(rows: bool) -> tuple[float, float]:
        data_module._scored_rows_decoder = scored_rows if rows else (lambda _model: None)
        try:
            began = time.perf_counter()
            loss = data_module.evaluate_mlm(model, blocks, info, batch_size=CHUNK).loss
            return time.perf_counter() - began, loss
        finally:
            data_module._scored_rows_decoder = scored_rows

    def timed() -> tuple[float, float, bool]:
        """Both ways in turn, round after round (drift touches both alike): their medians, equal losses."""
        once(True)  # warm-up: finds the sites, builds what the casts reuse
        whole, rows, losses = [], [], set()
        for _ in range(args.rounds):
            for way, times in ((False, whole), (True, rows)):
                seconds, loss = once(way)
                times.append(seconds)
                losses.add(loss)
        return statistics.median(whole), statistics.median(rows), len(losses) == 1

    print(
        f"{args.size}: {args.blocks} blocks of {size['seq']} tokens, vocabulary {vocab}, "
        f"{args.threads} thread(s), {args.rounds} rounds; median seconds"
    )
    print(f"{'row':<14} {'every row':>10} {'scored rows':>12} {'ratio':>7}  equal loss")
    for row in args.rows.split(","):
        if row != "fp32":
            if row not in recipes:
                raise SystemExit(f"--rows: {row!r} is not fp32 or a TE recipe ({', '.join(recipes)})")
            convert(model, recipes[row].with_high_as(OperandSpec("bf16", overflow="propagate")))
        try:
            whole, rows, equal = timed()
        finally:
            if row != "fp32":
                unconvert(model)
        print(f"{row:<14} {whole:>10.2f} {rows:>12.2f} {rows / whole:>7.2f}  {equal}")


if __name__ == "__main__":
    main()
