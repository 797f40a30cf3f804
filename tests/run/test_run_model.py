"""The demo model factory: a small BertForMaskedLM from a validated, serialisable config."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tokenizers import Tokenizer
from transformers import BertForMaskedLM

from numscope.run.data import batches, make_blocks
from numscope.run.model import ModelConfig, bert_mlm_from_config, make_bert_mlm
from numscope.run.tokenizer import TokenizerInfo

TINY = {"hidden": 32, "layers": 2, "heads": 2, "intermediate": 64, "max_position": 64}


def test_config_round_trips_and_is_frozen() -> None:
    config = ModelConfig(vocab_size=1000, **TINY, dropout=0.0, attn_implementation="sdpa", seed=3)
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden = 64  # type: ignore[misc]
    bert = config.to_bert_config()
    assert (bert.hidden_size, bert.num_attention_heads, bert.intermediate_size) == (32, 2, 64)
    assert bert._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"hidden": 130, "heads": 4},
            r"hidden=130 is not divisible by heads=4.*\[1, 2, 5, 10, 13, 26, 65, 130\]",
        ),
        ({"layers": 0}, r"layers must be a positive integer; got 0"),
        ({"vocab_size": 12.5}, r"vocab_size must be a positive integer; got 12.5"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\); got 1.0"),
        (
            {"attn_implementation": "flash"},
            r"unknown attn_implementation 'flash'; known: \['eager', 'sdpa'\]",
        ),
        ({"pad_token_id": 1000}, r"pad_token_id=1000 is outside the vocabulary \[0, 1000\)"),
    ],
)
def test_config_errors_name_the_bad_value(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{"vocab_size": 1000, **changes})  # type: ignore[arg-type]


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(
        ValueError, match=r"unknown ModelConfig keys \['hidden_size'\]; known: \['vocab_size'"
    ):
        ModelConfig.from_dict({"vocab_size": 10, "hidden_size": 32})


def test_forward_backward_at_init_gives_log_vocab_loss(
    small_train: list[str], small_tokenizer: Tokenizer, small_info: TokenizerInfo
) -> None:
    blocks = make_blocks(small_train[:40], small_tokenizer, seq_len=64)
    batch = next(batches(blocks, 8, small_info, seed=0))
    model = make_bert_mlm(small_info.vocab_size, **TINY)
    output = model(**batch)
    masked = int((batch["labels"] != -100).sum())
    assert output.logits.shape == (masked, small_info.vocab_size)  # the head runs on masked positions only
    assert math.isfinite(output.loss.item())
    assert abs(output.loss.item() - math.log(small_info.vocab_size)) < 0.3
    output.loss.backward()
    gradients = [parameter.grad for parameter in model.parameters() if parameter.requires_grad]
    assert all(gradient is not None and torch.isfinite(gradient).all() for gradient in gradients)
    assert model.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0


def test_seeded_init_is_reproducible_and_leaves_the_global_rng_alone() -> None:
    state = torch.get_rng_state()
    first, second = make_bert_mlm(500, **TINY, seed=1), make_bert_mlm(500, **TINY, seed=1)
    other = bert_mlm_from_config(ModelConfig(vocab_size=500, **TINY, seed=2))
    assert torch.equal(state, torch.get_rng_state())
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    embedding = first.bert.embeddings.word_embeddings.weight
    assert not torch.equal(embedding, other.bert.embeddings.word_embeddings.weight)


def test_eager_and_sdpa_attention_agree() -> None:
    eager = make_bert_mlm(300, **TINY, attn_implementation="eager").eval()
    sdpa = make_bert_mlm(300, **TINY, attn_implementation="sdpa").eval()
    input_ids = torch.randint(5, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 10:] = 0
    with torch.no_grad():
        reference = eager(input_ids=input_ids, attention_mask=attention_mask).logits
        fused = sdpa(input_ids=input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


def test_masked_head_gives_the_full_heads_loss_and_gradients(
    small_train: list[str], small_tokenizer: Tokenizer, small_info: TokenizerInfo
) -> None:
    blocks = make_blocks(small_train[:40], small_tokenizer, seq_len=64)
    batch = next(batches(blocks, 8, small_info, seed=0))
    tiny = {**TINY, "dropout": 0.0}
    masked, full = (make_bert_mlm(small_info.vocab_size, **tiny, mlm_head=head) for head in ("masked", "all"))
    assert type(full) is BertForMaskedLM and isinstance(masked, BertForMaskedLM)
    losses = []
    for model in (masked, full):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(masked.named_parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7, msg=name)
    unlabelled = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():  # without labels both score every position
        torch.testing.assert_close(masked(**unlabelled).logits, full(**unlabelled).logits)
    with pytest.raises(ValueError, match=r"unknown mlm_head 'some'; known: \['masked', 'all'\]"):
        ModelConfig(vocab_size=10, mlm_head="some")
