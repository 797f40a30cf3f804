"""The demo's training data: token blocks, BERT masking, batches, and a fixed-mask evaluation.

Documents are tokenized, concatenated into one stream with [SEP] between documents, and cut into blocks of
``seq_len`` tokens, each framed ``[CLS] … [SEP]``; the stream's tail becomes one last block padded with
[PAD]. Blocks are cached on disk next to the tokenizer, keyed by the tokenizer, the documents and
``seq_len``.

Every random choice (batch order, which tokens are masked and how) comes from a ``torch.Generator`` seeded
from the caller's seed, drawn on the CPU, so that the same seed gives the same batches on any device.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from numscope._atomic import atomic_write
from numscope.run.config import RunData
from numscope.run.corpus import CorpusError, corpus_hash
from numscope.run.tokenizer import TokenizerInfo, default_cache_dir

if TYPE_CHECKING:
    from tokenizers import Tokenizer

DEFAULT_SEQ_LEN = 128
DEFAULT_MASK_PROBABILITY = 0.15
IGNORE_INDEX = -100
"""Label of positions without MLM loss (``ignore_index`` of ``torch.nn.functional.cross_entropy``)."""
MASK_FRACTION, RANDOM_FRACTION = 0.8, 0.1
"""BERT's split of selected tokens: 80 % become [MASK], 10 % a random token, the other 10 % stay unchanged."""
DATA_VERSION = 1
"""Bump when block layout changes, so that cached blocks of the old layout are not reused."""


