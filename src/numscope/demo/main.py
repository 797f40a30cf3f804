"""``numscope demo``: BERT masked-LM trained under the classic recipes and under a measured plan.

Stages (each skipped when its output exists, so an interrupted demo resumes):

1. data — corpus split, WordPiece tokenizer (cached), token blocks;
2. ``fp32`` — the reference run, observed every few steps: the *analysis* of every GEMM operand;
3. ``recommended`` — ``numscope.recommend(analysis)`` writes ``plan.yaml``, then a run under it;
4. the baselines — ``bf16``, ``fp16`` without loss scaling, ``fp16`` with dynamic loss scaling, ``fp8``
   (hybrid E4M3/E5M2, per-tensor scaling), ``mxfp4``;
5. ``report.html`` and the final table.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from numscope.demo.corpus import load_corpus, split_corpus
from numscope.demo.data import load_or_make_blocks
from numscope.demo.experiment import DemoData, RunResult, RunSpec, TrainConfig, train_run
from numscope.demo.model import ModelConfig
from numscope.demo.tokenizer import TokenizerInfo, load_or_train_tokenizer
from numscope.plan import Plan


@dataclass(frozen=True)
class DemoConfig:
    """Everything that sizes the demo. ``quick()`` keeps every stage with fewer steps."""

    train: TrainConfig = field(default_factory=TrainConfig)
    hidden: int = 128
    layers: int = 2
    heads: int = 2
    intermediate: int = 512
    seq_len: int = 64
    vocab_size: int = 8000
    max_train_blocks: int | None = None
    val_blocks: int = 128
    observe_every: int = 10
    candidates: tuple[str, ...] = (
        "bf16",
        "fp16",
        "fp8_e4m3",
        "fp8_e5m2",
        "int8",
        "mxfp8_e4m3",
        "mxfp8_e5m2",
        "mxfp6_e3m2",
        "mxfp4_e2m1",
        "nvfp4",
    )

    @classmethod
    def quick(cls) -> DemoConfig:
        return cls(
            train=TrainConfig(steps=40, batch_size=16, warmup_steps=5, eval_every=10, checkpoint_every=20),
            seq_len=64,
            vocab_size=4000,
            max_train_blocks=2000,
            observe_every=5,
        )


BASELINES: tuple[RunSpec, ...] = (
    RunSpec("bf16", "bf16", description="every GEMM operand in bf16"),
    RunSpec("fp16", "fp16", description="every GEMM operand in fp16, no loss scaling"),
    RunSpec("fp16+scaling", "fp16", "dynamic", description="fp16 with dynamic loss scaling (init 2^16)"),
    RunSpec("fp8", "fp8", description="TE hybrid: E4M3 forward, E5M2 gradients, per-tensor scaling"),
    RunSpec("mxfp4", "mxfp4", description="every GEMM operand in MXFP4"),
)


def prepare_data(
    config: DemoConfig, text_paths: Sequence[Path] | None = None, cache_dir: Path | None = None
) -> DemoData:
    documents = load_corpus(list(text_paths) if text_paths else None)
    train_docs, val_docs = split_corpus(documents)
    tokenizer = load_or_train_tokenizer(train_docs, config.vocab_size, cache_dir)
    info = TokenizerInfo.from_tokenizer(tokenizer)
    train_blocks = load_or_make_blocks(train_docs, tokenizer, config.seq_len, cache_dir)
    val_blocks = load_or_make_blocks(val_docs, tokenizer, config.seq_len, cache_dir)
    if config.max_train_blocks is not None:
        train_blocks = train_blocks[: config.max_train_blocks]
    val_blocks = val_blocks[: min(config.val_blocks, val_blocks.shape[0])]
    return DemoData(train_blocks, val_blocks, info)


def model_config(config: DemoConfig, data: DemoData) -> ModelConfig:
    return ModelConfig(
        vocab_size=data.tokenizer.vocab_size,
        hidden=config.hidden,
        layers=config.layers,
        heads=config.heads,
        intermediate=config.intermediate,
        max_position=config.seq_len,
        pad_token_id=data.tokenizer.pad_id,
        seed=config.train.seed,
    )


def run_demo(
    out_dir: Path,
    config: DemoConfig,
    text_paths: Sequence[Path] | None = None,
    log: Callable[[str], None] = print,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every stage into ``out_dir``; returns the summary that ``summary.json`` holds."""
    from numscope.advisor import recommend
    from numscope.observe import observe

    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"[data] corpus, tokenizer (vocab {config.vocab_size}), {config.seq_len}-token blocks")
    data = prepare_data(config, text_paths)
    log(f"[data] {data.train_blocks.shape[0]} training blocks, {data.val_blocks.shape[0]} validation blocks")
    mcfg = model_config(config, data)
    results: dict[str, RunResult] = {}

    def run(spec: RunSpec, observer_factory=None) -> RunResult:
        bar = tqdm(total=config.train.steps, desc=f"{spec.name:>13}", disable=not progress, leave=True)

        def on_step(step: int, loss: float) -> None:
            bar.n = step
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            bar.refresh()

        result = train_run(
            spec, mcfg, config.train, data, out_dir / "runs" / spec.name, on_step, observer_factory
        )
        bar.n = config.train.steps
        bar.close()
        results[spec.name] = result
        return result

    def fp32_observer(model: torch.nn.Module):
        observer = observe(model, candidates=list(config.candidates), every=config.observe_every)
        return observer.__enter__()

    run(RunSpec("fp32", "fp32", description="the reference: every GEMM in fp32"), fp32_observer)
    from numscope.analysis import Analysis

    analysis = Analysis.load(out_dir / "runs" / "fp32" / "analysis")
    plan_path = out_dir / "plan.yaml"
    if not plan_path.exists():
        plan = recommend(analysis)
        plan.save(plan_path)
    run(RunSpec("recommended", str(plan_path), description="numscope's plan from the fp32 analysis"))
    for spec in BASELINES:
        run(spec)
    sizes: dict[str, dict[tuple[str, str], int]] = {}
    for (site, gemm, operand), count in analysis.elements.items():
        sizes.setdefault(site, {})[(gemm, operand)] = count
    rows = []
    for result in results.values():
        row = result.to_dict()
        row["avg_bits"] = RunSpec(result.name, result.plan).load_plan().average_bits(sizes)
        row["train_log"] = _train_log(out_dir / "runs" / result.name / "log.csv")
        rows.append(row)
    from numscope.report import write_report

    report = write_report(
        out_dir / "report.html",
        title="numscope demo: BERT masked LM",
        runs=rows,
        analysis=analysis,
        plan=Plan.load(plan_path),
        notes=_claims(rows),
        command="numscope demo",
    )
    summary = {"runs": rows, "out_dir": str(out_dir), "report": str(report)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def quick_config(steps: int | None = None) -> DemoConfig:
    config = DemoConfig.quick()
    if steps is not None:
        config = replace(config, train=replace(config.train, steps=steps))
    return config


def _train_log(path: Path) -> list[dict[str, float]]:
    import csv

    with path.open(newline="") as f:
        return [
            {
                "step": int(r["step"]),
                "loss": float(r["loss"]),
                "scale": float(r["scale"]),
                "skipped": int(r["skipped"]),
            }
            for r in csv.DictReader(f)
        ]


def _claims(rows: list[dict[str, Any]]) -> list[str]:
    """The demo's claims, checked against what this run measured (stated either way)."""
    by = {r["name"]: r for r in rows}
    fp32 = by["fp32"]["val_loss"]
    notes = []
    gap = lambda name: 100.0 * (by[name]["val_loss"] - fp32) / fp32  # noqa: E731
    rec, fp8 = by["recommended"], by["fp8"]
    held = gap("recommended") <= 1.0 and rec["avg_bits"] < fp8["avg_bits"]
    notes.append(
        f"Recommended plan: gap to FP32 {gap('recommended'):+.2f}% at {rec['avg_bits']:.2f} average bits per "
        f"operand element, against uniform FP8's {fp8['avg_bits']:.2f} bits — the claim (within 1% "
        f"using fewer bits than FP8) {'holds' if held else 'does NOT hold'} in this run."
    )
    notes.append(
        f"FP16 without loss scaling: gap {gap('fp16'):+.2f}%; with dynamic loss scaling: gap "
        f"{gap('fp16+scaling'):+.2f}% ({by['fp16+scaling']['skipped_steps']} skipped steps)."
    )
    notes.append(f"MXFP4 everywhere: gap {gap('mxfp4'):+.2f}% at {by['mxfp4']['avg_bits']:.2f} bits.")
    return notes


def summary_table(summary: dict[str, Any]) -> list[dict[str, str]]:
    rows = summary["runs"]
    fp32 = next(r for r in rows if r["name"] == "fp32")["val_loss"]
    return [
        {
            "run": r["name"],
            "val loss": f"{r['val_loss']:.4f}",
            "val acc": f"{100 * r['val_accuracy']:.2f}%",
            "gap to fp32": f"{100 * (r['val_loss'] - fp32) / fp32:+.2f}%",
            "avg bits": f"{r['avg_bits']:.2f}",
            "skipped": str(r["skipped_steps"]),
            "wall": f"{r['wall_seconds']:.0f}s",
        }
        for r in rows
    ]
