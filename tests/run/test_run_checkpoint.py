"""A user's checkpoint folder as ``--model``: training starts from its weights bit for bit, with its own
tokenizer (BERT's WordPiece, GPT-2's byte-level BPE with one special token, RoBERTa/MPNet's <s> </s>), what it
lacks initialised from the run's seed and said, and every way it cannot fit named in one line."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from checkpoints import _weights, bert_checkpoint, cli, gpt2_checkpoint, write_text
from numscope.run.sources import DataSettings, resolve_model, settle_tokenizer
from numscope.run.tokenizer import TokenizerInfo, load_tokenizer_file
from numscope.train.checkpoint import load_checkpoint


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_a_run_starts_from_the_checkpoint_bit_for_bit_with_its_own_tokenizer(
    family: str, tmp_path: Path
) -> None:
    text = write_text(tmp_path / "text.txt")
    make = bert_checkpoint if family == "bert" else gpt2_checkpoint
    checkpoint = make(tmp_path / "ckpt", text)
    args = ["train", "--model", checkpoint, "--text", text, "--plan", "fp32", "--steps", 1, "--lr", 1e-30]
    args += ["--seq-len", 32, "--batch-size", 2, "--val-blocks", 4, "--cache", tmp_path / "cache"]
    code, _, err = cli(*args, "--out", tmp_path / "run", "--no-progress")
    assert code == 0, err
    assert "tensors loaded from model.safetensors" in err  # the one line of what was loaded
    trained = load_checkpoint(tmp_path / "run" / "model.pt")["model"]
    saved = _weights(checkpoint)
    assert saved and set(saved) <= set(trained)
    for name, tensor in saved.items():
        assert torch.equal(trained[name], tensor), name
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    own = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).get_vocab_size()
    assert run["tokenizer_path"] == str((checkpoint / "tokenizer.json").resolve())
    assert run["data"]["vocab_size"] == run["vocab_size_built"] == own
    assert run["objective_resolved"] == ("mlm" if family == "bert" else "clm")


def test_what_the_checkpoint_lacks_is_initialised_from_the_seed_and_said(tmp_path: Path) -> None:
    """A sentence encoder saved without its masked-LM head (as all-mpnet-base-v2 is): the encoder loads, the
    head is drawn from the global generator (the run seeds it), and the note names it."""
    text = write_text(tmp_path / "text.txt")
    checkpoint = bert_checkpoint(tmp_path / "ckpt", text, head=False)
    _, info = load_tokenizer_file(checkpoint / "tokenizer.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        factory, objective = resolve_model(str(checkpoint)).build(info, 32)
    notes = [str(w.message) for w in caught if "tensors loaded" in str(w.message)]
    assert objective == "mlm" and len(notes) == 1
    assert "initialised from the run's seed" in notes[0] and "(cls.*: not in the checkpoint)" in notes[0]
    saved = _weights(checkpoint)
    torch.manual_seed(3)
    first = factory().state_dict()
    torch.manual_seed(3)
    again = factory().state_dict()
    torch.manual_seed(4)
    other = factory().state_dict()
    for name, tensor in saved.items():
        assert torch.equal(first["bert." + name], tensor), name
    head = "cls.predictions.transform.dense.weight"
    assert torch.equal(first[head], again[head]) and not torch.equal(first[head], other[head])


def test_train_tokenizer_replaces_the_vocabulary_and_says_so(tmp_path: Path) -> None:
    text = write_text(tmp_path / "text.txt")
    checkpoint = bert_checkpoint(tmp_path / "ckpt", text)
    args = ["train", "--model", checkpoint, "--text", text, "--plan", "fp32", "--steps", 1, "--lr", 1e-30]
    args += ["--seq-len", 32, "--batch-size", 2, "--val-blocks", 4, "--cache", tmp_path / "cache"]
    args += ["--train-tokenizer", "--no-progress"]
    code, _, err = cli(*args, "--vocab-size", 60, "--out", tmp_path / "run")
    assert code == 0, err
    assert "vocabulary replaced by the 60 tokens trained on your text" in err
    trained = load_checkpoint(tmp_path / "run" / "model.pt")["model"]
    saved = _weights(checkpoint)
    embedding = "bert.embeddings.word_embeddings.weight"
    assert trained[embedding].shape[0] == 60 != saved[embedding].shape[0]
    query = "bert.encoder.layer.0.attention.self.query.weight"
    assert torch.equal(trained[query], saved[query])  # the rest is the checkpoint's
    both = cli(*args, "--tokenizer", checkpoint / "tokenizer.json", "--out", tmp_path / "x")
    assert both[0] == 2 and "choose one" in both[2]


def test_a_checkpoint_that_cannot_fit_is_one_clear_line(tmp_path: Path) -> None:
    text = write_text(tmp_path / "text.txt")
    checkpoint = bert_checkpoint(tmp_path / "ckpt", text)
    base = ["train", "--model", checkpoint, "--text", text, "--plan", "fp32", "--steps", 1, "--seq-len", 32]
    base += ["--batch-size", 2, "--cache", tmp_path / "cache", "--no-progress"]
    bigger = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    bigger.add_tokens([f"extra{i}" for i in range(5)])
    bigger.save(str(tmp_path / "bigger.json"))
    code, _, err = cli(*base, "--tokenizer", tmp_path / "bigger.json", "--out", tmp_path / "a")
    assert code == 2 and "the checkpoint embeds" in err and "Traceback" not in err
    (checkpoint / "tokenizer.json").unlink()
    code, _, err = cli(*base, "--out", tmp_path / "b")
    assert code == 2 and "holds no tokenizer.json" in err and "--train-tokenizer" in err
    (checkpoint / "model.safetensors").write_bytes(b"not a safetensors file")
    code, _, err = cli(*base, "--train-tokenizer", "--out", tmp_path / "c")
    assert code == 2 and "cannot read its weights" in err and "Traceback" not in err


def test_a_roberta_style_tokenizer_is_read_by_its_folder_roles_untruncated(tmp_path: Path) -> None:
    """MPNet's tokenizer.json (its vocabulary's shape): <s> </s> <pad> <mask>, an [UNK] its
    special_tokens_map names, and truncation at 128 that numscope must switch off."""
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "[UNK]": 4, "<mask>": 5}
    vocab |= {word: 6 + i for i, word in enumerate(["the", "cat", "sees", "a", "dog"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.enable_truncation(3)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    roles = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "[UNK]", "sep_token": "</s>"}
    roles |= {"pad_token": "<pad>", "cls_token": "<s>", "mask_token": {"content": "<mask>", "lstrip": True}}
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(roles))
    loaded, info = load_tokenizer_file(tmp_path / "tokenizer.json")
    assert info == TokenizerInfo(vocab_size=11, pad_id=1, unk_id=4, cls_id=0, sep_id=2, mask_id=5)
    assert len(loaded.encode("the cat sees a dog the cat").ids) == 7
    (tmp_path / "special_tokens_map.json").unlink()  # by the names alone, RoBERTa's after BERT's
    assert load_tokenizer_file(tmp_path / "tokenizer.json")[1] == info
    del vocab["[UNK]"], vocab["<s>"]
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"lacks special tokens \['\[CLS\]'\] \(roles cls\)"):
        load_tokenizer_file(tmp_path / "tokenizer.json")


def test_settle_tokenizer_leaves_other_models_alone(tmp_path: Path) -> None:
    text = write_text(tmp_path / "text.txt")
    data = DataSettings((str(text),), vocab_size=50)
    assert settle_tokenizer("tiny-bert", data) is data
    checkpoint = bert_checkpoint(tmp_path / "ckpt", text)
    settled = settle_tokenizer(str(checkpoint), data)
    assert settled.tokenizer == str(checkpoint / "tokenizer.json")
    assert settled.vocab_size == Tokenizer.from_file(settled.tokenizer).get_vocab_size()
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text((checkpoint / "config.json").read_text())
    assert resolve_model(str(tmp_path / "config_only")).kind == "config"
    assert resolve_model(str(checkpoint)).kind == "checkpoint"
