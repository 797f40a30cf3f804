"""The demo's model: a small BERT masked-language model built from a config, never fetched from a hub.

The defaults (2 layers, hidden 128, 2 heads, FFN 512) make 0.42 M parameters outside the embeddings plus
vocabulary × hidden in them (1.46 M in all at 8,000 tokens): a model that trains on a CPU in minutes and
still has every GEMM a full BERT has: Q/K/V and
output projections, the two FFN linears, the MLM head's transform and its decoder, whose weight is tied to
the word embeddings.

By default (``mlm_head="masked"``) the MLM head runs on the masked positions only when labels are given, as
BERT's own pre-training code does (``gather_indexes`` in Google's ``run_pretraining.py``; NVIDIA's BERT
likewise): the loss and every gradient are those of the full head (unmasked positions carry no loss), but
the vocabulary-sized GEMMs shrink to the masked share of the tokens (15% in BERT's pre-training). Without
labels the head scores every position, so ``logits`` are ``[batch, seq, vocab]`` as usual.
``mlm_head="all"`` keeps transformers' behaviour (the head on every position always).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from numscope._lazy import require
from numscope._rng import fork_rng
from numscope.run.data import IGNORE_INDEX

if TYPE_CHECKING:  # transformers is the demo's dependency (numscope[demo]), imported where it is used
    from transformers import BertConfig, BertForMaskedLM

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")
"""``eager`` computes attention with explicit matmuls (visible to GEMM-site discovery); ``sdpa`` calls
``torch.nn.functional.scaled_dot_product_attention`` (a fused kernel where the device has one)."""
MLM_HEADS = ("masked", "all")
"""Where the MLM head runs given labels: ``masked`` positions only (BERT's pre-training), or ``all``."""


@dataclass(frozen=True)
class ModelConfig:
    """The knobs of the demo's BERT MLM; sizes in elements, dropout as a probability."""

    vocab_size: int
    hidden: int = 128
    layers: int = 2
    heads: int = 2
    intermediate: int = 512
    max_position: int = 128
    dropout: float = 0.1
    attn_implementation: str = "eager"
    pad_token_id: int = 0
    seed: int = 0
    mlm_head: str = "masked"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "layers", "heads", "intermediate", "max_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer; got {value!r}")
        if self.hidden % self.heads:
            divisors = [count for count in range(1, self.hidden + 1) if self.hidden % count == 0]
            raise ValueError(
                f"ModelConfig.hidden={self.hidden} is not divisible by heads={self.heads}; "
                f"head counts that divide {self.hidden}: {divisors}"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise ValueError(f"ModelConfig.dropout must be a number in [0, 1); got {self.dropout!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1); got {self.dropout!r}")
        if self.attn_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"unknown attn_implementation {self.attn_implementation!r}; "
                f"known: {list(ATTENTION_IMPLEMENTATIONS)}"
            )
        if self.mlm_head not in MLM_HEADS:
            raise ValueError(f"unknown mlm_head {self.mlm_head!r}; known: {list(MLM_HEADS)}")
        if isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int):
            raise ValueError(f"ModelConfig.pad_token_id must be an integer; got {self.pad_token_id!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"ModelConfig.pad_token_id={self.pad_token_id} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"ModelConfig.seed must be an integer; got {self.seed!r}")

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON/YAML-ready data."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Rebuild a config from :meth:`to_dict`'s output; unknown keys are an error that lists the known."""
        known = [field.name for field in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; known: {known}")
        return cls(**data)

    def to_bert_config(self) -> BertConfig:
        """The equivalent ``transformers.BertConfig``."""
        return require("transformers", "the demo's BERT").BertConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            intermediate_size=self.intermediate,
            max_position_embeddings=self.max_position,
            hidden_dropout_prob=self.dropout,
            attention_probs_dropout_prob=self.dropout,
            pad_token_id=self.pad_token_id,
            attn_implementation=self.attn_implementation,
        )


def _masked_class() -> type:
    """``BertForMaskedLMAtMasks``, defined on first use (transformers is imported then)."""
    transformers = require("transformers", "the demo's BERT")
    from transformers.modeling_outputs import MaskedLMOutput

    class BertForMaskedLMAtMasks(transformers.BertForMaskedLM):
        """``BertForMaskedLM`` whose MLM head, given labels, runs on the labelled positions only.

        With ``labels`` the output's ``logits`` are ``[labelled positions, vocab]`` (row-major order of the
        labelled positions) and ``loss`` the mean cross-entropy over them, equal to the full head's loss;
        without labels the forward is ``BertForMaskedLM``'s.
        """

        head_at_labels = True  # numscope.run.data.HEAD_AT_LABELS: evaluate_mlm gives it the labels

        def forward(  # type: ignore[override]
            self,
            input_ids: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None,
            labels: torch.Tensor | None = None,
            **kwargs: Any,
        ) -> MaskedLMOutput:
            if labels is None:
                return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            hidden = self.bert(input_ids, attention_mask=attention_mask, return_dict=True, **kwargs)[0]
            selected = labels != IGNORE_INDEX
            logits = self.cls(hidden[selected])
            loss = torch.nn.functional.cross_entropy(logits.float(), labels[selected])
            return MaskedLMOutput(loss=loss, logits=logits)

    BertForMaskedLMAtMasks.__module__ = __name__  # pickled by name: found again through __getattr__
    return BertForMaskedLMAtMasks


def __getattr__(name: str) -> Any:
    if name == "BertForMaskedLMAtMasks":
        if name not in globals():  # once: every model (and a pickle) sees the same class
            globals()[name] = _masked_class()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def bert_mlm_from_config(config: ModelConfig) -> BertForMaskedLM:
    """A freshly initialised BERT MLM (BERT's init: normal, std 0.02), seeded by ``config.seed``.

    The seed is applied inside a forked RNG, so building a model leaves the global torch RNG untouched.
    """
    transformers = require("transformers", "the demo's BERT")
    model_class = (
        __getattr__("BertForMaskedLMAtMasks") if config.mlm_head == "masked" else transformers.BertForMaskedLM
    )
    with fork_rng():
        torch.manual_seed(config.seed)
        model = model_class(config.to_bert_config())
    return model


def make_bert_mlm(
    vocab_size: int,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 2,
    intermediate: int = 512,
    max_position: int = 128,
    dropout: float = 0.1,
    attn_implementation: str = "eager",
    seed: int = 0,
    pad_token_id: int = 0,
    mlm_head: str = "masked",
) -> BertForMaskedLM:
    """A freshly initialised BERT masked-LM; see :class:`ModelConfig` for the arguments and their checks."""
    return bert_mlm_from_config(
        ModelConfig(
            vocab_size=vocab_size,
            hidden=hidden,
            layers=layers,
            heads=heads,
            intermediate=intermediate,
            max_position=max_position,
            dropout=dropout,
            attn_implementation=attn_implementation,
            pad_token_id=pad_token_id,
            seed=seed,
            mlm_head=mlm_head,
        )
    )
