"""AdamW with its moments stored in FP8: the optimizer state in low precision, as torchao's ``AdamWFp8``.

Adam keeps two moments per parameter, 8 bytes per parameter in FP32: as much as the parameter and its gradient
together. :class:`AdamWFp8` stores each moment of a parameter with at least ``min_size`` elements (a multiple
of ``block_size``) as FP8 E4M3 codes with one FP32 scale per ``block_size`` consecutive elements (2 + 8/256
bytes per parameter for both moments instead of 8); smaller parameters keep FP32 moments. Each step
dequantizes the moments, updates in FP32 and quantizes them again; the parameter is updated in FP32.

This is torchao 0.18's ``torchao.optim.AdamWFp8`` (``optim/adam.py``'s ``single_param_adam``,
``optim/subclass_fp8.py``'s ``quantize_fp8``) written out in eager torch: scale = max(block amax, 1e-12) /
448, codes = E4M3(x / scale) rounded to nearest even, decoded as codes × scale, moments updated with
``lerp``, ``min_size`` 4096 as bitsandbytes and torchao. Equal bit for bit to torchao's update run eagerly on
its FP8 state (``tests/train/test_optim.py``); torchao runs it under ``torch.compile``, whose fused kernel
rounds some parameters 1 ulp apart from its own eager run.
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


class _Fp8State:
    """One moment of one parameter in FP8 blocks."""

    __slots__ = ("codes", "scale")

    def __init__(self, shape: torch.Size, block_size: int, device: torch.device) -> None:
        self.codes = torch.zeros(shape, dtype=E4M3, device=device)
        self.scale = torch.zeros(shape.numel() // block_size, device=device)

    def value(self) -> Tensor:
        return dequantize_blocks(self.codes, self.scale)

    def store(self, x: Tensor) -> None:
        codes, scale = quantize_blocks(x, self.codes.numel() // self.scale.numel())
        self.codes.copy_(codes)
        self.scale.copy_(scale)

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * 4


class AdamWFp8(torch.optim.Optimizer):
    """AdamW whose moments are FP8 E4M3 blocks (see the module docstring); ``torch.optim.AdamW``'s arguments.

    block_size: elements per FP32 scale (256, torchao's default). min_size: parameters with fewer elements, or
    a count that ``block_size`` does not divide, keep FP32 moments (4096). ``state_bytes()`` says what the
    moments take.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = 256,
        min_size: int = 4096,
    ) -> None:
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

    def _new_moment(self, p: Tensor) -> _Fp8State | Tensor:
        if p.numel() >= self.min_size and p.numel() % self.block_size == 0:
            return _Fp8State(p.shape, self.block_size, p.device)
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
                    raise OptimizerError("AdamWFp8 does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = self._new_moment(p)
                    state["exp_avg_sq"] = self._new_moment(p)
                state["step"] += 1
                _adamw_step(p, p.grad, state, lr, beta1, beta2, group["weight_decay"], group["eps"])
        return loss

    def state_bytes(self) -> int:
        """Bytes the moments take (codes, scales and the FP32 moments of small parameters)."""
        total = 0
        for state in self.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                moment = state.get(name)
                if isinstance(moment, _Fp8State):
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
                if isinstance(moment, _Fp8State):
                    state[name] = {"codes": moment.codes.clone(), "scale": moment.scale.clone()}
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                moment = state.get(name)
                if isinstance(moment, dict):
                    # torch's load_state_dict casts every state tensor to its parameter's dtype: the codes
                    # come back as float32 holding the E4M3 values, cast back to E4M3 exactly
                    restored = _Fp8State.__new__(_Fp8State)
                    restored.codes, restored.scale = moment["codes"].to(E4M3), moment["scale"].float()
                    state[name] = restored


def _value(moment: _Fp8State | Tensor) -> Tensor:
    return moment.value() if isinstance(moment, _Fp8State) else moment.float()


def _store(moment: _Fp8State | Tensor, x: Tensor) -> None:
    if isinstance(moment, _Fp8State):
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
