"""Median train-step time (forward + backward + AdamW step) of a BERT MLM under several numerics.

Model (``--size``): ``tiny`` (default) BertForMaskedLM hidden 128, 2 layers, 2 heads, intermediate 512,
vocab 8192, seq 128, batch 32; ``demo``, the demo's BERT (hidden 128, 2 layers, 4 heads, FFN 256, vocab
2000, seq 32, batch 64, built as the demo builds it: no dropout, the MLM head on the masked positions only,
30% of the tokens masked); ``base``, BERT-base's shape (12 layers, hidden 768, FFN 3072, vocab 30522, seq
128; MPNet-110M's size), batch 8 unless ``--batch``; eager attention. Rows: fp32; bf16 autocast
(``torch.autocast("cpu", torch.bfloat16)``); the plans ``fp16`` (+ ``numscope.LossScaler``), ``fp8``,
``mxfp8``, ``mxfp4``, ``nvfp4`` through ``numscope.convert`` with its defaults (the native quantizers,
bit-identical; element formats through torch's own fp8/fp16 casts, which keep codes for backward), and the
other presets; every named recipe (``numscope recipes``: ``recipe te_nvfp4`` ...) through
``numscope.convert(model, name)``; and for comparison ``fp8`` with ``compiled=True`` (through
``numscope.quantize``: the native quantizers), ``mxfp8`` and ``nvfp4`` with the native quantizers off (the
``torch.compile`` kernels: they compile in the warm-up steps) and ``mxfp8`` eager (both off); the paper's
whole recipe (``numscope.Recipe``: fp16 model with fp32 masters, fp32 ops, fp16 activations, dynamic loss
scaling); torchao's ``convert_to_float8_training(emulate=True)`` where torchao is installed (``pip install
-e '.[bench]'``). ``--rows presets,recipes`` times every preset and every named recipe.
Each is printed as a ratio to the fp32 step, all in one run.

On a shared machine the load drifts: every row is built first, then the rows take one step each in turn,
round after round, so that drift touches all rows alike. Each row prints the median and the minimum over
its rounds, each also as a ratio to fp32's (interference only adds time, so the minimum is the steadier
figure on a busy machine). The load average before and after is printed. ``--profile ROW`` prints
torch.profiler's table for that row instead.

``--pairwise`` keeps two models at a time (the large model's rows do not fit in memory all at once): each
row is timed in rounds interleaved with an fp32 model of its own, and its ratio is to that fp32's median.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/bench_train_step.py [--rounds N] [--warmup W] [--rows a,b]
[--threads T] [--size tiny|demo|base] [--batch B] [--pairwise]`` (one thread is steadier on a loaded
machine: no thread waits at a barrier for a core).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
from transformers import BertConfig, BertForMaskedLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numscope
from _cli import non_negative_int, positive_int
from numscope.convert import convert
from numscope.plan.recipes import RECIPES

#: model and batch sizes by name: the tiny BERT of these benchmarks; the demo's BERT (``demo-bert``: hidden
#: 128, 2 layers, 4 heads, FFN 256, at the demo's batch of 64 blocks of 32 tokens and its 2,000-token
#: vocabulary); BERT-base's shape (12 layers, hidden 768: MPNet-110M's size), at batch 4 × 128 for
#: ``--size base`` here (the observer benchmark uses batch 8)
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"vocab": 8192, "hidden": 128, "layers": 2, "heads": 2, "ffn": 512, "seq": 128, "batch": 32},
    "demo": {"vocab": 2000, "hidden": 128, "layers": 2, "heads": 4, "ffn": 256, "seq": 32, "batch": 64},
    "base": {"vocab": 30522, "hidden": 768, "layers": 12, "heads": 12, "ffn": 3072, "seq": 128, "batch": 8},
}
#: the size the rows build (``--size``) and their batch rows (``--batch``; None: the size's own)
SIZE = "tiny"
ROWS: int | None = None


#: the sizes whose model is the demo's own (``numscope.run.model``: no dropout, the MLM head decoding the
#: masked positions only) and whose batch masks the demo's 30% of the tokens
DEMO_MODEL = {"demo"}


def make_model(size: str | None = None) -> BertForMaskedLM:
    """The size's BERT, seeded: ``transformers``' own (its dropout, the MLM head on every position), or for
    :data:`DEMO_MODEL` sizes the demo's (no dropout, the head on the masked positions only)."""
    from numscope.run.model import ModelConfig, bert_mlm_from_config

    torch.manual_seed(0)
    shape = SIZES[size or SIZE]
    demo = (size or SIZE) in DEMO_MODEL
    return bert_mlm_from_config(
        ModelConfig(
            vocab_size=shape["vocab"],
            hidden=shape["hidden"],
            layers=shape["layers"],
            heads=shape["heads"],
            intermediate=shape["ffn"],
            max_position=shape["seq"],
            dropout=0.0 if demo else BertConfig().hidden_dropout_prob,
            mlm_head="masked" if demo else "all",
        )
    )


