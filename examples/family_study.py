"""numscope's default path on one model family, checked against the rules of thumb at equal bits.

Everything numscope decides goes through its command line, as a user would run it:

1. ``numscope calibrate``: FP32 training observed (every GEMM operand in every candidate format), every
   operand's sensitivity on the trained model, the calibration runs (MXFP4 on one GEMM role at a time and
   everywhere, on every seed) and the gap models fitted on them;
2. ``numscope recommend RUN --bit-budget B --gap-model G`` with no other flag: the default objective
   (measured sensitivity weighted by the calibrated roles, over every measured candidate);
3. ``numscope train --plan P --seed S`` for every plan on every seed, ``--jobs`` at a time.

The plans numscope's is compared with are filled to the same budget by :mod:`numscope.study.plans` from the
analysis (MXFP4 low, MXFP8 high; in the order the model called its sites, never by name): the four
heuristics of the plan study, ``--random-plans`` random orders and the inverse order. FP32 is trained on
every seed too (unobserved), and every plan's gap is paired with it seed by seed. "A beats B" holds when
the mean paired difference exceeds twice its standard deviation (``numscope.study.table.paired_verdict``).

Writes ``family_study.json`` and ``family_study.md`` into ``--out``; a rerun reuses every finished run.
Example (the GQA Llama on CPython's standard library source, docs/results/plan-study.md)::

    python -c "import sysconfig, pathlib; root = pathlib.Path(sysconfig.get_path('stdlib')); \\
        pathlib.Path('stdlib.txt').write_text('\\n\\n'.join(p.read_text(errors='replace') \\
        for p in sorted(root.glob('*.py'))))"
    python examples/family_study.py --model examples/llama_gqa.json --task clm \\
        --text stdlib.txt --out runs/family_llama
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from numscope.study.plans import _slug  # the study's folder and file names

LOW, HIGH = "mxfp4_e2m1", "mxfp8_e4m3"


def _numscope(*args: str, log: Path | None = None) -> str:
    """Run ``numscope ARGS`` (one torch thread, no hub); its output, also written to ``log``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "numscope.cli", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"numscope {' '.join(args[:1])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--task", dest="objective", default="auto")
    parser.add_argument("--text", nargs="+", required=True)
    parser.add_argument("--vocab-size", default="2000")
    parser.add_argument("--seq-len", default="128")
    parser.add_argument("--batch-size", default="16")
    parser.add_argument("--steps", default="300")
    parser.add_argument("--lr", default="1e-3")
    parser.add_argument(
        "--tokenizer", default=None, help="a tokenizer.json to train with (numscope --tokenizer)"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--calibrate-seeds",
        nargs="+",
        type=int,
        default=None,
        help="seeds of the calibration runs (at least two; default: --seeds)",
    )
    parser.add_argument("--budgets", nargs="+", type=float, default=[6.0])
    parser.add_argument("--random-plans", type=int, default=3)
    parser.add_argument("--target", default=None, help="also recommend for this stack (recommend --target)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--sensitivity-formats",
        nargs="+",
        default=["auto"],
        help="calibrate --sensitivity-formats (the Llama study of docs/results/plan-study.md used all)",
    )
    parser.add_argument(
        "--also",
        nargs="+",
        default=["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp6_e3m2", "nvfp4"],
        help="formats calibrated besides MXFP4 (calibrate --also): every other format the analysis measures",
    )
    parser.add_argument(
        "--sensitivity-method",
        default="one-at-a-time",
        choices=("local", "one-at-a-time"),
        help="calibrate --sensitivity-method: the studies of docs/results/plan-study.md measured one at a "
        "time (default: %(default)s)",
    )
    parser.add_argument(
        "--sensitivity-early",
        type=int,
        default=None,
        metavar="STEP",
        help="calibrate --sensitivity-early: measure the sensitivity after STEP steps too (plan-study.md)",
    )
    parser.add_argument(
        "--eval-blocks",
        type=int,
        default=None,
        metavar="N",
        help="score every trained plan on N validation blocks afterwards (numscope evaluate) and compare "
        "those losses: the runs' own evaluations (--val-blocks, default 128) are quick but noisy; the "
        "calibration runs are then scored on N blocks too (calibrate --val-blocks N, once, after the last "
        "step), so that the gap model is fitted to losses of the kind it predicts",
    )
    parser.add_argument(
        "--shuffled",
        type=int,
        default=0,
        metavar="N",
        help="also train N controls of numscope's plan: its formats dealt out again at random among operands "
        "of the same size (the same formats and bits, other places; study.plans.shuffle_formats)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from numscope import workflow
    from numscope.analysis import Analysis
    from numscope.plan import Plan
    from numscope.study.gap_models import GapModel, spearman
    from numscope.study.operands import Operands
    from numscope.study.plans import (
        HEURISTIC_ORDERS,
        fill_order,
        order_inverse,
        order_random,
        plan_of,
        shuffle_formats,
    )
    from numscope.study.table import factor_two_share, paired_verdict

    out: Path = args.out
    common = [
        "--model", args.model, "--task", args.objective, "--text", *args.text,
        "--vocab-size", args.vocab_size, "--seq-len", args.seq_len, "--batch-size", args.batch_size,
        "--steps", args.steps, "--lr", args.lr, "--no-progress",
    ]  # fmt: skip
    if args.tokenizer:
        common += ["--tokenizer", args.tokenizer]
    seeds = [str(s) for s in args.seeds]
    calibrate_seeds = [str(s) for s in (args.calibrate_seeds or args.seeds)]
    print(f"[calibrate] {out / 'calibrate'}", flush=True)
    also = ["--also", *args.also] if args.also else []
    also += ["--sensitivity-formats", *args.sensitivity_formats]
    also += ["--sensitivity-method", args.sensitivity_method]
    if args.sensitivity_early is not None:
        also += ["--sensitivity-early", str(args.sensitivity_early)]
    if args.eval_blocks is not None:
        also += ["--val-blocks", str(args.eval_blocks), "--eval-every", args.steps]
    _numscope("calibrate", *common, "--seed-list", *calibrate_seeds, *also, "--jobs", str(args.jobs),
              "--out", str(out / "calibrate"), log=out / "logs" / "calibrate.txt")  # fmt: skip
    gap_path = out / "calibrate" / "gap_model.json"
    run_folder = out / "calibrate" / "fp32" / f"seed{calibrate_seeds[0]}"
    analysis = Analysis.load(run_folder / "analysis")
    operands = Operands.from_analysis(analysis)
    models = {kind: GapModel.load(gap_path, kind) for kind in ("noise", "sensitivity")}

    plans: dict[str, tuple[str, float | None, str]] = {"fp32": ("reference", None, "fp32")}
    plan_dir = out / "plans"
    plan_dir.mkdir(parents=True, exist_ok=True)
    for budget in args.budgets:
        tag = f"@{budget:g}"
        variants = {f"numscope{tag}": []}
        if args.target:
            variants[f"numscope {args.target}{tag}"] = ["--target", args.target]
        for name, extra in variants.items():
            path = plan_dir / f"{_slug(name)}.yaml"
            flags = ["--bit-budget", f"{budget:g}", "--gap-model", str(gap_path), *extra, "-o", str(path)]
            _numscope("recommend", str(run_folder), *flags, log=path.with_suffix(".txt"))
            plans[name] = ("numscope", budget, str(path))
        if args.shuffled:
            ours = Plan.load(plans[f"numscope{tag}"][2])
            chosen = {k: ours.for_site(k[0]).operand(k[1], k[2]) for k in operands.keys}
        for index in range(args.shuffled):
            name = f"numscope shuffled {index + 1}{tag}"
            path = plan_dir / f"{_slug(name)}.yaml"
            seed = int(1000 * budget) * 100 + 50 + index
            plan_of(shuffle_formats(chosen, operands, seed), name).save(path)
            plans[name] = ("control", budget, str(path))
        orders = {name: ("heuristic", order(operands)) for name, order in HEURISTIC_ORDERS.items()}
        for index in range(args.random_plans):
            seed = int(1000 * budget) * 100 + index  # the plan study's random orders
            orders[f"random {index + 1}"] = ("random", order_random(operands, seed))
        orders["inverse"] = ("inverse", order_inverse(analysis, operands, LOW, HIGH))
        for name, (family, order) in orders.items():
            path = plan_dir / f"{_slug(name + tag)}.yaml"
            plan_of(fill_order(order, operands, budget, LOW, HIGH), name).save(path)
            plans[name + tag] = (family, budget, str(path))

    tasks = [(name, seed) for name in plans for seed in args.seeds]
    print(f"[train] {len(plans)} plans × {len(args.seeds)} seeds, {args.jobs} at a time", flush=True)

    def train(task: tuple[str, int]) -> float:
        name, seed = task
        folder = out / "runs" / _slug(name) / f"seed{seed}"
        result = folder / "result.json"
        if not result.exists():
            _numscope("train", *common, "--plan", plans[name][2], "--seed", str(seed), "--name", name,
                      "--out", str(folder), log=folder.parent / f"seed{seed}.txt")  # fmt: skip
        loss = float(json.loads(result.read_text())["val_loss"])
        if args.eval_blocks is not None:
            scored = folder / "evaluations.json"
            if not scored.exists() or str(args.eval_blocks) not in json.loads(scored.read_text()):
                _numscope("evaluate", str(folder), "--val-blocks", str(args.eval_blocks),
                          *(["--tokenizer", args.tokenizer] if args.tokenizer else []))  # fmt: skip
            loss = float(json.loads(scored.read_text())[str(args.eval_blocks)]["val_loss"])
        print(f"  {name} seed {seed}: {loss:.4f}", flush=True)
        return loss

    with ThreadPoolExecutor(args.jobs) as pool:
        losses = dict(zip(tasks, pool.map(train, tasks), strict=True))

    fp32 = np.array([losses[("fp32", s)] for s in args.seeds])
    rows = []
    for name, (family, budget, path) in plans.items():
        plan = Plan.named(path) if not path.endswith(".yaml") else Plan.load(path)
        gaps = np.array([losses[(name, s)] for s in args.seeds]) - fp32
        row = {
            "name": name,
            "family": family,
            "budget": budget,
            "bits": workflow.analysis_average_bits(plan, analysis),
            "gaps": gaps.tolist(),
            "gap_mean": float(gaps.mean()),
            "gap_sd": float(gaps.std(ddof=1)),
            "vs_fp32": paired_verdict(gaps),
        }
        for kind, model in models.items():
            row[f"predicted_{kind}"] = model.predict_plan(analysis, plan)
        row["extrapolated"] = models["sensitivity"].uncalibrated(analysis, plan)
        specs = [plan.for_site(k[0]).operand(k[1], k[2]) for k in operands.keys]
        row["formats"] = sorted({s.format_spec().name if s.format_spec() else s.format for s in specs})
        rows.append(row)
    for budget in args.budgets:
        group = [r for r in rows if r["budget"] == budget]
        ours = next(r for r in group if r["name"] == f"numscope@{budget:g}")
        for row in group:
            row["vs_numscope"] = paired_verdict(np.array(row["gaps"]) - np.array(ours["gaps"]))
    scored = [r for r in rows if r["family"] != "reference"]
    summary = {
        kind: {
            "spearman": spearman([r[f"predicted_{kind}"] for r in scored], [r["gap_mean"] for r in scored]),
            "within_factor_two": factor_two_share(scored, f"predicted_{kind}"),
        }
        for kind in models
    }
    calibrated = json.loads(gap_path.read_text())
    extrapolated = sorted({f for r in rows for f in r["extrapolated"]})
    scored_on = (
        f"losses on up to {args.eval_blocks} validation blocks (numscope evaluate); "
        if args.eval_blocks
        else ""
    )
    lines = [
        f"model {args.model}, objective {args.objective}, text {' '.join(args.text)}; {args.steps} steps of "
        f"{args.batch_size} × {args.seq_len} tokens, lr {args.lr}, seeds {' '.join(seeds)}",
        scored_on
        + f"FP32 validation loss {fp32.mean():.4f} ± {fp32.std(ddof=1):.4f} nats (sd over seeds); gaps "
        "paired with FP32 seed by seed, mean ± sd; verdicts at 2 sd of the paired differences.",
        f"gap models calibrated on seeds {' '.join(calibrate_seeds)}, {calibrated.get('low', LOW)} "
        "(one GEMM role at a time and everywhere) and "
        f"{', '.join(calibrated.get('also', [])) or 'no other format'} (everywhere): noise "
        f"{models['noise'].formula()}; sensitivity {models['sensitivity'].formula()}"
        + (f"; predictions extrapolate to {', '.join(extrapolated)}" if extrapolated else ""),
        "",
        "| plan | family | avg bits | gap to FP32 (nats) | vs FP32 | vs numscope | predicted (sensitivity) "
        "| predicted (noise) | formats |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: (r["budget"] or 0, r["gap_mean"])):
        lines.append(
            f"| {row['name']} | {row['family']} | {row['bits']:.2f} | {row['gap_mean']:+.4f} ± "
            f"{row['gap_sd']:.4f} | {row['vs_fp32']} | {row.get('vs_numscope', '')} | "
            f"{row['predicted_sensitivity']:+.4f} | {row['predicted_noise']:+.4f} | "
            f"{', '.join(row['formats'])} |"
        )
    for kind, values in summary.items():
        rho = values["spearman"]
        lines.append(
            f"\n{kind} gap model: Spearman {rho:.2f} with the measured gaps" if math.isfinite(rho) else ""
        )
        lines.append(
            f"predicted within a factor 2 of the measured gap, of the plans whose gap is beyond 2 sd: "
            f"{values['within_factor_two']}"
        )
    table = "\n".join(lines)
    (out / "family_study.md").write_text(table + "\n")
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "summary": summary}
    (out / "family_study.json").write_text(json.dumps(payload, indent=1))
    print(table)


if __name__ == "__main__":
    main()
