"""Static plan vs adaptive precision vs the heuristic vs FP32, paired over seeds, through ``numscope train``.

The setting (issue #30's demonstration): the demo's BERT (hidden 128, 2 layers, 4 heads, FFN 256) trained as
the demo trains it on your text, under ``e5m2_grads``: every GEMM's gradient in FP8 E5M2 with no scale of its
own, the rest FP32 (the setting of Micikevicius et al.'s loss-scaling argument; gradients leave E5M2's range
as training goes on). Runs, each from ``--seeds``:

* ``fp32``: the reference;
* ``static``: ``e5m2_grads`` as planned;
* ``loss-scaling``: the heuristic, ``e5m2_grads`` with dynamic loss scaling;
* ``adaptive``: ``e5m2_grads`` with ``--adaptive`` at its defaults (guard armed when met, re-plans);
* ``adaptive-always``: ``--adaptive --guard-arm always --replan-every 0``: the guard alone, from the start.

Writes ``OUT/adaptive_study.md`` (the paired table: each run's validation loss minus FP32's of the same seed,
mean ± sd over seeds, average bits, seconds per step) and ``OUT/adaptive_study.json``; the figure of one
adaptive run's plan history is ``OUT/plan_history-<run>.png`` (``numscope.report.plots.plan_history_figure``).

    python examples/adaptive_study.py --text corpus.txt --out study [--seeds 0 1 2] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BERT = {
    "model_type": "bert",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "max_position_embeddings": 64,
    "attn_implementation": "eager",
}
#: the demo's training (numscope.demo.DemoConfig), validation on 1,024 blocks
TRAINING = {
    "vocab-size": 2000,
    "seq-len": 32,
    "val-blocks": 1024,
    "batch-size": 64,
    "lr": 1.5e-3,
    "warmup-steps": 30,
    "eval-every": 100,
    "checkpoint-every": 100,
    "mask-probability": 0.3,
}
RUNS = {
    "fp32": ["--plan", "fp32"],
    "static": ["--plan", "e5m2_grads"],
    "loss-scaling": ["--plan", "e5m2_grads", "--loss-scaling", "dynamic"],
    "adaptive": ["--plan", "e5m2_grads", "--adaptive"],
    "adaptive-always": ["--plan", "e5m2_grads", "--adaptive", "--guard-arm", "always", "--replan-every", "0"],
}


def train(name: str, seed: int, args: argparse.Namespace) -> dict:
    out = args.out / "runs" / f"{name}-seed{seed}"
    flags = [f"--{k}={v}" for k, v in {**TRAINING, "steps": args.steps, "seed": seed}.items()]
    command = [sys.executable, "-m", "numscope.cli", "train", "--model", str(args.out / "bert.json")]
    command += ["--text", *map(str, args.text), "--cache", str(args.out / "cache"), *flags, *RUNS[name]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    done = subprocess.run(
        [*command, "--out", str(out), "--no-progress"], capture_output=True, text=True, env=env
    )
    if done.returncode:
        raise RuntimeError(f"{name} seed {seed} failed:\n{done.stderr[-2000:]}")
    result = json.loads((out / "result.json").read_text())
    print(
        f"{name} seed {seed}: val loss {result['val_loss']:.4f} ({time.perf_counter() - began:.0f}s)",
        flush=True,
    )
    return {**result, "name": name, "seed": seed, "folder": str(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text", type=Path, nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bert.json").write_text(json.dumps(BERT))
    # the tokenizer and blocks are cached by the first run; the others then read them
    first = train("fp32", args.seeds[0], args)
    jobs = [
        (name, seed) for seed in args.seeds for name in args.runs if (name, seed) != ("fp32", args.seeds[0])
    ]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = [first, *pool.map(lambda job: train(*job, args), jobs)]
    write(results, args)


def write(results: list[dict], args: argparse.Namespace) -> None:
    from numscope.report.plots import plan_history_figure
    from numscope.train.adaptive import read_history

    by = {(r["name"], r["seed"]): r for r in results}
    rows = []
    for name in args.runs:
        gaps = [by[(name, s)]["val_loss"] - by[("fp32", s)]["val_loss"] for s in args.seeds]
        bits = [by[(name, s)]["avg_bits"] for s in args.seeds]
        per_step = [by[(name, s)]["wall_seconds"] / by[(name, s)]["steps"] for s in args.seeds]
        rows.append(
            {
                "run": name,
                "val loss (mean)": statistics.mean(by[(name, s)]["val_loss"] for s in args.seeds),
                "gap to FP32 (paired)": statistics.mean(gaps),
                "sd": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
                "avg bits": statistics.mean(bits),
                "s/step (median)": statistics.median(per_step),
                "gaps": gaps,
            }
        )
    lines = [
        "| run | val loss (mean) | gap to FP32, paired (nats) | avg bits | s/step (median) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        gap = f"{r['gap to FP32 (paired)']:+.4f} ± {r['sd']:.4f}" if r["run"] != "fp32" else "0"
        lines.append(
            f"| {r['run']} | {r['val loss (mean)']:.4f} | {gap} | {r['avg bits']:.2f} "
            f"| {r['s/step (median)']:.3f} |"
        )
    (args.out / "adaptive_study.md").write_text("\n".join(lines) + "\n")
    (args.out / "adaptive_study.json").write_text(json.dumps({"rows": rows, "runs": results}, indent=1))
    print("\n".join(lines))
    for name in ("adaptive", "adaptive-always"):
        if name in args.runs:
            folder = Path(by[(name, args.seeds[0])]["folder"])
            summary = json.loads((folder / "adaptive.json").read_text())
            figure = plan_history_figure(
                [change.row() for change in read_history(folder / "plan_history.csv")],
                summary["bits_from_step"],
                args.steps,
                title=f"{name} (e5m2_grads), seed {args.seeds[0]}",
            )
            (args.out / f"plan_history-{name}.png").write_bytes(figure)


if __name__ == "__main__":
    main()