def batch(size: str | None = None) -> dict[str, torch.Tensor]:
    shape = SIZES[size or SIZE]
    rows = (ROWS if size is None else None) or shape["batch"]
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab"], (rows, shape["seq"]), generator=generator)
    share = 0.3 if (size or SIZE) in DEMO_MODEL else 0.15
    masked = torch.rand(rows, shape["seq"], generator=generator) < share
    return {"input_ids": ids, "labels": torch.where(masked, ids, torch.full_like(ids, -100))}


def step_fn(
    model: torch.nn.Module,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    scaler: numscope.LossScaler | None = None,
) -> Callable[[], None]:
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


def recipe_step() -> Callable[[], None]:
    model = make_model()
    # glibc's allocator stays as it is: the Recipe's default fixes its mmap threshold for the whole process,
    # which would change every other row's timing too (its own cost: MALLOC_MMAP_THRESHOLD_=131072 in the
    # environment times every row with the threshold fixed)
    recipe = numscope.Recipe(model, return_freed_memory=False)
    optimizer = torch.optim.AdamW(recipe.parameters(), lr=1e-4)
    inputs = batch()

    def step() -> None:
        recipe.backward(model(**inputs).loss)
        recipe.step(optimizer)

    return step


def plan_step(
    name: str, scaler: numscope.LossScaler | None = None, compiled: bool | str = "auto"
) -> Callable[[], None]:
    """A step under a preset plan through ``numscope.convert`` (``compiled="auto"``: its default)."""
    return step_fn(convert(make_model(), numscope.Plan.uniform(name), compiled=compiled), scaler=scaler)


def recipe_plan_step(name: str) -> Callable[[], None]:
    """A step under a named recipe (``numscope recipes``) through ``numscope.convert(model, name)``, its
    sites found on the benchmark's batch (the recipes that keep layers high by their place need them)."""
    inputs = batch()
    example = {key: value[:1] for key, value in inputs.items()}
    return step_fn(convert(make_model(), name, example_inputs=example))


def without_native(build: Callable[[], Callable[[], None]]) -> Callable[[], Callable[[], None]]:
    """A row's builder whose steps (and warm-up) run with numscope's native quantizers off."""

    def built() -> Callable[[], None]:
        step = build()

        def step_without() -> None:
            before = numscope.formats.native_enabled()
            numscope.formats.set_native(False)
            try:
                step()
            finally:
                numscope.formats.set_native(before)

        return step_without

    return built


def torchao_step() -> Callable[[], None]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return step_fn(convert_to_float8_training(make_model(), config=Float8LinearConfig(emulate=True)))


def rows() -> dict[str, Callable[[], Callable[[], None]] | str]:
    """Row name → builder of its step function, or the reason the row cannot run here."""
    out: dict[str, Callable[[], Callable[[], None]] | str] = {
        "fp32": lambda: step_fn(make_model()),
        "bf16 autocast": lambda: step_fn(make_model(), lambda: torch.autocast("cpu", torch.bfloat16)),
        "fp16 plan + LossScaler": lambda: plan_step("fp16", numscope.LossScaler()),
        "fp8 plan": lambda: plan_step("fp8"),
        "mxfp8 plan": lambda: plan_step("mxfp8"),
        "mxfp4 plan": lambda: plan_step("mxfp4"),
        "nvfp4 plan": lambda: plan_step("nvfp4"),
        "fp8 plan (compiled)": lambda: plan_step("fp8", compiled=True),
        "mxfp8 plan (torch.compile)": without_native(lambda: plan_step("mxfp8")),
        "nvfp4 plan (torch.compile)": without_native(lambda: plan_step("nvfp4")),
        "mxfp8 plan (eager)": without_native(lambda: plan_step("mxfp8", compiled=False)),
        "fp16 Recipe (paper)": recipe_step,
    }
    for preset in numscope.Plan.presets():  # the presets without a row above
        if preset != "fp32" and f"{preset} plan" not in out and not out.get(f"{preset} plan + LossScaler"):
            out[f"{preset} plan"] = lambda preset=preset: plan_step(preset)
    for recipe in RECIPES:
        out[f"recipe {recipe}"] = lambda recipe=recipe: recipe_plan_step(recipe)
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        out["torchao float8 emulate"] = "torchao not installed (pip install -e '.[bench]')"
    else:
        out["torchao float8 emulate"] = torchao_step
    return out


