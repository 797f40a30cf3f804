"""What numscope's default path costs beside the FP32 run it replaces, measured side by side in one run.

A user who would train in FP32 runs instead ``numscope analyze`` (FP32 training, observed every K steps, then
each operand's sensitivity on the trained model: the command's defaults), then ``recommend``. This times,
through the command line and on the same model, text and training:

* ``fp32``: ``numscope train --plan fp32`` (the baseline, 1.00x);
* ``analyze``: ``numscope analyze`` with its defaults, split into its observed training (the run's own
  clock) and the rest (the sensitivity measurement, loading, writing);
* ``recommend``: ``numscope recommend RUN --bit-budget B`` on the analysis.

The default model and training are the demo's (BERT hidden 128, 2 layers, 4 heads, FFN 256; a 2,000-token
vocabulary, 32-token blocks, AdamW steps of 64 blocks) for 1,000 steps, the demo's length when the figures
in docs/results/benchmarks.md were measured (``--steps`` sets it); ``--rounds R`` repeats the pair in
alternating
order (fp32 first, then analyze first, ...) and reports medians. Every run is a fresh process with
``--threads`` torch threads; quote the machine's load with the numbers.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/bench_default_path.py [--text corpus.txt] [--rounds 1]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import positive_float, positive_int

DEMO_BERT = {
    "model_type": "bert",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "max_position_embeddings": 512,
    "attn_implementation": "eager",
}


def _timed(args: list[str], threads: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "numscope.cli", *args], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"numscope {args[0]} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", nargs="+", help="text files (default: the demo's corpus)")
    parser.add_argument("--steps", type=positive_int, default=1000)
    parser.add_argument("--rounds", type=positive_int, default=1)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--budget", type=positive_float, default=6.0, help="recommend's --bit-budget")
    parser.add_argument(
        "--every", type=positive_int, default=None, help="analyze --every K (default: analyze's own default)"
    )
    parser.add_argument("--keep", type=Path, default=None, help="copy each analyze run folder here")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as root:
        if args.text is None:  # the demo's corpus as a text file, one summary per paragraph
            from numscope.run.corpus import load_corpus

            corpus = Path(root) / "corpus.txt"
            corpus.write_text("\n\n".join(" ".join(doc.split()) for doc in load_corpus()))
            args.text = [str(corpus)]
        model = Path(root) / "bert.json"
        model.write_text(json.dumps(DEMO_BERT))
        common = ["--model", str(model), "--task", "mlm", "--text", *args.text, "--vocab-size", "2000"]
        common += ["--seq-len", "32", "--batch-size", "64", "--steps", str(args.steps), "--lr", "1.5e-3"]
        common += ["--warmup-steps", "30"]
        common += ["--mask-probability", "0.3", "--no-progress", "--cache", str(Path(root) / "cache")]
        _timed(["train", *common, "--steps", "2", "--plan", "fp32", "--out", str(Path(root) / "warm")], 1)
        rows: dict[str, list[float]] = {"fp32": [], "analyze": [], "observed training": [], "rest": []}
        rows["recommend"] = []
        for index in range(args.rounds):
            order = ("fp32", "analyze") if index % 2 == 0 else ("analyze", "fp32")
            for kind in order:
                out = Path(root) / f"{kind}{index}"
                if kind == "fp32":
                    rows["fp32"].append(
                        _timed(["train", *common, "--plan", "fp32", "--out", str(out)], args.threads)
                    )
                    continue
                every = [] if args.every is None else ["--every", str(args.every)]
                rows["analyze"].append(_timed(["analyze", *common, *every, "--out", str(out)], args.threads))
                trained = json.loads((out / "result.json").read_text())["wall_seconds"]
                rows["observed training"].append(trained)
                rows["rest"].append(rows["analyze"][-1] - trained)
                plan = ["recommend", str(out), "--bit-budget", f"{args.budget:g}", "-o", str(out / "p.yaml")]
                rows["recommend"].append(_timed(plan, args.threads))
                if args.keep is not None:
                    shutil.copytree(out, args.keep / out.name, dirs_exist_ok=True)
    base = statistics.median(rows["fp32"])
    every = "analyze's default --every" if args.every is None else f"--every {args.every}"
    print(
        f"{args.steps} steps, {args.threads} thread(s), {args.rounds} round(s), {every}; medians of "
        "wall-clock seconds"
    )
    print("| stage | seconds | ratio to fp32 |\n|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.0f} | {statistics.median(values) / base:.2f}x |")
    total = statistics.median(a + r for a, r in zip(rows["analyze"], rows["recommend"], strict=True))
    print(f"| analyze + recommend | {total:.0f} | {total / base:.2f}x |")


if __name__ == "__main__":
    main()
