"""A BERT-style WordPiece tokenizer trained on the demo's training split, cached on disk.

The recipe is BERT's uncased one: ``BertNormalizer`` (lowercase, strip accents, clean control characters,
space out CJK), ``BertPreTokenizer`` (split on whitespace and punctuation), WordPiece with ``##``
continuation pieces, and ``[CLS] … [SEP]`` framing. Training takes about three seconds on the full demo
corpus; the result is saved as ``<cache>/tokenizers/<key>.json`` and loaded on later calls.

Training is deterministic: the same documents and vocabulary size give the same vocabulary and ids on every
run and machine (``tokenizers``' own WordPieceTrainer does not; see :func:`train_tokenizer`). Ids: the special
tokens first, then the single characters in code-point order, then the learned pieces in merge order.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from numscope._atomic import atomic_write_text
from numscope._lazy import require
from numscope.run.corpus import corpus_hash

if TYPE_CHECKING:  # tokenizers is the demo's dependency (numscope[demo]), imported where it is used
    from tokenizers import Tokenizer, models

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, CLS, SEP, MASK)
"""The special tokens, in id order: [PAD] is 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4."""

DEFAULT_VOCAB_SIZE = 8000
TOKENIZER_VERSION = 1
"""Bump when the recipe changes, so that cached tokenizers of the old recipe are not reused."""

CACHE_ENV = "NUMSCOPE_CACHE"


def default_cache_dir() -> Path:
    """Root of numscope's on-disk cache: ``$NUMSCOPE_CACHE``, else ``$XDG_CACHE_HOME/numscope``, else
    ``~/.cache/numscope``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "numscope"
    return Path.home() / ".cache" / "numscope"


ROLES: tuple[str, ...] = ("pad", "unk", "cls", "sep", "mask")
"""What numscope needs of a tokenizer's special tokens: padding, unknown, the block's first and last token
(BERT's [CLS] and [SEP]; a decoder's bos and eos) and, for the masked LM, the mask."""

ROLE_NAMES: dict[str, tuple[str, ...]] = {
    "pad": (PAD, "<pad>", "<|pad|>"),
    "unk": (UNK, "<unk>", "<|endoftext|>"),
    "cls": (CLS, "<s>", "<|begin_of_text|>", "<|endoftext|>"),
    "sep": (SEP, "</s>", "<|end_of_text|>", "<|endoftext|>"),
    "mask": (MASK, "<mask>"),
}
"""The token names a role is looked up by where the tokenizer's folder does not name it (in order): BERT's,
then RoBERTa/MPNet's, then the GPT and Llama families'."""

#: Hugging Face's names of the special tokens in ``special_tokens_map.json`` / ``tokenizer_config.json``,
#: per role, in order of preference (a decoder has bos/eos where an encoder has cls/sep)
_HF_KEYS: dict[str, tuple[str, ...]] = {
    "pad": ("pad_token",),
    "unk": ("unk_token",),
    "cls": ("cls_token", "bos_token"),
    "sep": ("sep_token", "eos_token"),
    "mask": ("mask_token",),
}


