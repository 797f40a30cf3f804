"""One way to leave torch's random state as the caller had it."""

from __future__ import annotations

import contextlib

import torch


def cuda_devices() -> list[int]:
    """Every CUDA device (none without CUDA): the generators a forked random state must save and restore."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def fork_rng() -> contextlib.AbstractContextManager[None]:
    """``torch.random.fork_rng`` over the CPU generator and every CUDA device's.

    ``torch.manual_seed`` reseeds every CUDA generator as well (or queues the seed until CUDA starts), so a
    fork of the CPU generator alone would hand a GPU user's random stream numscope's seed.
    """
    return torch.random.fork_rng(devices=cuda_devices())


def rng_snapshot() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The state of torch's default CPU generator and of every CUDA device's (dropout on a GPU draws
    there)."""
    return torch.get_rng_state(), [torch.cuda.get_rng_state(device) for device in cuda_devices()]


def restore_rng(snapshot: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    """Set the generators back to what :func:`rng_snapshot` saw."""
    cpu, cuda = snapshot
    torch.set_rng_state(cpu)
    for device, state in zip(cuda_devices(), cuda, strict=True):
        torch.cuda.set_rng_state(state, device)
