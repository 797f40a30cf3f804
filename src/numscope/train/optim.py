"""AdamW with its moments stored in low precision, as torchao's low-bit optimizers.

Adam keeps two moments per parameter, 8 bytes per parameter in FP32: as much as the parameter and its gradient
together. These optimizers store each moment of a parameter with at least ``min_size`` elements (a multiple
of ``block_size``) as low-precision codes with one FP32 scale per ``block_size`` consecutive elements, smaller
parameters keep FP32 moments. Each step dequantizes the moments, updates in FP32 and quantizes them again; the
parameter is updated in FP32. Three state formats, each torchao 0.18's (``torchao.optim``) written out in
eager torch:

* :class:`AdamWFp8` (``AdamWFp8``, ``optim/subclass_fp8.py``): FP8 E4M3 codes, scale = max(block amax,
  1e-12) / 448, codes = E4M3(x / scale) rounded to nearest even, decoded as codes × scale; blocks of 256;
  2 + 8/256 bytes per parameter for both moments.
* :class:`AdamW8bit` (``AdamW8bit``, ``optim/subclass_8bit.py``; Dettmers et al. 2022, "8-bit Optimizers
  via Block-wise Quantization"): 8-bit codes into bitsandbytes' *dynamic tree* map (:func:`dynamic_map`:
  256 values spread over seven decades, signed for the first moment, unsigned for the second), scale =
  max(block amax, 1e-12), the code the nearest map value to x / scale (a tie goes up); blocks of 256; the
  same bytes as FP8.
* :class:`AdamW4bit` (``AdamW4bit``, ``optim/subclass_4bit.py``; Li et al. 2023, "Memory Efficient
  Optimizers with 4-bit States"): 4-bit codes, two per byte, into a 16-value dynamic map for the first moment
  and the linear map 1/16 … 16/16 (no zero) for the second; blocks of 128; 1 + 16/128 bytes per parameter
  for both moments.

The update is torchao's ``single_param_adam`` (``optim/adam.py``: AdamW, moments updated with ``lerp``,
``min_size`` 4096 as bitsandbytes and torchao). Each is equal bit for bit to torchao's update run eagerly on
its own state subclass (``tests/train/test_optim.py``); torchao runs it under ``torch.compile``, whose fused
kernel rounds some parameters 1 ulp apart from its own eager run. A NaN in a moment is coded as the map's
first value (as torchao's branchless search does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from numscope.errors import NumscopeError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-12


class OptimizerError(NumscopeError, ValueError):
    """An optimizer setting that cannot work (what was wrong, what is allowed)."""


def quantize_blocks(x: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """``x`` as E4M3 codes (its shape) and one FP32 scale per ``block_size`` consecutive elements."""
    blocks = x.reshape(-1, block_size)
    scale = blocks.abs().amax(-1).clip(AMAX_FLOOR) / E4M3_MAX
    codes = (blocks / scale.view(-1, 1)).to(E4M3)
    return codes.view(x.shape), scale


def dequantize_blocks(codes: Tensor, scale: Tensor) -> Tensor:
    """FP32 values of :func:`quantize_blocks`' codes and scales."""
    return (codes.float().view(-1, codes.numel() // scale.numel()) * scale.view(-1, 1)).view(codes.shape)


def dynamic_map(signed: bool, bits: int = 8) -> Tensor:
    """bitsandbytes' dynamic tree map of ``bits`` (8 or 4) as float32, ascending: in each of the bits − 1
    decades below 1 (decade d = 0 … bits − 2 spans 10^(d + 2 − bits) × [0.1, 1]), the midpoints of
    ``linspace(0.1, 1)`` cut into 2^d parts (2^(d + 1) unsigned), with their negatives when signed; then 0 and
    1: 2^bits values in [−1, 1] (unsigned [0, 1]), denser near 0."""
    if bits not in (4, 8):
        raise OptimizerError(f"a dynamic map has 8 or 4 bits, got {bits!r}")
    values: list[float] = [0.0, 1.0]
    for decade in range(bits - 1):
        edges = torch.linspace(0.1, 1, 2 ** (decade + (0 if signed else 1)) + 1)
        midpoints = (edges[:-1] + edges[1:]) / 2.0
        unit = 10 ** (decade + 2 - bits)
        values += (unit * midpoints).tolist()
        if signed:
            values += (-unit * midpoints).tolist()
    assert len(values) == 2**bits
    return torch.tensor(sorted(values), dtype=torch.float32)


def linear_map(bits: int = 4) -> Tensor:
    """The unsigned linear map of torchao's 4-bit second moment: 1/2^bits … 1 in 2^bits steps (no zero)."""
    return torch.linspace(0, 1, 2**bits + 1)[1:]


def quantize_map(x: Tensor, qmap: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """``x`` (flattened) as codes into ``qmap`` (uint8, one per element) after dividing each block of
    ``block_size`` by its scale max(block amax, 1e-12); the code of the nearest map value, a tie to the
    larger; and the scales."""
    blocks = x.reshape(-1, block_size)
    scale = blocks.abs().amax(-1).clip(AMAX_FLOOR)
    scaled = (blocks / scale.view(-1, 1)).reshape(-1)
    last = qmap.numel() - 1
    below = (torch.searchsorted(qmap, scaled, right=True) - 1).clamp(0, last)  # the largest value ≤ x
    below = torch.where(scaled.isnan(), 0, below)
    above = (below + 1).clamp(max=last)
    low, high = qmap[below], qmap[above]
    codes = torch.where(scaled - low >= (high - low) * 0.5, above, below)
    return codes.to(torch.uint8), scale


def dequantize_map(codes: Tensor, qmap: Tensor, scale: Tensor) -> Tensor:
    """FP32 values of :func:`quantize_map`'s codes (flat) and scales."""
    return (qmap[codes.int()].view(scale.shape[0], -1) * scale.view(-1, 1)).view(-1)


class _Fp8State:
    """One moment of one parameter in FP8 blocks."""

    __slots__ = ("codes", "scale")

    def __init__(self, shape: torch.Size, block_size: int, device: torch.device | None) -> None:
        self.codes = torch.zeros(shape, dtype=E4M3, device=device)
        self.scale = torch.zeros(shape.numel() // block_size, device=device)

    def value(self) -> Tensor:
        return dequantize_blocks(self.codes, self.scale)

    def store(self, x: Tensor) -> None:
        codes, scale = quantize_blocks(x, self.codes.numel() // self.scale.numel())
        self.codes.copy_(codes)
        self.scale.copy_(scale)

    def restore(self, saved: dict[str, Tensor]) -> None:
        # torch's load_state_dict casts every state tensor to its parameter's dtype: the codes come back as
        # float32 holding the E4M3 values, cast back to E4M3 exactly
        self.codes, self.scale = saved["codes"].to(E4M3), saved["scale"].float()

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * 4


class _MapState:
    """One moment of one parameter as codes into a map (8 bits, or 4 bits packed two per byte)."""

    __slots__ = ("bits", "codes", "qmap", "scale", "shape")

    def __init__(
        self, shape: torch.Size, block_size: int, device: torch.device | None, qmap: Tensor, bits: int
    ) -> None:
        self.shape, self.bits, self.qmap = shape, bits, qmap.to(device)
        self.codes = torch.zeros(shape.numel() * bits // 8, dtype=torch.uint8, device=device)
        self.scale = torch.zeros(shape.numel() // block_size, device=device)

    def value(self) -> Tensor:
        codes = self.codes
        if self.bits == 4:  # high nibble first
            codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)
        return dequantize_map(codes, self.qmap, self.scale).view(self.shape)

    def store(self, x: Tensor) -> None:
        block_size = self.shape.numel() // self.scale.numel()
        codes, scale = quantize_map(x, self.qmap, block_size)
        if self.bits == 4:
            codes = (codes[::2] << 4) | codes[1::2]
        self.codes.copy_(codes)
        self.scale.copy_(scale)

    def restore(self, saved: dict[str, Tensor]) -> None:
        self.codes, self.scale = saved["codes"].to(torch.uint8), saved["scale"].float()  # exact: 0 … 255

    def nbytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4


_State = _Fp8State | _MapState


class _AdamWBlocks(torch.optim.Optimizer):
    """AdamW whose moments are blocks of low-precision codes (see the module docstring); the state format
    is the subclass's ``_state``."""

    block_size_default = 256

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int | None = None,
        min_size: int = 4096,
    ) -> None:
        block_size = self.block_size_default if block_size is None else block_size
        if not lr >= 0:
            raise OptimizerError(f"lr must be ≥ 0, got {lr!r}")
        if not eps >= 0:
            raise OptimizerError(f"eps must be ≥ 0, got {eps!r}")
        if not all(0 <= beta < 1 for beta in betas) or len(betas) != 2:
            raise OptimizerError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise OptimizerError(f"block_size must be a whole number ≥ 1, got {block_size!r}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.block_size, self.min_size = block_size, min_size

    def _state(self, p: Tensor, signed: bool) -> _State:
        raise NotImplementedError

    def _new_moment(self, p: Tensor, signed: bool) -> _State | Tensor:
        if p.numel() >= self.min_size and p.numel() % self.block_size == 0:
            return self._state(p, signed)
        return torch.zeros_like(p, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = torch.tensor(group["lr"], dtype=torch.float32)  # torchao keeps lr as a float32 tensor
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise OptimizerError(f"{type(self).__name__} does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = self._new_moment(p, signed=True)
                    state["exp_avg_sq"] = self._new_moment(p, signed=False)
                state["step"] += 1
                _adamw_step(p, p.grad, state, lr, beta1, beta2, group["weight_decay"], group["eps"])
        return loss

    def state_bytes(self) -> int:
        """Bytes the moments take (codes, scales and the FP32 moments of small parameters)."""
        total = 0
        for state in self.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                moment = state.get(name)
                if isinstance(moment, _State):
                    total += moment.nbytes()
                elif isinstance(moment, Tensor):
                    total += moment.numel() * moment.element_size()
        return total

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for index, state in saved["state"].items():
            state = saved["state"][index] = dict(state)  # torch's packed state is the live one: copy
            for name in ("exp_avg", "exp_avg_sq"):
                moment = state.get(name)
                if isinstance(moment, _State):
                    state[name] = {"codes": moment.codes.clone(), "scale": moment.scale.clone()}
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            for name in ("exp_avg", "exp_avg_sq"):
                saved = state.get(name)
                if isinstance(saved, dict):
                    moment = self._state(p, signed=name == "exp_avg")
                    moment.restore(saved)
                    state[name] = moment


class AdamWFp8(_AdamWBlocks):
    """AdamW whose moments are FP8 E4M3 blocks (see the module docstring); ``torch.optim.AdamW``'s arguments.

    block_size: elements per FP32 scale (256, torchao's default). min_size: parameters with fewer elements, or
    a count that ``block_size`` does not divide, keep FP32 moments (4096). ``state_bytes()`` says what the
    moments take.
    """

    def _state(self, p: Tensor, signed: bool) -> _State:
        return _Fp8State(p.shape, self.block_size, p.device)


class AdamW8bit(_AdamWBlocks):
    """AdamW whose moments are 8-bit codes into the dynamic tree map (see the module docstring), blocks of
    256 by default; arguments as :class:`AdamWFp8`."""

    def _state(self, p: Tensor, signed: bool) -> _State:
        return _MapState(p.shape, self.block_size, p.device, dynamic_map(signed, 8), 8)


class AdamW4bit(_AdamWBlocks):
    """AdamW whose moments are 4-bit codes, two per byte (the first moment into the 4-bit dynamic map, the
    second into the linear map; see the module docstring), blocks of 128 by default; arguments as
    :class:`AdamWFp8` (``block_size`` even)."""

    block_size_default = 128

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        if self.block_size % 2:
            raise OptimizerError(
                f"4-bit codes pack two per byte: block_size must be even, got {self.block_size}"
            )

    def _state(self, p: Tensor, signed: bool) -> _State:
        qmap = dynamic_map(True, 4) if signed else linear_map(4)
        return _MapState(p.shape, self.block_size, p.device, qmap, 4)


def _value(moment: _State | Tensor) -> Tensor:
    return moment.value() if isinstance(moment, _State) else moment.float()


def _store(moment: _State | Tensor, x: Tensor) -> None:
    if isinstance(moment, _State):
        moment.store(x)
    else:
        moment.copy_(x)


def _adamw_step(
    p: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    lr: Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
) -> None:
    """torchao's ``single_param_adam`` (AdamW, no amsgrad, no bf16 stochastic rounding), in eager torch."""
    p_f32 = p.float()
    grad_f32 = grad.float()
    p_f32 = p_f32 - lr * weight_decay * p_f32
    step = state["step"]
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    exp_avg = _value(state["exp_avg"]).lerp(grad_f32, 1 - beta1)
    exp_avg_sq = _value(state["exp_avg_sq"]).lerp(grad_f32.square(), 1 - beta2)
    _store(state["exp_avg"], exp_avg)
    _store(state["exp_avg_sq"], exp_avg_sq)
    denom = (exp_avg_sq.sqrt() / bias_correction2.sqrt()) + eps
    p_f32 = p_f32 - lr * (exp_avg / bias_correction1) / denom
    p.copy_(p_f32)
