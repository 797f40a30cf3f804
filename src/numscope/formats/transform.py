"""Rotations applied to an operand before it is cast: the random Hadamard transform (RHT).

NVIDIA's NVFP4 training recipe (Transformer Engine ``NVFP4BlockScaling``) and the MXFP4 recipe of Tseng
et al. 2025 ("Training LLMs with MXFP4") rotate the operands of a GEMM, in blocks of ``size`` consecutive
elements along its contraction axis, by Q = D·H / √size (H the Sylvester Hadamard matrix, D a diagonal of
random signs), and quantize the rotated values: outliers spread over their block, and the product is
unchanged because Q is orthogonal (xQ · (yQ)ᵀ = x·yᵀ). numscope emulates this on each operand as
Qᵀ·quantize(Q·x): the rotated tensor is quantized, then rotated back, so that the GEMM of two operands
rotated alike equals that of their quantized rotations, up to float32 rounding of the two rotations
(relative 1e-7, far below any format's error here). Pure functions; the sign vector is drawn from a
``torch.Generator`` seeded with ``seed``, so it is the same in every process.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_RHT = re.compile(r"^rht(\d+)(?::(\d+|fresh))?$")


@dataclass(frozen=True)
class Rotation:
    """A random Hadamard transform: blocks of ``size`` (a power of two) and the seed of its signs.

    ``fresh`` (``rhtN:fresh``): new random signs for every GEMM call, shared by the GEMM's two operands, as
    the MXFP4 recipe's code draws them in each backward call; ``numscope.convert`` draws them (from its
    generator) and passes them as ``signs``. Where no GEMM call draws them (``quantize``, the observer's
    measurements), a fresh transform uses the seed-0 signs: the same distribution, one fixed draw.
    """

    size: int = 16
    seed: int = 0
    fresh: bool = False
    #: an explicit sign vector (±1, ``size`` long) that replaces the seeded one (a fresh transform's draw)
    signs: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.size < 2 or self.size & (self.size - 1):
            raise ValueError(f"a Hadamard transform's size must be a power of two >= 2, got {self.size}")
        if self.seed < 0:
            raise ValueError(f"a Hadamard transform's seed must be >= 0, got {self.seed}")
        if self.signs is not None and (
            len(self.signs) != self.size or any(sign not in (1, -1) for sign in self.signs)
        ):
            raise ValueError(f"a Hadamard transform's signs are {self.size} values of +1 or -1")

    @classmethod
    def parse(cls, name: str) -> Rotation:
        """``rht16`` (blocks of 16, seed 0), ``rht32:7`` (blocks of 32, seed 7), ``rht64:fresh`` (blocks of
        64, new signs for every GEMM call)."""
        found = _RHT.match(name.strip().lower()) if isinstance(name, str) else None
        if found is None:
            raise ValueError(
                f"unknown transform {name!r}; allowed: 'rhtN', 'rhtN:SEED' or 'rhtN:fresh' (a random "
                "Hadamard transform of blocks of N, a power of two, e.g. 'rht16')"
            )
        if found.group(2) == "fresh":
            return cls(int(found.group(1)), fresh=True)
        return cls(int(found.group(1)), int(found.group(2) or 0))

    @property
    def name(self) -> str:
        if self.fresh:
            return f"rht{self.size}:fresh"
        return f"rht{self.size}" + (f":{self.seed}" if self.seed else "")

    def with_signs(self, signs: torch.Tensor) -> Rotation:
        """This transform with an explicit sign vector (a fresh transform's draw for one GEMM call)."""
        return Rotation(self.size, self.seed, self.fresh, tuple(int(s) for s in signs.tolist()))

    def draw_signs(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """A new sign vector (±1, int64), from ``generator`` (None: torch's default generator)."""
        return torch.randint(0, 2, (self.size,), generator=generator) * 2 - 1

    def matrix(self, device: torch.device | None = None) -> torch.Tensor:
        """Q = D·H / √size, float32 (orthogonal)."""
        if self.signs is not None:
            return _signed(self.size, self.signs).to(device)
        return _matrix(self.size, self.seed).to(device)

    def rotate(self, x: torch.Tensor, axis: int = -1, inverse: bool = False) -> torch.Tensor:
        """``x`` rotated by Q (or Qᵀ) in blocks along ``axis``, which must be a multiple of ``size`` long."""
        if x.shape[axis] % self.size:
            raise ValueError(
                f"a Hadamard transform of blocks of {self.size} needs a length divisible by {self.size} "
                f"along axis {axis}, got shape {tuple(x.shape)}"
            )
        moved = x.float().movedim(axis, -1)
        q = self.matrix(x.device)
        blocks = moved.reshape(*moved.shape[:-1], -1, self.size)
        rotated = blocks @ (q.t() if inverse else q)
        return rotated.reshape(moved.shape).movedim(-1, axis)

    def quantized(
        self, x: torch.Tensor, axis: int, quantize: Callable[[torch.Tensor, int], torch.Tensor]
    ) -> torch.Tensor:
        """Qᵀ·quantize(Q·x) along ``axis`` (float32): ``quantize(rotated, axis)`` gets the rotated tensor,
        zero-padded to whole blocks along ``axis``; the padding is dropped after the rotation back."""
        axis = axis % max(x.dim(), 1)
        length = x.shape[axis] if x.dim() else 1
        moved = x.float().reshape(1) if x.dim() == 0 else x.float().movedim(axis, -1)
        pad = (-length) % self.size
        padded = F.pad(moved, (0, pad)) if pad else moved
        restored = self.rotate(quantize(self.rotate(padded), -1), inverse=True)[..., :length]
        return restored.reshape(x.shape) if x.dim() == 0 else restored.movedim(-1, axis)


@functools.cache
def _hadamard(size: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of order ``size``, float64."""
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < size:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    return hadamard


@functools.cache
def _matrix(size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (size,), generator=generator, dtype=torch.float64) * 2 - 1
    return _signed(size, tuple(int(sign) for sign in signs.tolist()))


@functools.lru_cache(maxsize=64)
def _signed(size: int, signs: tuple[int, ...]) -> torch.Tensor:
    vector = torch.tensor(signs, dtype=torch.float64)
    return (vector[:, None] * _hadamard(size) / math.sqrt(size)).float()
