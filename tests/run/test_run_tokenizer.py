"""The demo tokenizer: BERT-style WordPiece, deterministic training, and the on-disk cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from numscope.run import tokenizer as tokenizer_module
from numscope.run.tokenizer import (
    SPECIAL_TOKENS,
    TokenizerInfo,
    default_cache_dir,
    load_or_train_tokenizer,
    tokenizer_cache_path,
    train_tokenizer,
)


def test_special_tokens_come_first(small_info: TokenizerInfo, small_vocab_size: int) -> None:
    ids = (small_info.pad_id, small_info.unk_id, small_info.cls_id, small_info.sep_id, small_info.mask_id)
    assert ids == (0, 1, 2, 3, 4)
    assert small_info.special_ids == (0, 1, 2, 3, 4)
    assert 500 < small_info.vocab_size <= small_vocab_size


def test_encoding_is_bert_style(small_tokenizer: Tokenizer) -> None:
    encoding = small_tokenizer.encode("The HISTORY of Mathematics, 1900–1950.")
    assert encoding.tokens[0] == "[CLS]" and encoding.tokens[-1] == "[SEP]"
    assert "history" in encoding.tokens and "," in encoding.tokens
    assert any(token.startswith("##") for token in small_tokenizer.get_vocab())
    assert small_tokenizer.decode(encoding.ids).startswith("the history of mathematics, 1900")
    assert small_tokenizer.encode("a [MASK] b", add_special_tokens=False).tokens[1] == "[MASK]"
    pair = small_tokenizer.encode("first", "second")
    assert pair.tokens.count("[SEP]") == 2 and pair.type_ids[-1] == 1


def test_training_is_deterministic(
    small_train: list[str], small_tokenizer: Tokenizer, small_vocab_size: int
) -> None:
    assert train_tokenizer(small_train, small_vocab_size).to_str() == small_tokenizer.to_str()


def test_cache_hit_loads_instead_of_retraining(
    small_train: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    documents = small_train[:100]
    trained = load_or_train_tokenizer(documents, 400, cache_dir=tmp_path)
    path = tokenizer_cache_path(documents, 400, tmp_path)
    assert path.is_file() and path.parent == tmp_path / "tokenizers"

    def no_training(*args: object, **kwargs: object) -> Tokenizer:
        raise AssertionError("the cached tokenizer should have been loaded")

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", no_training)
    loaded = load_or_train_tokenizer(documents, 400, cache_dir=tmp_path)
    assert loaded.get_vocab() == trained.get_vocab()
    assert loaded.encode("an example").ids == trained.encode("an example").ids
    assert tokenizer_cache_path(documents, 401, tmp_path) != path
    assert tokenizer_cache_path(documents[:99], 400, tmp_path) != path


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NUMSCOPE_CACHE", str(tmp_path / "custom"))
    assert default_cache_dir() == tmp_path / "custom"
    monkeypatch.delenv("NUMSCOPE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "numscope"


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="got 5"):
        train_tokenizer(["text"], 5)
    with pytest.raises(ValueError, match="no documents"):
        train_tokenizer([], 100)
    with pytest.raises(ValueError, match=r"lacks special tokens \['\[CLS\]', '\[SEP\]'\]"):
        TokenizerInfo.from_tokenizer(Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    assert SPECIAL_TOKENS == ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