@dataclass(frozen=True)
class TokenizerInfo:
    """The ids that masking, batching and the model need to know, and the vocabulary size (tokens).

    ``mask_id`` is None for a tokenizer without a mask token (a decoder's): such a tokenizer serves the
    causal LM only."""

    vocab_size: int
    pad_id: int
    unk_id: int
    cls_id: int
    sep_id: int
    mask_id: int | None

    @property
    def special_ids(self) -> tuple[int, ...]:
        """Ids that are never masked nor drawn as random replacements."""
        ids = (self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id)
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, roles: Mapping[str, str] | None = None) -> TokenizerInfo:
        """The special-token ids of ``tokenizer``: each role's token as ``roles`` names it (role → token
        text, e.g. :func:`special_tokens_beside` of a model folder), else the first of
        :data:`ROLE_NAMES` the vocabulary holds. Without a pad token the sequence end pads (as Hugging
        Face's decoders do), without an unknown token the pad stands for it, and without a mask token
        ``mask_id`` is None. Raises ValueError naming what it lacks where it has no first or last token."""
        roles = dict(roles or {})
        ids: dict[str, int | None] = {}
        for role in ROLES:
            names = ([roles[role]] if role in roles else []) + list(ROLE_NAMES[role])
            ids[role] = next((i for i in map(tokenizer.token_to_id, names) if i is not None), None)
        missing = [role for role in ("cls", "sep") if ids[role] is None]
        if missing:
            wanted = [roles.get(role) or ROLE_NAMES[role][0] for role in missing]
            raise ValueError(
                f"tokenizer lacks special tokens {wanted} (roles {', '.join(missing)}); numscope "
                f"frames blocks with a first and a last token and pads: a BERT-style tokenizer has "
                f"{list(SPECIAL_TOKENS)}, a RoBERTa-style one <s> </s> <pad> <unk> <mask>, or name them in a "
                "special_tokens_map.json beside the tokenizer file"
            )
        pad = ids["pad"] if ids["pad"] is not None else ids["sep"]
        return cls(
            vocab_size=tokenizer.get_vocab_size(),
            pad_id=pad,  # type: ignore[arg-type]
            unk_id=ids["unk"] if ids["unk"] is not None else pad,  # type: ignore[arg-type]
            cls_id=ids["cls"],  # type: ignore[arg-type]
            sep_id=ids["sep"],  # type: ignore[arg-type]
            mask_id=ids["mask"],
        )


def special_tokens_beside(path: str | os.PathLike[str]) -> dict[str, str]:
    """The roles a tokenizer file's folder names (role → token text), from Hugging Face's
    ``special_tokens_map.json`` and then ``tokenizer_config.json`` beside ``path``; empty when neither
    exists or names any. A token may be written as its text or as ``{"content": text, ...}``."""
    import json

    folder = Path(path).parent
    roles: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        for role, keys in _HF_KEYS.items():
            for key in keys:
                value = data.get(key)
                text = value.get("content") if isinstance(value, dict) else value
                if isinstance(text, str) and text and role not in roles:
                    roles[role] = text
    return roles


def load_tokenizer_file(path: str | os.PathLike[str]) -> tuple[Tokenizer, TokenizerInfo]:
    """A ``tokenizers`` JSON file as numscope uses it: truncation and padding switched off (numscope cuts
    and pads its own blocks; a saved model's file often truncates at its training length), and its
    special-token ids (:meth:`TokenizerInfo.from_tokenizer` with the roles its folder names). Raises
    ValueError where its special tokens are lacking; the tokenizers library's own error where the file is
    not a tokenizer."""
    tokenizer = require("tokenizers", "a tokenizer").Tokenizer.from_file(str(path))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer, TokenizerInfo.from_tokenizer(tokenizer, special_tokens_beside(path))


def train_tokenizer(documents: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a BERT-style uncased WordPiece tokenizer on ``documents``, deterministically (no caching).

    Args:
        documents: training text; pass the training split only, so validation text stays unseen.
        vocab_size: the most tokens in the vocabulary, special tokens included; a small corpus may give
            fewer.

    Raises:
        ValueError: ``vocab_size`` is too small to hold the special tokens, or there are no documents.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be an integer > {len(SPECIAL_TOKENS)}; got {vocab_size!r}")
    tk = require("tokenizers", "training a tokenizer")
    Tokenizer, models, pre_tokenizers, processors, trainers = (
        tk.Tokenizer,
        tk.models,
        tk.pre_tokenizers,
        tk.processors,
        tk.trainers,
    )
    if not documents:
        raise ValueError("cannot train a tokenizer on no documents")
    words = _marked_word_counts(documents)
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    trainer_tokenizer.train_from_iterator(
        (" ".join([word] * count) for word, count in sorted(words.items())), trainer, length=len(words)
    )
    learned = sorted(trainer_tokenizer.get_vocab().items(), key=lambda item: item[1])
    pieces = [_unmark(token) for token, _ in learned if token not in SPECIAL_TOKENS]
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *pieces])}
    tokenizer = _bert_tokenizer(
        models.WordPiece(vocab, unk_token=UNK, continuing_subword_prefix=CONTINUATION)
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}",
        pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, vocab[CLS]), (SEP, vocab[SEP])],
    )
    return tokenizer


