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
    val_blocks = val_blocks[: max(64, min(512, val_blocks.shape[0]))]
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
    summary = {"runs": [r.to_dict() for r in results.values()], "out_dir": str(out_dir)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def quick_config(steps: int | None = None) -> DemoConfig:
    config = DemoConfig.quick()
    if steps is not None:
        config = replace(config, train=replace(config.train, steps=steps))
    return config