def make_blocks(
    documents: Sequence[str],
    tokenizer: Tokenizer,
    seq_len: int = DEFAULT_SEQ_LEN,
    info: TokenizerInfo | None = None,
) -> torch.Tensor:
    """Token ids of ``documents`` as blocks: an int64 tensor ``[number of blocks, seq_len]`` (no caching).

    Each block is ``[CLS]``, ``seq_len − 2`` tokens of the document stream (documents joined by [SEP]), and
    ``[SEP]``; the last block holds the stream's remainder and is padded with [PAD] to ``seq_len``.
    ``info``: the tokenizer's special-token ids (default: :meth:`TokenizerInfo.from_tokenizer` by their
    names); a model's own tokenizer frames with its own (``<s> … </s>``).

    Raises:
        ValueError: ``seq_len`` < 3.
        CorpusError: the documents hold no tokens.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 3:
        raise ValueError(f"seq_len must be an integer ≥ 3 ([CLS], a token, [SEP]); got {seq_len!r}")
    info = info if info is not None else TokenizerInfo.from_tokenizer(tokenizer)
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(list(documents), add_special_tokens=False):
        if encoding.ids:
            if stream:
                stream.append(info.sep_id)
            stream.extend(encoding.ids)
    if not stream:
        raise CorpusError(f"the {len(documents)} document(s) hold no tokens; cannot make token blocks")
    body = seq_len - 2
    tokens = torch.tensor(stream, dtype=torch.int64)
    full_blocks = len(stream) // body
    remainder = tokens[full_blocks * body :]
    rows = tokens[: full_blocks * body].view(full_blocks, body)
    cls_column = torch.full((full_blocks, 1), info.cls_id, dtype=torch.int64)
    sep_column = torch.full((full_blocks, 1), info.sep_id, dtype=torch.int64)
    blocks = torch.cat([cls_column, rows, sep_column], dim=1)
    if remainder.numel():
        last = torch.full((1, seq_len), info.pad_id, dtype=torch.int64)
        last[0, 0] = info.cls_id
        last[0, 1 : 1 + remainder.numel()] = remainder
        last[0, 1 + remainder.numel()] = info.sep_id
        blocks = torch.cat([blocks, last])
    return blocks


def blocks_cache_path(
    documents: Sequence[str],
    tokenizer: Tokenizer,
    seq_len: int,
    cache_dir: Path | None = None,
    info: TokenizerInfo | None = None,
) -> Path:
    """Where :func:`load_or_make_blocks` keeps the blocks for these documents, tokenizer (and its special
    ids, where given) and ``seq_len``."""
    digest = hashlib.sha256()
    parts = [tokenizer.to_str(), corpus_hash(documents), str(seq_len), str(DATA_VERSION)]
    if info is not None:
        parts.append(repr((info.pad_id, info.cls_id, info.sep_id)))
    for part in parts:
        digest.update(part.encode("utf-8"))
        digest.update(b"\0")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "blocks" / f"{digest.hexdigest()[:24]}.pt"


def load_or_make_blocks(
    documents: Sequence[str],
    tokenizer: Tokenizer,
    seq_len: int = DEFAULT_SEQ_LEN,
    cache_dir: Path | None = None,
    info: TokenizerInfo | None = None,
) -> torch.Tensor:
    """The blocks of :func:`make_blocks`, loaded from the cache when present, else made and saved there.

    Args:
        cache_dir: cache root (``blocks/`` is made under it); default
            :func:`numscope.run.tokenizer.default_cache_dir`.
        info: the special-token ids (:func:`make_blocks`).
    """
    path = blocks_cache_path(documents, tokenizer, seq_len, cache_dir, info)
    if path.is_file():
        return torch.load(path, weights_only=True)
    blocks = make_blocks(documents, tokenizer, seq_len, info)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda file: torch.save(blocks, file))
    return blocks


def mlm_mask(
    input_ids: torch.Tensor,
    tokenizer_info: TokenizerInfo,
    probability: float = DEFAULT_MASK_PROBABILITY,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: returns ``(masked input ids, labels)``, both shaped like ``input_ids``.

    Each non-special token is selected with ``probability``; a selected token becomes [MASK] with
    probability 0.8, a uniformly random non-special token with 0.1, and stays itself with 0.1. Labels hold
    the original id at selected positions and ``IGNORE_INDEX`` (−100) elsewhere. Special tokens ([PAD],
    [UNK], [CLS], [SEP], [MASK]) are never selected. ``input_ids`` is not modified.

    Args:
        generator: a CPU ``torch.Generator`` (random numbers are drawn on the CPU and moved to the ids'
            device); ``None`` uses torch's global CPU generator.

    Raises:
        ValueError: ``probability`` is outside (0, 1].
    """
    if not 0.0 < probability <= 1.0:
        raise ValueError(f"mask probability must be in (0, 1]; got {probability!r}")
    if tokenizer_info.mask_id is None:
        raise ValueError("the tokenizer has no mask token, which the masked LM needs; train a causal LM")
    special = torch.tensor(tokenizer_info.special_ids, dtype=input_ids.dtype, device=input_ids.device)
    replacements = torch.tensor(
        sorted(set(range(tokenizer_info.vocab_size)) - set(tokenizer_info.special_ids)), dtype=input_ids.dtype
    )
    selection_draw = torch.rand(input_ids.shape, generator=generator)
    action_draw = torch.rand(input_ids.shape, generator=generator)
    replacement_draw = replacements[
        torch.randint(len(replacements), input_ids.shape, generator=generator, dtype=torch.int64)
    ]
    selected = (selection_draw < probability).to(input_ids.device) & ~torch.isin(input_ids, special)
    action_draw = action_draw.to(input_ids.device)
    to_mask = selected & (action_draw < MASK_FRACTION)
    to_random = selected & (action_draw >= MASK_FRACTION) & (action_draw < MASK_FRACTION + RANDOM_FRACTION)
    masked = torch.where(to_mask, torch.full_like(input_ids, tokenizer_info.mask_id), input_ids)
    masked = torch.where(to_random, replacement_draw.to(input_ids.device), masked)
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    return masked, labels


def derive_seed(seed: int, *purpose: int | str) -> int:
    """A 63-bit seed for one purpose (e.g. an epoch) derived from ``seed``, the same on every machine."""
    material = "\0".join(str(part) for part in (seed, *purpose)).encode("utf-8")
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "little") >> 1


def num_batches(num_blocks: int, batch_size: int, drop_last: bool = False) -> int:
    """How many batches :func:`batches` yields for ``num_blocks`` blocks."""
    return num_blocks // batch_size if drop_last else -(-num_blocks // batch_size)


