"""Tiny real models the tests share (pytest puts ``tests/`` on the path through its conftest)."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForMaskedLM


def tiny_bert(
    *,
    vocab_size: int = 100,
    layers: int = 2,
    max_position: int = 32,
    impl: str | None = "eager",
    dropout: float = 0.1,
    seed: int = 0,
) -> BertForMaskedLM:
    """A 32-wide BERT masked LM (2 heads, FFN 64), seeded: the same weights on every call with one seed.

    impl: the attention implementation (``eager`` shows its matmuls to site discovery; ``sdpa``; None for
    transformers' default)."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max_position,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        **({"attn_implementation": impl} if impl is not None else {}),
    )
    return BertForMaskedLM(config)
