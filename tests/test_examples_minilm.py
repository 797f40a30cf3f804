"""examples/minilm.py's vocabulary pruning, on a WordPiece tokenizer of numscope's own recipe (the pretrained
package itself is large and optional: the study that uses it is in docs/results/plan-study.md)."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

from tokenizers import Tokenizer

from numscope.run.tokenizer import SPECIAL_TOKENS, train_tokenizer

TEXT = [
    "the cat sat on the mat. the dog sat on the log.",
    "a quick brown fox jumps over the lazy dog, and the cat watches.",
    "numbers such as 12 and 345 appear in the text, as do rare words like quixotic.",
] * 20


def _minilm():
    path = Path(__file__).parent.parent / "examples" / "minilm.py"
    spec = importlib.util.spec_from_file_location("minilm_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pruned_vocabulary_keeps_the_special_and_frequent_tokens_renumbered():
    minilm = _minilm()
    full = train_tokenizer(TEXT, 200)
    original = json.loads(full.to_str())
    counts = Counter(i for encoding in full.encode_batch(TEXT) for i in encoding.ids)
    pruned, kept = minilm.prune_tokenizer(original, counts, 24)
    assert len(counts) > 30  # more ids in use than kept
    assert len(kept) == 24 == len(pruned["model"]["vocab"]) and kept == sorted(kept)
    assert sorted(pruned["model"]["vocab"].values()) == list(range(24))
    vocab = original["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    assert {by_id[i] for i in kept} >= set(SPECIAL_TOKENS)
    # the 19 most frequent ids besides the special tokens are kept, and nothing else
    ranked = [
        i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if by_id[i] not in SPECIAL_TOKENS
    ]
    assert set(kept) == {vocab[t] for t in SPECIAL_TOKENS} | set(ranked[:19])
    tokenizer = Tokenizer.from_str(json.dumps(pruned))
    # a text of kept tokens only encodes to the same tokens under new ids; [CLS]/[SEP] framing renumbered
    sentence = "the cat sat on the mat."
    before, after = full.encode(sentence), tokenizer.encode(sentence)
    if set(before.ids) <= set(kept):
        assert before.tokens == after.tokens
    assert (
        after.ids[0] == pruned["model"]["vocab"]["[CLS]"]
        and after.ids[-1] == pruned["model"]["vocab"]["[SEP]"]
    )
    assert max(after.ids) < 40
    assert pruned["truncation"] is None and pruned["padding"] is None
