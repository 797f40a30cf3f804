"""Tiny real models the tests share (pytest puts ``tests/`` on the path through its conftest)."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel


def tiny_bert(
    *,
    vocab_size: int = 100,
    layers: int = 2,
    hidden: int = 32,
    max_position: int = 32,
    impl: str | None = "eager",
    dropout: float = 0.1,
    seed: int = 0,
) -> BertForMaskedLM:
    """A BERT masked LM ``hidden`` wide (2 heads, FFN 2 × hidden), seeded: the same weights on every call
    with one seed.

    impl: the attention implementation (``eager`` shows its matmuls to site discovery; ``sdpa``; None for
    transformers' default)."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=max_position,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        **({"attn_implementation": impl} if impl is not None else {}),
    )
    return BertForMaskedLM(config)


def tiny_gpt2(
    *,
    vocab_size: int = 100,
    layers: int = 2,
    positions: int = 32,
    impl: str | None = "eager",
    dropout: float = 0.1,
    seed: int | None = 0,
) -> GPT2LMHeadModel:
    """A 32-wide GPT-2 causal LM (2 heads), seeded with ``seed`` (None: the caller's random state, as a
    training loop that seeds before building it).

    impl: the attention implementation, as :func:`tiny_bert`'s."""
    if seed is not None:
        torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=32,
        n_layer=layers,
        n_head=2,
        n_positions=positions,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
        **({"attn_implementation": impl} if impl is not None else {}),
    )
    return GPT2LMHeadModel(config)
