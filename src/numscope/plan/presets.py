"""The preset plans (:meth:`Plan.uniform`): one site spec for every site."""

from __future__ import annotations

from typing import Any

from numscope.plan.spec import OperandSpec, SiteSpec
from numscope.vocab import Gemm, Operand


def _hybrid_fp8() -> SiteSpec:
    # Transformer Engine recipe.Format.HYBRID: "FP8 tensors in the forward pass are in e4m3 format, FP8
    # tensors in the backward pass are in e5m2 format": x and W (also where the backward GEMMs reuse
    # them) in E4M3, dy in E5M2. Float8CurrentScaling defaults to HYBRID with per-tensor current scaling.
    e4m3, e5m2 = OperandSpec("fp8_e4m3"), OperandSpec("fp8_e5m2")
    return SiteSpec(
        {
            (Gemm.FPROP, Operand.INPUT): e4m3,
            (Gemm.FPROP, Operand.WEIGHT): e4m3,
            (Gemm.DGRAD, Operand.GRAD_OUTPUT): e5m2,
            (Gemm.DGRAD, Operand.WEIGHT): e4m3,
            (Gemm.WGRAD, Operand.GRAD_OUTPUT): e5m2,
            (Gemm.WGRAD, Operand.INPUT): e4m3,
        }
    )


_PRESETS: dict[str, Any] = {
    "fp32": SiteSpec,
    # IEEE formats overflow to inf as the hardware does (overflow="propagate"): a loss scale that is too
    # large must show up as inf/NaN gradients so that the loss scaler backs off, not be hidden by clamping.
    "bf16": lambda: SiteSpec.uniform(OperandSpec("bf16", overflow="propagate")),
    "fp16": lambda: SiteSpec.uniform(OperandSpec("fp16", overflow="propagate")),
    "fp8": _hybrid_fp8,
    "fp8_e4m3": lambda: SiteSpec.uniform("fp8_e4m3"),
    # E4M3 for every MXFP8 operand, gradients included: Transformer Engine's MXFP8BlockScaling defaults to
    # fp8_format=Format.E4M3 ("E4M3 is used by default for both forward and backward passes. The
    # finer-grained scaling provides sufficient dynamic range without requiring the E5M2 format", TE docs,
    # features/low_precision_training/mxfp8), and torchao's MXLinear uses float8_e4m3fn for all three GEMMs.
    # The scale uses the OCP MX v1.0 floor rule; TE and Mishra et al. 2025 ("Recipes for pre-training LLMs
    # with MXFP8") round the scale up instead: use `all: mxfp8_e4m3@rceil` in a plan file for that.
    "mxfp8": lambda: SiteSpec.uniform("mxfp8_e4m3"),
    # E3M2 (the wider-range MXFP6) for every operand, as Rouhani et al. 2023 ("Microscaling data formats
    # for deep learning") train with MXFP6 weights, activations and gradients.
    "mxfp6": lambda: SiteSpec.uniform("mxfp6_e3m2"),
    "mxfp4": lambda: SiteSpec.uniform("mxfp4_e2m1"),
    # Plain NVFP4 everywhere. NVIDIA's NVFP4 training recipe (TE NVFP4BlockScaling) adds stochastic
    # rounding of gradients, a random Hadamard transform for wgrad, 16×16 weight scales and keeps some
    # layers high; examples/plans/nvfp4_stochastic_grads.yaml shows the rounding part as a plan.
    "nvfp4": lambda: SiteSpec.uniform("nvfp4"),
    "int8": lambda: SiteSpec.uniform("int8"),
    # The 2018 mixed-precision paper's loss-scaling experiment one step down from fp16: every gradient
    # entering a GEMM (dgrad's and wgrad's grad_output) in FP8 E5M2 with no scale of its own, everything else
    # FP32. E5M2 has fp16's exponent range but its smallest subnormal is 2^-16 (fp16's 2^-24), so small
    # gradients flush to zero unless the loss is scaled; it overflows to inf, as fp16 does, so that a loss
    # scale too large shows up and the loss scaler backs off.
    "e5m2_grads": lambda: SiteSpec(
        {
            (gemm, Operand.GRAD_OUTPUT): OperandSpec("fp8_e5m2", scaling="none", overflow="propagate")
            for gemm in (Gemm.DGRAD, Gemm.WGRAD)
        }
    ),
}
