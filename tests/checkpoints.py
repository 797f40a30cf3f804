"""Checkpoint folders as users bring them, for the tests: a tiny BERT (WordPiece) and a tiny GPT-2 (byte-level
BPE, one special token) saved with ``save_pretrained`` beside their tokenizer, some text, and the command
line run in this process with numscope's notes kept."""

from __future__ import annotations

import contextlib
import io
import json
import random
import warnings
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from numscope.cli import main
from numscope.run.tokenizer import train_tokenizer


def cli(*args: object) -> tuple[int, str, str]:
    """``numscope ARGS`` in this process: exit status, stdout, and stderr with numscope's notes (the
    warnings the console command prints as ``note:`` lines) appended."""
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        try:
            code = main([str(a) for a in args])
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    notes = "".join(f"note: {w.message}\n" for w in caught if issubclass(w.category, UserWarning))
    return code, out.getvalue(), err.getvalue() + notes


def write_text(path: Path, paragraphs: int = 80) -> Path:
    rng = random.Random(0)
    words = ["the", "cat", "dog", "bird", "sees", "likes", "finds", "a", "red", "old", "house", "river"]
    sentence = lambda: " ".join(rng.choice(words) for _ in range(7)) + "."  # noqa: E731
    text = "\n\n".join(" ".join(sentence() for _ in range(5)) for _ in range(paragraphs))
    path.write_text(text, encoding="utf-8")
    return path


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter moved off its initial value (no exact zeros), as a pretrained model's are: a step of
    lr 1e-30 then leaves each bit as it was, which it would not for a zero (0 - 1e-30 is representable)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator) + 0.01)
    return model


def bert_checkpoint(folder: Path, text: Path, head: bool = True) -> Path:
    from transformers import BertConfig, BertForMaskedLM, BertModel

    tokenizer = train_tokenizer(text.read_text().split("\n\n"), 120)
    config = BertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = _perturbed(BertForMaskedLM(config) if head else BertModel(config, add_pooling_layer=False))
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def gpt2_checkpoint(folder: Path, text: Path) -> Path:
    """A tiny GPT-2 with a byte-level BPE tokenizer whose one special token is <|endoftext|>, as GPT-2's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train([str(text)], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special))
    config = GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_embd=32, n_layer=1, n_head=2, n_positions=64)
    torch.manual_seed(0)
    _perturbed(GPT2LMHeadModel(config)).save_pretrained(folder)
    return folder


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))
