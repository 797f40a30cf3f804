"""Scaled dot-product attention emulated as two sites (``scores`` and ``context``), any head layout."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from numscope.vocab import Gemm, Operand


def sdpa_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    matmul: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as explicit GEMMs: scores = q·kᵀ, scale, mask, softmax in fp32,
    dropout (``F.dropout``, inverted), context = p·v.

    attn_mask: boolean (True = attend) or additive, broadcastable to (..., L, S). is_causal: a lower
    triangular (top-left aligned) mask. enable_gqa: key/value heads repeated to the query's heads.
    matmul(role, a, b): how each product is computed (``torch.matmul`` by default; the runtime passes its
    sites ``scores`` and ``context``).
    """
    product = matmul if matmul is not None else (lambda role, a, b: torch.matmul(a, b))
    length, source = query.size(-2), key.size(-2)
    factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    key, value = _sdpa_kv_heads({"query": query, "key": key, "value": value, "enable_gqa": enable_gqa})
    scores = product("scores", query, key.transpose(-2, -1)).float() * factor
    if is_causal:
        keep = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return product("context", probs, value)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = dict(zip(_SDPA_ARGS, args, strict=False))
    bound.update(kwargs)
    return bound


def _sdpa_kv_heads(bound: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value with their heads as the products see them: under ``enable_gqa`` (grouped-query
    attention: fewer key/value heads than query heads, each shared by a group of consecutive query heads)
    every key/value head repeated to its group, as ``F.scaled_dot_product_attention`` does; a head count
    that does not divide the query's is the error SDPA itself raises."""
    query, key, value = bound["query"], bound["key"], bound["value"]
    if not bound.get("enable_gqa", False) or query.dim() < 3 or key.size(-3) == query.size(-3):
        return key, value
    heads, kv_heads = query.size(-3), key.size(-3)
    if heads % kv_heads or value.size(-3) != kv_heads:
        raise RuntimeError(
            f"scaled_dot_product_attention with enable_gqa: query heads ({heads}) must be a multiple of "
            f"key heads ({kv_heads}), and value heads ({value.size(-3)}) must equal key heads"
        )
    repeat = heads // kv_heads
    return key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)


def _sdpa_sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[dict, dict]:
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    scores = math.prod(batch) * q.shape[-2] * k.shape[-2]
    out = math.prod(batch) * q.shape[-2] * v.shape[-1]
    return _sizes(q.numel(), k.numel(), scores), _sizes(scores, v.numel(), out)


def _sizes(a: int, b: int, out: int) -> dict[tuple[str, str], int]:
    return {
        (Gemm.FPROP, Operand.INPUT): a,
        (Gemm.FPROP, Operand.WEIGHT): b,
        (Gemm.DGRAD, Operand.GRAD_OUTPUT): out,
        (Gemm.DGRAD, Operand.WEIGHT): b,
        (Gemm.WGRAD, Operand.GRAD_OUTPUT): out,
        (Gemm.WGRAD, Operand.INPUT): a,
    }
