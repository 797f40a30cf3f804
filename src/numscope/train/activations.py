"""The precision in which autograd keeps the activations it saves for backward.

Micikevicius et al., "Mixed Precision Training" (2018) store activations in FP16: every tensor a layer
keeps for its backward pass costs half the memory of FP32, and backward computes from the rounded value.
:func:`store_activations` does that for every floating activation autograd saves during a model's forward
(through ``torch.autograd.graph.saved_tensors_hooks``): each float32 tensor saved for backward is kept as
an fp16 (or bf16) copy and handed back to backward as float32 again. Tensors already in 16 bits,
integer tensors, the model's parameters and buffers (whose storage is shared, not copied) and what a
plan's sites keep of a quantized operand (its codes and scales, or its values: already rounded to the
plan's format, exactly; see ``numscope._root_call.save_exactly``) are kept as they are. A tensor saved by
several ops is copied once per version.

Dropout's mask is kept in one bit per element instead of torch's CPU mask in the input's dtype
(:mod:`numscope.train.dropout`: the same draws, outputs and gradients bit for bit).

This covers more than ``numscope.convert(..., storage=...)``, which rounds only the GEMM inputs that the
site function saves: here the inputs of softmax, GELU, layer norm, losses and every other op are
rounded too.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from numscope._root_call import (
    INSIDE_SITES,
    RootCall,
    RootCalls,
    RootHandle,
    SavedTensorHooks,
    remove_mode,
    saved_exactly,
)
from numscope.train.dropout import CompactDropout

__all__ = ["STORAGE_DTYPES", "ActivationStore", "store_activations"]

STORAGE_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""The storage dtypes by name."""


class ActivationStore:
    """The saved-tensor hooks of :func:`store_activations`, for one model and one storage dtype.

    ``stored_bytes`` counts the bytes of the copies made during the latest forward (what autograd keeps
    for those tensors instead of their float32 originals), ``stored_tensors`` their number; ``kept_bytes``
    everything autograd keeps for that forward's backward through these hooks: the copies, and each storage
    of the tensors kept as they are (16-bit tensors, integer and boolean tensors, a plan's codes) once;
    parameters and buffers are not counted.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype, compact_dropout: bool = True) -> None:
        self.model = model
        self.dtype = dtype
        self.compact_dropout = compact_dropout
        self.stored_bytes = 0
        self.stored_tensors = 0
        self.kept_bytes = 0
        self._kept: set[int] = set()
        self._shared: set[int] = set()
        self._copies: dict[int, tuple[Any, int, tuple[Tensor, torch.dtype]]] = {}

    def forward(self, call: RootCall) -> AbstractContextManager[None]:
        """The context of one forward (``call``): which storages belong to the model, fresh counts, the
        hooks (which pack nothing once ``call`` has ended: a forward aborted by Ctrl-C leaves them on the
        stack until the model's next forward takes them off)."""
        return _Forward(self, call)

    def _pack(self, tensor: Tensor, call: RootCall) -> Any:
        if not call.is_live():
            return tensor
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self._shared:
            return tensor
        if tensor.dtype != torch.float32 or saved_exactly(tensor):
            if storage.data_ptr() not in self._kept:
                self._kept.add(storage.data_ptr())
                self.kept_bytes += storage.nbytes()
            return tensor
        key = id(tensor)
        known = self._copies.get(key)
        if known is not None and known[0]() is tensor and known[1] == tensor._version:
            return known[2]
        packed = (tensor.detach().to(self.dtype), tensor.dtype)
        self._copies[key] = (weakref.ref(tensor, lambda _, key=key: self._copies.pop(key, None)),
                             tensor._version, packed)  # fmt: skip
        self.stored_bytes += packed[0].numel() * packed[0].element_size()
        self.kept_bytes += packed[0].numel() * packed[0].element_size()
        self.stored_tensors += 1
        return packed


class _Forward:
    """The saved-tensor hooks of :class:`ActivationStore` for one forward, and its dropout."""

    def __init__(self, store: ActivationStore, call: RootCall) -> None:
        self.store = store
        self.hooks = SavedTensorHooks(lambda tensor: store._pack(tensor, call), _unpack)
        self.dropout = CompactDropout(call.is_live) if store.compact_dropout else None

    def __enter__(self) -> None:
        store = self.store
        store._shared = {
            t.untyped_storage().data_ptr() for t in (*store.model.parameters(), *store.model.buffers())
        }
        store.stored_bytes = store.stored_tensors = store.kept_bytes = 0
        store._kept = set()
        self.hooks.__enter__()
        if self.dropout is not None:
            self.dropout.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.dropout is not None:
            remove_mode(self.dropout)
        self.hooks.__exit__()
        self.store._kept = set()
        self.store._copies.clear()  # the graph holds the copies it needs; this forward's index is done


def _unpack(packed: Any) -> Tensor:
    if isinstance(packed, tuple):
        stored, dtype = packed
        return stored.to(dtype)
    return packed


def store_activations(
    model: nn.Module, dtype: torch.dtype | str, compact_dropout: bool = True
) -> tuple[RootHandle, ActivationStore]:
    """Keep every float32 activation that autograd saves during ``model``'s forward in ``dtype``.

    dtype: ``torch.float16``/``"fp16"`` or ``torch.bfloat16``/``"bf16"``. compact_dropout: keep dropout
    masks in bits (:mod:`numscope.train.dropout`; the same results). Returns the handle (its ``remove()``
    ends it) and the :class:`ActivationStore` with the latest forward's counts.
    """
    resolved = STORAGE_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if resolved not in STORAGE_DTYPES.values():
        raise ValueError(
            f"activation storage dtype must be one of {', '.join(STORAGE_DTYPES)} "
            f"(or torch.float16, torch.bfloat16), got {dtype!r}"
        )
    store = ActivationStore(model, resolved, compact_dropout)
    # not around activation checkpointing's recomputation: there the checkpoint's own hooks keep the tensors
    handle = RootCalls.of(model).register(
        lambda call, args, kwargs: store.forward(call), INSIDE_SITES, recompute=False
    )
    return handle, store
