"""Check ``numscope forecast`` against trained runs: every plan it predicts, and more, on several seeds.

1. ``numscope forecast`` with ``--seeds N``: the observed FP32 run, FP32 on the other seeds (the noise), the
   predictions for the stack's recipes and numscope's plans;
2. the same measurement on the trained FP32 model for the ``--also`` plans (presets or named recipes);
3. ``numscope train --plan P --seed S`` for every plan on every seed, ``--jobs`` at a time;
4. a table per plan: predicted gap (the forecast's), measured gap (paired with FP32 seed by seed, mean ± sd),
   and whether they agree (both inside FP32's noise, or within the predictor's factor), plus Spearman's rank
   correlation over the plans; ``validation.json`` and ``validation.md`` in ``--out``.

Finished runs are reused on a rerun. Example (the demo's BERT on its corpus, docs/results/forecast.md)::

    python examples/forecast_validation.py --model examples/bert_demo.json --text wiki.txt \\
        --vocab-size 2000 --seq-len 32 --batch-size 32 --steps 300 --lr 2e-3 --val-blocks 256 \\
        --also fp8 mxfp8 mxfp6 mxfp4 nvfp4 int8 --around fp32 --out runs/validate_bert
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def numscope(*args: str, log: Path | None = None) -> None:
    command = [sys.executable, "-m", "numscope.cli", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"numscope {' '.join(args)} failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--text", nargs="+", required=True)
    parser.add_argument("--task", dest="objective", default="auto")
    parser.add_argument("--target", default="te")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--also", nargs="*", default=[], help="more plans to predict and train: presets, recipes, YAML files"
    )
    parser.add_argument(
        "--around",
        default="bf16",
        choices=("bf16", "fp32"),
        help="the forecast's --around: what its plans (the files trained) run around their quantized GEMMs",
    )
    parser.add_argument(
        "--predict-only",
        action="store_true",
        help="stop after the predictions (predictions.json in --out): for plans whose gaps were measured "
        "elsewhere with the same settings",
    )
    parser.add_argument("--skip", nargs="*", default=[], help="forecast plans not to train (e.g. slow ones)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    known, run_flags = parser.parse_known_args()  # the rest: numscope's run flags (--steps, --lr, ...)
    args = known
    out: Path = args.out
    from numscope.forecast import forecast_folder

    base = ["--model", args.model, "--text", *args.text, "--task", args.objective, *run_flags]

    print(f"[validate] forecast ({args.target}, {args.seeds} FP32 seeds)", flush=True)
    numscope(
        "forecast",
        *base,
        "--stacks",
        args.target,
        "--seeds",
        str(args.seeds),
        "--around",
        args.around,
        "--no-progress",
        "--out",
        str(out / "forecast"),
        log=out / "logs" / "forecast.log",
    )
    forecast = json.loads(
        (forecast_folder(out / "forecast", args.target, args.around) / "forecast.json").read_text()
    )
    plans = {row["name"]: row["plan"] for row in forecast["rows"] if row["name"] not in args.skip}
    predicted = {row["name"]: row for row in forecast["rows"]}
    if args.also:
        print(f"[validate] measuring {', '.join(args.also)} on the trained FP32 model", flush=True)
        predicted.update(measure_also(args, run_flags, out, forecast))
        plans.update({_also_name(name): name for name in args.also})
    if args.predict_only:
        (out / "predictions.json").write_text(json.dumps(predicted, indent=1))
        for name, row in predicted.items():
            shown = "fails: " + row["lost"] if row.get("lost") else f"{row['gap']:+.4f}"
            print(f"{name}: {row['bits']:.2f} bits, predicted gap {shown}")
        return

    seed0 = forecast["train"]["seed"]
    seeds = [seed0 + k for k in range(args.seeds)]
    tasks = [(name, plan, seed) for seed in seeds for name, plan in plans.items()]
    print(f"[validate] training {len(tasks)} runs, {args.jobs} at a time", flush=True)

    def train(task: tuple[str, str, int]) -> None:
        name, plan, seed = task
        folder = out / "runs" / name.replace("@", "_at_") / f"seed{seed}"
        if not (folder / "result.json").is_file():
            numscope(
                "train",
                *base,
                "--plan",
                plan,
                "--seed",
                str(seed),
                "--name",
                name,
                "--no-progress",
                "--out",
                str(folder),
                log=out / "logs" / f"{folder.parent.name}-seed{seed}.log",
            )
        print(f"[validate] {name} seed {seed} done", flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(train, tasks))

    fp32 = dict(zip(seeds, forecast["fp32_val_loss"], strict=True))
    noise = statistics.stdev(fp32.values())
    rows = []
    for name in plans:
        losses = [
            json.loads((out / "runs" / name.replace("@", "_at_") / f"seed{s}" / "result.json").read_text())[
                "val_loss"
            ]
            for s in seeds
        ]
        gaps = [loss - fp32[s] for loss, s in zip(losses, seeds, strict=True)]
        row = predicted[name]
        rows.append(
            {
                "name": name,
                "bits": row["bits"],
                "predicted": row["gap"],
                "lost": row.get("lost", ""),
                "forward": row.get("forward"),
                "update": row.get("update"),
                "measured": statistics.fmean(gaps),
                "measured_sd": statistics.stdev(gaps),
                "gaps": gaps,
            }
        )
    from numscope.forecast.predict import agrees

    for row in rows:
        if row["lost"]:
            row["agrees"] = row["measured"] > 2 * noise
        else:
            row["agrees"] = agrees(row["predicted"], row["measured"], noise)
    finite = [r for r in rows if not r["lost"]]
    from scipy.stats import spearmanr

    rho = float(spearmanr([r["predicted"] for r in finite], [r["measured"] for r in finite]).statistic)
    summary = {
        "fp32": fp32,
        "noise": noise,
        "spearman": rho,
        "agree": sum(r["agrees"] for r in rows),
        "plans": len(rows),
        "rows": rows,
        "lr_effective": forecast["lr_effective"],
        "around": args.around,
        "seconds": forecast["seconds"],
    }
    (out / "validation.json").write_text(json.dumps(summary, indent=1))
    lines = [
        f"FP32 validation loss {statistics.fmean(fp32.values()):.4f}, seed sd {noise:.4f} nats ({len(seeds)} "
        f"seeds); agree: both inside ±2 sd, or predicted within 2x of measured",
        "",
        "| plan | avg bits | predicted gap | forward + update | measured gap (mean ± sd) | agree |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["bits"]):
        parts = "fails: " + r["lost"] if r["lost"] else f"{r['forward']:+.4f} + {r['update']:.4f}"
        shown = "fails" if r["lost"] else f"{r['predicted']:+.4f}"
        lines.append(
            f"| {r['name']} | {r['bits']:.2f} | {shown} | {parts} | "
            f"{r['measured']:+.4f} ± {r['measured_sd']:.4f} | {'yes' if r['agrees'] else 'no'} |"
        )
    lines += [
        "",
        f"{summary['agree']} of {len(rows)} agree; Spearman {rho:.2f} over the {len(finite)} predicted",
    ]
    (out / "validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def measure_also(args: argparse.Namespace, run_flags: list[str], out: Path, forecast: dict) -> dict:
    """The forecast's measurement and prediction for the ``--also`` plans, on the forecast's trained model."""
    import torch

    from numscope.analysis import Analysis
    from numscope.cli import build_parser
    from numscope.cli.common import _run_inputs
    from numscope.forecast import PlanEffect, adam_preconditioner, measure_plans, predict
    from numscope.forecast.predict import signal_lost
    from numscope.plan import Plan
    from numscope.run import runner
    from numscope.run.objectives import get_objective
    from numscope.sites import sites
    from numscope.train.checkpoint import load_checkpoint

    flags = build_parser().parse_args(
        [
            "train",
            "--model",
            args.model,
            "--text",
            *args.text,
            "--task",
            args.objective,
            "--plan",
            "fp32",
            "--out",
            "x",
            *run_flags,
        ]
    )
    data, config = _run_inputs(flags)
    folder = out / "forecast"
    prepared, factory, resolved = runner.prepare(args.model, data, config, args.objective)
    state = load_checkpoint(folder / "fp32" / "model.pt")
    model = factory()
    model.load_state_dict(state["model"])
    task = get_objective(resolved)
    stream = task.for_training(config.mask_probability).batches(
        prepared.train_blocks, config.batch_size, prepared.tokenizer, config.seed + 7919, 0
    )
    settings = forecast["settings"]
    batches = [b for _, b in zip(range(settings["batches"]), stream, strict=False)]
    val = prepared.val_blocks[: forecast["measured_blocks"]]
    chunk = max(1, min(16, len(val)))

    def evaluate(m: torch.nn.Module) -> list[float]:
        return [
            task.evaluate(m, part, prepared.tokenizer, config.seed).loss for part in torch.split(val, chunk)
        ]

    names = [s.name for s in sites(model, {k: v for k, v in batches[0].items() if k != "labels"})]
    plans = {_also_name(name): Plan.resolve(name, names) for name in args.also}
    stored_path = out / "also_effects.json"
    stored = json.loads(stored_path.read_text()) if stored_path.is_file() else {}
    todo = {n: p for n, p in plans.items() if n not in stored}
    if todo:
        parameters = [p for p in model.parameters() if p.requires_grad]
        measured = measure_plans(
            model,
            todo,
            batches,
            evaluate,
            adam_preconditioner(parameters, state["optimizer"]),
            clip=config.grad_clip,
            seed=config.seed,
        )
        stored.update({n: e.to_dict() for n, e in measured.items()})
        stored_path.write_text(json.dumps(stored, indent=1))
    analysis = Analysis.load(folder / "fp32" / "analysis")
    sizes: dict = {}
    for (site, gemm, operand), count in analysis.elements.items():
        sizes.setdefault(site, {})[(gemm, operand)] = count
    rows = {}
    for name, plan in plans.items():
        prediction = predict(
            PlanEffect.from_dict(stored[name]), forecast["lr_effective"], lost=signal_lost(analysis, plan)
        )
        rows[name] = {"name": name, "bits": plan.average_bits(sizes), **prediction.to_dict()}
    return rows


def _also_name(spec: str) -> str:
    """An --also plan's name: a file's stem, else the preset or recipe name."""
    return Path(spec).stem if spec.endswith((".yaml", ".yml")) else spec


if __name__ == "__main__":
    main()
