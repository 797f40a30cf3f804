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
