"""The demo data pipeline: blocks, BERT masking statistics, batches and the fixed-mask evaluation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from numscope.run import data as data_module
from numscope.run.corpus import CorpusError
from numscope.run.data import (
    IGNORE_INDEX,
    batches,
    blocks_cache_path,
    derive_seed,
    evaluate_mlm,
    load_or_make_blocks,
    make_blocks,
    mlm_mask,
    num_batches,
    unigram_loss,
)
from numscope.run.model import make_bert_mlm
from numscope.run.tokenizer import TokenizerInfo

SEQ_LEN = 64
TINY = {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 64, "max_position": SEQ_LEN}


@pytest.fixture(scope="module")
def documents(small_train: list[str]) -> list[str]:
    return small_train[:60]


@pytest.fixture(scope="module")
def blocks(documents: list[str], small_tokenizer: Tokenizer) -> torch.Tensor:
    return make_blocks(documents, small_tokenizer, SEQ_LEN)


def test_blocks_are_framed_chunks_of_the_document_stream(
    documents: list[str], small_tokenizer: Tokenizer, small_info: TokenizerInfo, blocks: torch.Tensor
) -> None:
    assert blocks.dtype == torch.int64 and blocks.shape[1] == SEQ_LEN
    assert (blocks[:, 0] == small_info.cls_id).all()
    assert (blocks[:-1, -1] == small_info.sep_id).all()
    last = blocks[-1]
    real = int((last != small_info.pad_id).sum())
    assert last[real - 1] == small_info.sep_id and (last[real:] == small_info.pad_id).all()
    assert (blocks[:-1] != small_info.pad_id).all()
    stream = torch.cat([blocks[:-1, 1:-1].reshape(-1), last[1 : real - 1]]).tolist()
    expected: list[int] = []
    for encoding in small_tokenizer.encode_batch(documents, add_special_tokens=False):
        expected.extend([*([small_info.sep_id] if expected else []), *encoding.ids])
    assert stream == expected


def test_blocks_reject_bad_arguments(small_tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"seq_len must be an integer ≥ 3.*got 2"):
        make_blocks(["some text"], small_tokenizer, 2)
    with pytest.raises(CorpusError, match=r"the 1 document\(s\) hold no tokens"):
        make_blocks(["   "], small_tokenizer, 16)


def test_blocks_are_cached_next_to_the_tokenizer(
    documents: list[str], small_tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = load_or_make_blocks(documents, small_tokenizer, SEQ_LEN, cache_dir=tmp_path)
    path = blocks_cache_path(documents, small_tokenizer, SEQ_LEN, tmp_path)
    assert path.is_file() and path.parent == tmp_path / "blocks"

    def no_tokenizing(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the cached blocks should have been loaded")

    monkeypatch.setattr(data_module, "make_blocks", no_tokenizing)
    assert torch.equal(load_or_make_blocks(documents, small_tokenizer, SEQ_LEN, cache_dir=tmp_path), made)
    assert blocks_cache_path(documents, small_tokenizer, SEQ_LEN + 1, tmp_path) != path


def _synthetic_batch(info: TokenizerInfo, rows: int = 1024, length: int = 128) -> torch.Tensor:
    generator = torch.Generator().manual_seed(123)
    input_ids = torch.randint(len(info.special_ids), info.vocab_size, (rows, length), generator=generator)
    input_ids[:, 0] = info.cls_id
    input_ids[:, -1] = info.sep_id
    input_ids[::4, 100:] = info.pad_id
    input_ids[1::7, 50] = info.unk_id
    input_ids[2::9, 60] = info.mask_id
    return input_ids


def test_masking_follows_bert_statistics() -> None:
    info = TokenizerInfo(vocab_size=8000, pad_id=0, unk_id=1, cls_id=2, sep_id=3, mask_id=4)
    input_ids = _synthetic_batch(info)
    original = input_ids.clone()
    masked, labels = mlm_mask(input_ids, info, 0.15, torch.Generator().manual_seed(0))
    assert torch.equal(input_ids, original)
    special = torch.isin(input_ids, torch.tensor(info.special_ids))
    selected = labels != IGNORE_INDEX
    assert not (selected & special).any()
    assert torch.equal(masked[special], input_ids[special])
    assert torch.equal(masked[~selected], input_ids[~selected])
    assert torch.equal(labels[selected], input_ids[selected])

    candidates = int((~special).sum())
    chosen = int(selected.sum())
    rate = chosen / candidates
    assert abs(rate - 0.15) < 5 * math.sqrt(0.15 * 0.85 / candidates)
    as_mask = (masked[selected] == info.mask_id).float().mean().item()
    as_same = (masked[selected] == input_ids[selected]).float().mean().item()
    replaced = masked[selected & (masked != info.mask_id) & (masked != input_ids)]
    as_random = replaced.numel() / chosen
    bound = 5 * math.sqrt(0.8 * 0.2 / chosen)
    assert abs(as_mask - 0.8) < bound
    assert abs(as_random - 0.1) < bound
    assert abs(as_same - 0.1) < bound
    assert not torch.isin(replaced, torch.tensor(info.special_ids)).any()
    assert replaced.unique().numel() > 1000


def test_masking_is_reproducible_and_validated(small_info: TokenizerInfo, blocks: torch.Tensor) -> None:
    first = mlm_mask(blocks, small_info, generator=torch.Generator().manual_seed(5))
    second = mlm_mask(blocks, small_info, generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    with pytest.raises(ValueError, match=r"\(0, 1\]; got 1.5"):
        mlm_mask(blocks, small_info, 1.5)


def test_batches_cover_every_block_once_per_epoch(small_info: TokenizerInfo, blocks: torch.Tensor) -> None:
    epoch = list(batches(blocks, 16, small_info, seed=0, epoch=0))
    assert len(epoch) == num_batches(blocks.shape[0], 16) == math.ceil(blocks.shape[0] / 16)
    for batch in epoch:
        assert set(batch) == {"input_ids", "attention_mask", "labels"}
        assert all(tensor.dtype == torch.int64 and tensor.shape[1] == SEQ_LEN for tensor in batch.values())
    assert [batch["input_ids"].shape[0] for batch in epoch[:-1]] == [16] * (len(epoch) - 1)
    originals = torch.cat(
        [torch.where(batch["labels"] != IGNORE_INDEX, batch["labels"], batch["input_ids"]) for batch in epoch]
    )
    assert sorted(map(tuple, originals.tolist())) == sorted(map(tuple, blocks.tolist()))
    attention = torch.cat([batch["attention_mask"] for batch in epoch])
    assert torch.equal(attention, (originals != small_info.pad_id).long())


def test_batches_are_a_function_of_seed_and_epoch(small_info: TokenizerInfo, blocks: torch.Tensor) -> None:
    def run(seed: int, epoch: int) -> list[torch.Tensor]:
        return [batch["input_ids"] for batch in batches(blocks, 16, small_info, seed=seed, epoch=epoch)]

    assert all(torch.equal(a, b) for a, b in zip(run(0, 0), run(0, 0), strict=True))
    assert not torch.equal(run(0, 0)[0], run(0, 1)[0])
    assert not torch.equal(run(0, 0)[0], run(1, 0)[0])
    kept = list(batches(blocks, 16, small_info, drop_last=True, shuffle=False))
    assert len(kept) == blocks.shape[0] // 16
    assert torch.equal(kept[0]["attention_mask"], (blocks[:16] != small_info.pad_id).long())
    with pytest.raises(ValueError, match="batch_size must be a positive integer; got 0"):
        batches(blocks, 0, small_info)


def test_evaluation_uses_fixed_masks_and_restores_the_mode(
    small_info: TokenizerInfo, blocks: torch.Tensor
) -> None:
    blocks = blocks[:32]
    model = make_bert_mlm(small_info.vocab_size, **TINY)
    model.train()
    first = evaluate_mlm(model, blocks, small_info, batch_size=16, seed=0)
    assert model.training
    model.eval()
    again = evaluate_mlm(model, blocks, small_info, batch_size=7, seed=0)
    assert not model.training
    assert first.masked_tokens == again.masked_tokens > 0
    assert first.accuracy == again.accuracy
    assert abs(first.loss - again.loss) < 1e-5
    assert abs(first.loss - math.log(small_info.vocab_size)) < 0.3
    assert 0.0 <= first.accuracy <= 1.0
    other = evaluate_mlm(model, blocks, small_info, batch_size=16, seed=1)
    assert other.masked_tokens != first.masked_tokens or other.loss != first.loss


def _both_heads(info: TokenizerInfo) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The demo's BERT with its MLM head on every position and, with the same weights, on the masked ones."""
    full = make_bert_mlm(info.vocab_size, **TINY, mlm_head="all")
    masked = make_bert_mlm(info.vocab_size, **TINY, mlm_head="masked")
    masked.load_state_dict(full.state_dict())
    return full, masked