def batches(
    blocks: torch.Tensor,
    batch_size: int,
    tokenizer_info: TokenizerInfo,
    seed: int = 0,
    epoch: int = 0,
    mask_probability: float = DEFAULT_MASK_PROBABILITY,
    shuffle: bool = True,
    drop_last: bool = False,
    device: torch.device | str | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """One epoch of masked batches: dicts of ``input_ids``, ``attention_mask`` and ``labels``, each
    ``[batch, seq_len]`` int64 on ``device``.

    Order and masks are a pure function of ``(seed, epoch)``: each epoch reshuffles (unless ``shuffle`` is
    false) and remasks, and rerunning an epoch repeats it exactly. ``attention_mask`` is 1 on tokens and 0 on
    [PAD]; labels are as in :func:`mlm_mask`.

    Raises:
        ValueError: ``blocks`` is not a 2-D integer tensor, or ``batch_size`` is not a positive integer.
    """
    if blocks.dim() != 2 or blocks.dtype.is_floating_point or blocks.dtype == torch.bool:
        raise ValueError(
            f"blocks must be a 2-D integer tensor [blocks, seq_len]; got {blocks.dtype} {tuple(blocks.shape)}"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}")
    if not 0.0 < mask_probability <= 1.0:
        raise ValueError(f"mask probability must be in (0, 1]; got {mask_probability!r}")
    return _batches(
        blocks, batch_size, tokenizer_info, seed, epoch, mask_probability, shuffle, drop_last, device
    )


def _batches(
    blocks: torch.Tensor,
    batch_size: int,
    tokenizer_info: TokenizerInfo,
    seed: int,
    epoch: int,
    mask_probability: float,
    shuffle: bool,
    drop_last: bool,
    device: torch.device | str | None,
) -> Iterator[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(derive_seed(seed, "epoch", epoch))
    count = blocks.shape[0]
    order = torch.randperm(count, generator=generator) if shuffle else torch.arange(count)
    for start in range(0, num_batches(count, batch_size, drop_last) * batch_size, batch_size):
        input_ids = blocks[order[start : start + batch_size]].long()
        masked, labels = mlm_mask(input_ids, tokenizer_info, mask_probability, generator)
        yield {
            "input_ids": masked.to(device),
            "attention_mask": (input_ids != tokenizer_info.pad_id).long().to(device),
            "labels": labels.to(device),
        }


HEAD_AT_LABELS = "head_at_labels"
"""The attribute by which a masked LM says that, given ``labels=``, its head runs on the labelled positions
only and its ``logits`` are their rows (:func:`evaluate_mlm`)."""


@dataclass(frozen=True)
class MLMEvaluation:
    """Masked-LM quality on a fixed set of masked tokens."""

    loss: float
    """Mean cross-entropy per masked token, in nats."""
    accuracy: float
    """Fraction of masked tokens whose top-1 prediction is the original token."""
    masked_tokens: int
    """How many tokens were masked (the denominator of both)."""


def evaluate_mlm(
    model: torch.nn.Module,
    val_blocks: torch.Tensor,
    tokenizer_info: TokenizerInfo,
    batch_size: int = 32,
    seed: int = 0,
    mask_probability: float = DEFAULT_MASK_PROBABILITY,
) -> MLMEvaluation:
    """Mean MLM loss and accuracy over the masked tokens of ``val_blocks``, the same tokens on every call.

    The masks depend only on ``val_blocks`` and ``seed`` (not on ``batch_size``, the device or the global
    RNG), so every run and every format is scored on exactly the same masked tokens. The model runs in eval
    mode under ``torch.no_grad`` on the device of its parameters; its train/eval mode is restored after.
    ``model(input_ids=…, attention_mask=…)`` must return an object with ``logits`` ``[batch, seq, vocab]``.
    A model whose head runs on labelled positions only (the demo's BERT) says so with a true attribute
    :data:`HEAD_AT_LABELS`; it is given ``labels=`` too and returns the labelled positions' rows
    ``[labelled, vocab]`` in row-major order. Others are not given the labels: a ``transformers`` model would
    compute a loss over every position's logits that the score does not use; their output projection runs on
    the scored rows alone where that gives those rows bit for bit (:func:`_at_scored_rows`).

    Raises:
        ValueError: ``val_blocks`` has no maskable token, or ``batch_size`` is not a positive integer.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}")
    generator = torch.Generator().manual_seed(derive_seed(seed, "evaluation"))
    val_blocks = val_blocks.long()
    masked, labels = mlm_mask(val_blocks, tokenizer_info, mask_probability, generator)
    attention_mask = (val_blocks != tokenizer_info.pad_id).long()
    device = next(model.parameters()).device
    # through a DistributedDataParallel wrapper (torch.compile's and FSDP2's keep the model's attributes)
    at_labels = bool(getattr(getattr(model, "module", model), HEAD_AT_LABELS, False))
    decoder = None if at_labels else _scored_rows_decoder(model)
    total_loss, correct, count = 0.0, 0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, val_blocks.shape[0], batch_size):
                batch_labels = labels[start : start + batch_size].to(device)
                selected = batch_labels != IGNORE_INDEX
                if not selected.any():
                    continue
                inputs = {
                    "input_ids": masked[start : start + batch_size].to(device),
                    "attention_mask": attention_mask[start : start + batch_size].to(device),
                }
                if at_labels:
                    inputs["labels"] = batch_labels
                if decoder is None:
                    logits = model(**inputs).logits
                else:
                    logits = _at_scored_rows(model, decoder, inputs, selected)
                    if logits is None:  # its head does not pass the decoder the rows as they are
                        decoder = None
                        logits = model(**inputs).logits
                targets = batch_labels[selected]
                # a model whose head runs on the labelled positions only returns just their rows
                chosen = (logits if logits.dim() == 2 else logits[selected]).float()
                total_loss += torch.nn.functional.cross_entropy(chosen, targets, reduction="sum").item()
                correct += int((chosen.argmax(dim=-1) == targets).sum().item())
                count += int(selected.sum().item())
    finally:
        model.train(was_training)
    if count == 0:
        raise CorpusError(
            f"no token of the {val_blocks.shape[0]} validation blocks was masked; nothing to score: give "
            "more text"
        )
    return MLMEvaluation(loss=total_loss / count, accuracy=correct / count, masked_tokens=count)


def _scored_rows_decoder(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The output projection (``get_output_embeddings()``, the vocabulary-sized GEMM) of a ``transformers``
    masked LM, where :func:`evaluate_mlm` may run it on the scored rows alone because that
    gives those rows exactly (:func:`numscope.convert.rows_independent`); None otherwise (a compiled model,
    a plan that scales the projection's input per tensor)."""
    from numscope.convert import rows_independent

    base = getattr(model, "module", model)
    if hasattr(model, "_orig_mod") or hasattr(base, "_orig_mod"):
        return None  # compiled: a hook would change the traced graph
    get = getattr(base, "get_output_embeddings", None)
    decoder = get() if callable(get) else None
    if not isinstance(decoder, torch.nn.Linear):
        return None
    name = next((n for n, m in base.named_modules() if m is decoder), None)
    if name is None or not rows_independent(base, name):
        return None
    return decoder


def _at_scored_rows(
    model: torch.nn.Module,
    decoder: torch.nn.Linear,
    inputs: dict[str, torch.Tensor],
    selected: torch.Tensor,
) -> torch.Tensor | None:
    """The model's logits at the ``selected`` positions ``[selected, vocab]``, its output projection run on
    those rows only (a masked LM scores 15% of the positions; docs/results/benchmarks.md, "Evaluation",
    measures
    what that saves), or on every row where a handler other than ``numscope.convert``'s takes part
    in the forward (an observer measuring evaluations sees what the model computes). None where the model's
    head does not hand that projection the ``[batch, seq, hidden]`` rows and return its output as the
    logits (the caller then runs the model whole)."""
    from numscope.convert import HANDLER_NAME
    from numscope.sites import active_handlers

    base = getattr(model, "module", model)
    seen: list[bool] = []

    def rows(_module: torch.nn.Module, args: tuple) -> tuple | None:
        hidden = args[0] if args else None
        if (
            not isinstance(hidden, torch.Tensor)
            or tuple(hidden.shape[:-1]) != tuple(selected.shape)
            or any(name != HANDLER_NAME for name in active_handlers(base))
        ):
            seen.append(False)
            return None
        seen.append(True)
        return (hidden[selected], *args[1:])

    handle = decoder.register_forward_pre_hook(rows)
    try:
        logits = model(**inputs).logits
    except RuntimeError:  # a head that reshapes the projection's output to the positions' grid
        return None  # (the whole forward that follows raises again if the error was not the rows')
    finally:
        handle.remove()
    if seen and not any(seen) and tuple(logits.shape[:-1]) == tuple(selected.shape):
        return logits[selected]  # every row projected
    wanted = (int(selected.sum()), decoder.out_features)
    if not seen or not all(seen) or tuple(logits.shape) != wanted:  # (a first call finds the sites: twice)
        return None
    return logits


def unigram_loss(
    train_blocks: torch.Tensor,
    val_blocks: torch.Tensor,
    tokenizer_info: TokenizerInfo,
    seed: int = 0,
    mask_probability: float = DEFAULT_MASK_PROBABILITY,
) -> float:
    """The loss of a model that ignores context, in nats per masked token: the cross-entropy, on the very
    tokens :func:`evaluate_mlm` scores, of the training split's token frequencies (add-½ smoothed, special
    tokens excluded). A masked LM that has learned anything from context scores below it."""
    counts = torch.bincount(train_blocks.flatten().long(), minlength=tokenizer_info.vocab_size).double()
    counts[list(tokenizer_info.special_ids)] = 0.0
    probabilities = (counts + 0.5) / (counts + 0.5).sum()
    generator = torch.Generator().manual_seed(derive_seed(seed, "evaluation"))
    _, labels = mlm_mask(val_blocks.long(), tokenizer_info, mask_probability, generator)
    targets = labels[labels != IGNORE_INDEX]
    if targets.numel() == 0:
        raise CorpusError(
            f"no token of the {val_blocks.shape[0]} validation blocks was masked; nothing to score: give "
            "more text"
        )
    return float(-probabilities[targets].log().mean())


def load_run_data(
    vocab_size: int,
    seq_len: int,
    val_blocks: int,
    text_paths: Sequence[Path | str] | None = None,
    cache_dir: Path | None = None,
    max_train_blocks: int | None = None,
    progress: bool = False,
    tokenizer_file: str | Path | None = None,
) -> RunData:
    """Corpus (the default one, or ``text_paths``) → train/validation split → WordPiece tokenizer of
    ``vocab_size`` (cached; ``tokenizer_file``, a ``tokenizers`` JSON, instead when given) → blocks of
    ``seq_len`` tokens (cached); at most ``val_blocks`` validation blocks and ``max_train_blocks`` training
    blocks (None: all)."""
    from numscope._progress import progress as progress_bar
    from numscope.run.corpus import load_corpus, split_corpus
    from numscope.run.tokenizer import load_or_train_tokenizer

    with progress_bar(total=4, desc=f"{'data':>13}", enabled=progress) as bar:
        bar.set_postfix_str("corpus")
        documents = load_corpus([Path(p) for p in text_paths] if text_paths else None)
        train_docs, val_docs = split_corpus(documents)
        bar.update()
        bar.set_postfix_str(f"tokenizer ({vocab_size} tokens)")
        if tokenizer_file is not None:
            from numscope.run.tokenizer import load_tokenizer_file

            tokenizer, info = load_tokenizer_file(tokenizer_file)
        else:
            tokenizer = load_or_train_tokenizer(train_docs, vocab_size, cache_dir)
            info = TokenizerInfo.from_tokenizer(tokenizer)
        bar.update()
        bar.set_postfix_str(f"{seq_len}-token blocks")
        train = load_or_make_blocks(train_docs, tokenizer, seq_len, cache_dir, info)
        bar.update()
        val = load_or_make_blocks(val_docs, tokenizer, seq_len, cache_dir, info)
        bar.update()
    if max_train_blocks is not None:
        train = train[:max_train_blocks]
    return RunData(train, val[: min(val_blocks, val.shape[0])], info)