def profile(name: str, build: Callable[[], Callable[[], None]], warmup: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step = build()
    for _ in range(warmup):
        step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(f"profile of one '{name}' step")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--warmup", type=non_negative_int, default=2, help="untimed steps per row before the rounds"
    )
    parser.add_argument("--rounds", type=positive_int, default=5, help="timed steps per row, taken in turn")
    parser.add_argument(
        "--rows",
        help="comma-separated row names, or 'presets' / 'recipes' for every preset plan / named recipe "
        "(default: all; fp32 is always first)",
    )
    parser.add_argument("--profile", metavar="ROW", help="profile one step of ROW instead of timing")
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument(
        "--size", choices=tuple(SIZES), default="tiny", help="the model's shape (default: %(default)s)"
    )
    parser.add_argument("--batch", type=positive_int, help="batch rows (default: the size's own)")
    parser.add_argument(
        "--pairwise",
        action="store_true",
        help="two models at a time: each row interleaved with an fp32 model of its own (for --size base)",
    )
    return parser.parse_args(argv)


def timed_rounds(
    builders: dict[str, Callable[[], Callable[[], None]] | str], warmup: int, rounds: int
) -> dict[str, list[float]]:
    """Each buildable row's step times: every row built and warmed up first, then one step of each in
    turn, round after round."""
    steps: dict[str, Callable[[], None]] = {}
    for name, build in builders.items():
        if callable(build):
            steps[name] = build()
            for _ in range(warmup):
                steps[name]()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    args = parse_args()
    global SIZE, ROWS
    SIZE, ROWS = args.size, args.batch
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    available = rows()
    if args.profile is not None:
        build = available.get(args.profile)
        if not callable(build):
            raise SystemExit(f"--profile: unknown or unavailable row {args.profile!r}; rows: {[*available]}")
        profile(args.profile, build, args.warmup)
        return
    groups = {  # --rows shorthands
        "presets": [name for name in available if name.endswith(" plan") or name == "fp16 plan + LossScaler"],
        "recipes": [name for name in available if name.startswith("recipe ")],
    }
    asked = [] if args.rows is None else [part.strip() for part in args.rows.split(",")]
    asked = [row for part in asked for row in groups.get(part, [part])]
    chosen = list(available) if args.rows is None else ["fp32", *asked]
    unknown = [name for name in chosen if name not in available]
    if unknown:
        raise SystemExit(f"--rows: unknown rows {unknown}; rows: {list(available)}")
    chosen = list(dict.fromkeys(chosen))
    load_before = os.getloadavg()[0]
    shape = SIZES[SIZE]
    print(
        f"{SIZE} BERT MLM: hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']} heads, FFN "
        f"{shape['ffn']}, seq {shape['seq']}, batch {ROWS or shape['batch']}, vocab {shape['vocab']}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
        f"{args.warmup} warm-up steps, median of {args.rounds} interleaved rounds"
    )
    print(f"{'row':34s}  {'median':>11s}  {'ratio':>10s}  {'min':>11s}  {'ratio':>10s}")
    batches = [[name] for name in chosen] if args.pairwise else [chosen]
    for names in batches:  # pairwise: one row and a fresh fp32 model at a time
        names = list(dict.fromkeys(["fp32", *names]))
        times = timed_rounds({name: available[name] for name in names}, args.warmup, args.rounds)
        baseline, fastest = statistics.median(times["fp32"]), min(times["fp32"])
        for name in names:
            if name == "fp32" and args.pairwise and len(names) > 1:
                continue  # printed once, as its own row
            if name not in times:
                print(f"{name:34s}  skipped: {available[name]}")
                continue
            median, least = statistics.median(times[name]), min(times[name])
            print(
                f"{name:34s}  {median * 1e3:8.1f} ms  {median / baseline:5.2f}x fp32  "
                f"{least * 1e3:8.1f} ms  {least / fastest:5.2f}x fp32",
                flush=True,
            )
    print(f"load average (1 min): {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
