"""The training recipe of Micikevicius et al., "Mixed Precision Training": loss scaling, fp32 master
weights and crash-safe checkpoints for exact resume."""

from numscope.train.checkpoint import (
    CheckpointError,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from numscope.train.loss_scaler import LossScaler, Overflow, UnderflowRow, underflow_report
from numscope.train.master import DEFAULT_FP32_MODULES, MasterWeights

__all__ = [
    "DEFAULT_FP32_MODULES",
    "CheckpointError",
    "LossScaler",
    "MasterWeights",
    "Overflow",
    "UnderflowRow",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "underflow_report",
]