def test_evaluation_scores_a_masked_only_head_like_a_full_one(
    small_info: TokenizerInfo, blocks: torch.Tensor
) -> None:
    blocks = blocks[:24]
    full, masked = _both_heads(small_info)
    first = evaluate_mlm(full, blocks, small_info, batch_size=8, seed=0)
    second = evaluate_mlm(masked, blocks, small_info, batch_size=8, seed=0)
    assert first.masked_tokens == second.masked_tokens and first.accuracy == second.accuracy
    assert abs(first.loss - second.loss) < 1e-5


def test_evaluation_gives_the_labels_only_to_a_head_that_runs_at_them(
    small_info: TokenizerInfo, blocks: torch.Tensor
) -> None:
    """A transformers MLM given labels computes a loss over every position that the score does not use."""
    blocks = blocks[:16]
    full, masked = _both_heads(small_info)
    given: dict[str, list[bool]] = {"full": [], "masked": []}
    for name, model in (("full", full), ("masked", masked)):
        model.register_forward_pre_hook(
            lambda _m, _a, kwargs, name=name: given[name].append("labels" in kwargs), with_kwargs=True
        )
    first = evaluate_mlm(full, blocks, small_info, batch_size=8, seed=0)
    second = evaluate_mlm(masked, blocks, small_info, batch_size=8, seed=0)
    assert given == {"full": [False, False], "masked": [True, True]}
    # the score is the one the labelled forward gives: its loss over the same masked tokens
    masked_ids, labels = mlm_mask(
        blocks.long(), small_info, 0.15, torch.Generator().manual_seed(derive_seed(0, "evaluation"))
    )
    with torch.no_grad():
        reference = full.eval()(
            input_ids=masked_ids, attention_mask=(blocks != small_info.pad_id).long(), labels=labels
        ).loss
    assert first.loss == pytest.approx(float(reference), rel=1e-5)
    assert second.loss == pytest.approx(first.loss, rel=1e-5)


