"""numscope inside a Hugging Face Trainer: observe, recommend, train under the plan.

    python examples/hf_trainer.py [OUT]    # a tiny BERT on a toy masked-token task; writes into OUT

``NumscopeCallback`` attaches to the model the Trainer trains, measures every GEMM operand in the candidate
formats every few optimizer steps and writes the analysis when training ends; ``numscope.recommend`` turns
it into a plan, and a second Trainer trains under that plan (the callback converts the model).
"""

import sys
from pathlib import Path

import torch
from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

import numscope
from numscope.integrations.huggingface import NumscopeCallback

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/hf-trainer")
VOCAB, MASK_ID = 512, 4


class MaskedTokens(torch.utils.data.Dataset):
    """64 sequences of 32 random tokens, 15% masked, the loss only on those."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(MASK_ID + 1, VOCAB, (64, 32), generator=generator)
        self.masked = torch.rand(self.ids.shape, generator=generator) < 0.15

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, masked = self.ids[i], self.masked[i]
        return {"input_ids": ids.masked_fill(masked, MASK_ID), "labels": ids.masked_fill(~masked, -100)}


def model() -> BertForMaskedLM:
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=64))  # fmt: skip


def train(callback: NumscopeCallback, folder: str) -> None:
    args = TrainingArguments(output_dir=str(OUT / folder), max_steps=8, per_device_train_batch_size=8,
                             learning_rate=2e-3, report_to=[], save_strategy="no", use_cpu=True)  # fmt: skip
    Trainer(model=model(), args=args, train_dataset=MaskedTokens(), callbacks=[callback]).train()


observing = NumscopeCallback(OUT / "analysis", candidates=["bf16", "fp8_e4m3", "fp8_e5m2"], every=4)
train(observing, "fp32")
plan = numscope.recommend(observing.analysis, candidates=["bf16", "fp8_e4m3", "fp8_e5m2"])
plan.save(OUT / "plan.yaml")
train(NumscopeCallback(plan=plan, observe=False), "planned")
print(f"analysis: {OUT / 'analysis'}; plan: {OUT / 'plan.yaml'} ({len(plan.rules)} rules); trained under it")
