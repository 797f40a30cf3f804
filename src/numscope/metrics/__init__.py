"""Metrics of tensors and of what number formats do to them (pure tensor functions, no I/O).

:mod:`numscope.metrics.stats` describes one high-precision tensor (range, binade histogram, tails);
:mod:`numscope.metrics.errors` measures a format against it (SQNR, under/overflow, block scales);
:mod:`numscope.metrics.backward_error` the backward error of a quantized GEMM.
"""

from numscope.metrics.backward_error import (
    BackwardError,
    ProductReference,
    backward_error,
    backward_error_from,
    product_reference,
)
from numscope.metrics.errors import (
    AUTO,
    BlockScaleSpread,
    block_scale_spread,
    candidate_metrics,
    cosine_similarity,
    operand_metrics,
    overflow_fraction,
    quantize_sample,
    relative_error,
    saturated_block_fraction,
    sqnr_db,
    underflow_fraction,
)
from numscope.metrics.stats import (
    FLOAT32_EXPONENTS,
    Log2Histogram,
    dynamic_range_binades,
    kurtosis,
    log2_histogram,
    student_t_dof,
    tensor_stats,
)

__all__ = [
    "AUTO",
    "FLOAT32_EXPONENTS",
    "BackwardError",
    "BlockScaleSpread",
    "Log2Histogram",
    "ProductReference",
    "backward_error",
    "backward_error_from",
    "block_scale_spread",
    "candidate_metrics",
    "cosine_similarity",
    "dynamic_range_binades",
    "kurtosis",
    "log2_histogram",
    "operand_metrics",
    "overflow_fraction",
    "product_reference",
    "quantize_sample",
    "relative_error",
    "saturated_block_fraction",
    "sqnr_db",
    "student_t_dof",
    "tensor_stats",
    "underflow_fraction",
]