def test_a_transformers_head_projects_the_scored_rows_alone_and_scores_them_alike(
    small_info: TokenizerInfo, blocks: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vocabulary projection of a transformers MLM runs on the masked rows only, where that gives
    those rows bit for bit: not under a plan that scales its input per tensor, nor with a handler attached
    that takes part in the forward and is not convert's; a head that does not pass the rows through is run
    whole."""
    from numscope.convert import convert, rows_independent, unconvert
    from numscope.observe import observe
    from numscope.plan import OperandSpec, Plan, SiteSpec
    from numscope.sites import attach

    blocks = blocks[:16]
    model, _ = _both_heads(small_info)
    decoder = model.get_output_embeddings()
    seen: list[int] = []
    decoder.register_forward_hook(lambda _m, args, _out: seen.append(args[0].dim()))
    _, labels = mlm_mask(
        blocks.long(), small_info, 0.15, torch.Generator().manual_seed(derive_seed(0, "evaluation"))
    )
    scored = [int((part != IGNORE_INDEX).sum()) for part in labels.split(8)]

    def both() -> tuple[object, object, list[int]]:
        seen.clear()
        rows = evaluate_mlm(model, blocks, small_info, batch_size=8, seed=0)
        dims = list(seen)
        with monkeypatch.context() as patch:
            patch.setattr(data_module, "_scored_rows_decoder", lambda _model: None)
            whole = evaluate_mlm(model, blocks, small_info, batch_size=8, seed=0)
        return rows, whole, dims

    rows, whole, dims = both()
    assert rows == whole and dims == [2, 2] and whole.masked_tokens == sum(scored)
    name = "cls.predictions.decoder"
    bf16 = SiteSpec.uniform(OperandSpec("bf16", overflow="propagate"))
    tiles = OperandSpec("fp8_e4m3", scaling={"kind": "block", "block_shape": [1, 16]})
    for spec, alone in (
        (bf16, True),
        (SiteSpec.uniform("mxfp8_e4m3"), True),  # its blocks run along each row
        (SiteSpec.uniform(tiles), True),
        (SiteSpec.uniform("fp8_e4m3"), False),  # one scale from the whole tensor's amax
        (SiteSpec.uniform("nvfp4"), False),  # a tensor scale over its blocks
    ):
        convert(model, Plan(SiteSpec()).with_rule(name, spec))
        try:
            assert rows_independent(model, name) is alone
            rows, whole, dims = both()
            assert rows == whole and set(dims) == ({2} if alone else {3})  # (the first call: twice)
        finally:
            unconvert(model)

    stochastic = SiteSpec.uniform(OperandSpec("bf16", rounding="stochastic"))  # draws depend on the rows
    convert(model, Plan(SiteSpec()).with_rule(name, stochastic))
    try:
        assert not rows_independent(model, name)
    finally:
        unconvert(model)

    class Passing:  # a handler with no active(): it takes part in every forward
        def __call__(self, site, gemm, operand, tensor, axis):
            return tensor

    handle = attach(model, Passing(), name="someone")
    try:
        rows, whole, dims = both()  # it sees every row, as the model computes them
        assert rows == whole and set(dims) == {3}
    finally:
        handle.remove()
    for evaluations, projected in ((False, {2}), (True, {3})):  # an observer measures evaluations if asked
        with observe(model, candidates=["fp8_e4m3"], every=1, no_grad_forwards=evaluations):
            rows, whole, dims = both()
        assert rows == whole and set(dims) == projected
    # a head that lays the projection's output back on the positions' grid: run whole, scored alike
    inner = model.cls.predictions.forward
    monkeypatch.setattr(
        model.cls.predictions, "forward", lambda hidden: inner(hidden).reshape(*hidden.shape[:-1], -1)
    )
    rows, whole, dims = both()
    assert rows == whole and dims == [2, 3, 3]  # tried on the first batch, then the whole model


def test_unigram_loss_scores_the_evaluation_tokens_by_training_frequencies(
    small_info: TokenizerInfo, blocks: torch.Tensor
) -> None:
    train, val = blocks[8:], blocks[:8]
    loss = unigram_loss(train, val, small_info, seed=0)
    assert 0.0 < loss < math.log(small_info.vocab_size)  # frequencies beat a uniform guess
    assert loss == unigram_loss(train, val, small_info, seed=0)
    same_tokens = unigram_loss(val, val, small_info, seed=0)  # frequencies of the very tokens scored
    assert same_tokens < loss
