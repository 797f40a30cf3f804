"""What a language model learns from token blocks: masked LM (BERT) or causal LM (GPT), each with its
batches, the count its mean loss averages over, and its evaluation on fixed validation tokens."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from numscope.run.data import (
    DEFAULT_MASK_PROBABILITY,
    IGNORE_INDEX,
    MLMEvaluation,
    batches,
    derive_seed,
    evaluate_mlm,
    num_batches,
)
from numscope.run.tokenizer import TokenizerInfo


class Objective:
    """What a language model learns from token blocks: its batches, its loss's label count, its evaluation."""

    name = ""
    description = ""

    def batches(
        self, blocks: torch.Tensor, batch_size: int, tokenizer: TokenizerInfo, seed: int, epoch: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch of ``input_ids``, ``attention_mask``, ``labels`` batches, a function of (seed, epoch)."""
        raise NotImplementedError

    def for_training(self, mask_probability: float) -> Objective:
        """This objective with a run's training mask probability (``TrainConfig.mask_probability``)."""
        if mask_probability != DEFAULT_MASK_PROBABILITY:
            raise ValueError(
                f"mask_probability {mask_probability:g} applies to the masked LM only; the {self.name} "
                f"objective masks nothing (leave it at {DEFAULT_MASK_PROBABILITY:g})"
            )
        return self

    def label_count(self, batch: dict[str, torch.Tensor]) -> int:
        """How many tokens of ``batch`` the model's mean loss averages over."""
        raise NotImplementedError

    def evaluate(
        self, model: torch.nn.Module, val_blocks: torch.Tensor, tokenizer: TokenizerInfo, seed: int
    ) -> MLMEvaluation:
        """Mean loss (nats per scored token) and top-1 accuracy on the same validation tokens every call."""
        raise NotImplementedError


class MaskedLM(Objective):
    """BERT's masked LM: ``mask_probability`` of the tokens (15% by default) selected (80% [MASK], 10%
    random, 10% kept) and predicted in training; evaluation always scores 15%, BERT's rate."""

    name = "mlm"
    description = "masked language modelling (BERT: predict 15% masked tokens)"

    def __init__(self, mask_probability: float = DEFAULT_MASK_PROBABILITY) -> None:
        if not 0.0 < mask_probability <= 1.0:
            raise ValueError(f"mask probability must be in (0, 1]; got {mask_probability!r}")
        self.mask_probability = mask_probability

    def for_training(self, mask_probability: float) -> Objective:
        return self if mask_probability == self.mask_probability else MaskedLM(mask_probability)

    def batches(
        self, blocks: torch.Tensor, batch_size: int, tokenizer: TokenizerInfo, seed: int, epoch: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        return batches(
            blocks, batch_size, tokenizer, seed, epoch, self.mask_probability, shuffle=True, drop_last=True
        )

    def label_count(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def evaluate(
        self, model: torch.nn.Module, val_blocks: torch.Tensor, tokenizer: TokenizerInfo, seed: int
    ) -> MLMEvaluation:
        return evaluate_mlm(model, val_blocks, tokenizer, batch_size=64, seed=seed)


class CausalLM(Objective):
    """GPT's causal LM: every token predicts the next one; [PAD] positions are neither input nor target."""

    name = "clm"
    description = "causal language modelling (GPT: predict each next token)"

    def batches(
        self, blocks: torch.Tensor, batch_size: int, tokenizer: TokenizerInfo, seed: int, epoch: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(derive_seed(seed, "epoch", epoch))
        order = torch.randperm(blocks.shape[0], generator=generator)
        count = num_batches(blocks.shape[0], batch_size, drop_last=True)
        for start in range(0, count * batch_size, batch_size):
            input_ids = blocks[order[start : start + batch_size]].long()
            padding = input_ids == tokenizer.pad_id
            yield {
                "input_ids": input_ids,
                "attention_mask": (~padding).long(),
                "labels": input_ids.masked_fill(padding, IGNORE_INDEX),
            }

    def label_count(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())  # transformers shifts labels by one

    def evaluate(
        self, model: torch.nn.Module, val_blocks: torch.Tensor, tokenizer: TokenizerInfo, seed: int
    ) -> MLMEvaluation:
        device = next(model.parameters()).device
        total_loss, correct, count = 0.0, 0, 0
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for start in range(0, val_blocks.shape[0], 64):
                    input_ids = val_blocks[start : start + 64].long().to(device)
                    attention_mask = (input_ids != tokenizer.pad_id).long()
                    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
                    targets = input_ids[:, 1:]
                    scored = targets != tokenizer.pad_id
                    chosen, wanted = logits[scored].float(), targets[scored]
                    total_loss += torch.nn.functional.cross_entropy(chosen, wanted, reduction="sum").item()
                    correct += int((chosen.argmax(dim=-1) == wanted).sum())
                    count += int(scored.sum())
        finally:
            model.train(was_training)
        if count == 0:
            raise ValueError(f"the {val_blocks.shape[0]} validation blocks hold no token to predict")
        return MLMEvaluation(loss=total_loss / count, accuracy=correct / count, masked_tokens=count)


OBJECTIVES: dict[str, Objective] = {objective.name: objective for objective in (MaskedLM(), CausalLM())}


def get_objective(name: str | Objective) -> Objective:
    """The objective called ``name`` (``mlm`` or ``clm``); raises ValueError naming the known ones."""
    if isinstance(name, Objective):
        return name
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; known: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]
