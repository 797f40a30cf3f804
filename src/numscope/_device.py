"""Which device a run trains and measures on: one resolution for every verb and the Python API.

``auto`` is CUDA where torch sees a GPU, else the CPU; ``cuda`` is this process's GPU (``cuda:LOCAL_RANK``
under torchrun, one GPU per process); ``cpu`` the CPU. Everything a run makes (model, batches, scales,
amax histories, random draws) is then made on that device. The CPU and a GPU compute the same casts bit
for bit (numscope's device path, checked on the CPU in the tests); GEMMs and reductions follow each
device's own kernels, so whole runs agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from numscope.errors import SettingsError

DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
"""The device names a run takes (``TrainConfig.device``)."""


def resolve_device(name: str = "auto", *, field: str = "device") -> torch.device:
    """The ``torch.device`` that ``name`` (one of :data:`DEVICES`) means in this process.

    field: the setting's name in an error (what the caller was given it as)."""
    if name not in DEVICES:
        raise SettingsError(field, f"{name!r} unknown; allowed: {', '.join(DEVICES)}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SettingsError(
            field,
            f"{name!r} asks for a GPU, but torch {torch.__version__} sees none (a CPU build, or no CUDA "
            "device visible); use 'cpu' or 'auto'",
        )
    local = os.environ.get("LOCAL_RANK", "0")
    index = int(local) if local.isdigit() else 0
    if index >= torch.cuda.device_count():
        raise SettingsError(
            field,
            f"LOCAL_RANK={index} but only {torch.cuda.device_count()} GPU(s) are visible: launch at most one "
            "process per GPU (torchrun --nproc-per-node)",
        )
    return torch.device("cuda", index)


def backend_for(device: torch.device) -> str:
    """The ``torch.distributed`` backend for ranks on ``device``: NCCL on GPUs, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter or buffer (the CPU for a model without any)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """A batch (names to tensors) on ``device``; values that are not tensors stay as they are. Batches are
    drawn on the CPU from the run's seed, so the same seed gives the same batches on every device."""
    return {
        name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in batch.items()
    }