# WordPiece training is BPE over characters in which a word's non-initial characters are distinct symbols
# (``##x``). The WordPieceTrainer of ``tokenizers`` creates those symbols in hash-map order, and as merge ties
# are broken by symbol id its vocabulary differs between runs (huggingface/tokenizers issue 1794). Here the
# non-initial characters are instead shifted into the supplementary private-use planes before a plain BPE
# trainer sees them, so that they belong to its alphabet, which it numbers in sorted order. One difference
# from WordPieceTrainer: a character seen only inside words gets a ``##`` piece and no word-initial piece.
CONTINUATION = "##"
_CONTINUATION_SHIFT = 0xF0000
_SHIFTABLE = 0x10FFFE - _CONTINUATION_SHIFT


def _marked_word_counts(documents: Sequence[str]) -> Counter[str]:
    """Count the normalized, pre-tokenized words, non-initial characters shifted to mark continuation.

    Words holding a character that cannot be marked (a private-use character from the supplementary planes,
    or a continuation character beyond them) are left out of training; they encode as [UNK].
    """
    tk = require("tokenizers", "training a tokenizer")
    normalizer = tk.normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for document in documents:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(document)))
    marked: Counter[str] = Counter()
    for word, count in counts.items():
        codes = [ord(character) for character in word]
        if max(codes) < _CONTINUATION_SHIFT and max(codes[1:], default=0) < _SHIFTABLE:
            marked[word[0] + "".join(chr(code + _CONTINUATION_SHIFT) for code in codes[1:])] = count
    return marked


def _unmark(token: str) -> str:
    if ord(token[0]) >= _CONTINUATION_SHIFT:
        return CONTINUATION + "".join(chr(ord(character) - _CONTINUATION_SHIFT) for character in token)
    return token[0] + "".join(chr(ord(character) - _CONTINUATION_SHIFT) for character in token[1:])


def _bert_tokenizer(model: models.WordPiece) -> Tokenizer:
    tk = require("tokenizers", "a tokenizer")
    tokenizer = tk.Tokenizer(model)
    tokenizer.normalizer = tk.normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = tk.decoders.WordPiece(prefix="##")
    return tokenizer


def tokenizer_cache_key(documents: Sequence[str], vocab_size: int) -> str:
    """Cache key of the tokenizer for ``documents``: a digest of (corpus hash, vocab size, recipe version)."""
    material = f"{corpus_hash(documents)}\0{vocab_size}\0{TOKENIZER_VERSION}"
    return hashlib.sha256(material.encode()).hexdigest()[:24]


def tokenizer_cache_path(documents: Sequence[str], vocab_size: int, cache_dir: Path | None = None) -> Path:
    """Where :func:`load_or_train_tokenizer` keeps the tokenizer for these documents and vocabulary size."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "tokenizers" / f"{tokenizer_cache_key(documents, vocab_size)}.json"


def load_or_train_tokenizer(
    documents: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir: Path | None = None
) -> Tokenizer:
    """The tokenizer for ``documents``: loaded from the cache when present, else trained and saved there.

    Args:
        documents: the training split.
        vocab_size: the most tokens in the vocabulary, special tokens included.
        cache_dir: cache root (``tokenizers/`` is made under it); default :func:`default_cache_dir`.
    """
    path = tokenizer_cache_path(documents, vocab_size, cache_dir)
    if path.is_file():
        return require("tokenizers", "a tokenizer").Tokenizer.from_file(str(path))
    tokenizer = train_tokenizer(documents, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, tokenizer.to_str())
    return tokenizer
