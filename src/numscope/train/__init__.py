"""The training recipe of Micikevicius et al., "Mixed Precision Training": loss scaling, fp32 master
weights, ops kept in fp32, activation storage, the :class:`Recipe` that ties them to a plan, and
crash-safe checkpoints for exact resume; adaptive precision (:mod:`numscope.train.adaptive`) changes the plan
while training."""

from numscope.train.activations import ActivationStore, store_activations
from numscope.train.adaptive import Adapter, AdaptiveConfig, Change
from numscope.train.checkpoint import (
    CheckpointError,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from numscope.train.fp32_ops import FP32_OPS, keep_fp32_ops
from numscope.train.loss_scaler import LossScaler, SkippedStep, UnderflowRow, underflow_report
from numscope.train.master import DEFAULT_FP32_MODULES, MasterWeights
from numscope.train.optim import AdamW4bit, AdamW8bit, AdamWFp8
from numscope.train.recipe import Recipe

__all__ = [
    "DEFAULT_FP32_MODULES",
    "FP32_OPS",
    "ActivationStore",
    "AdamW4bit",
    "AdamW8bit",
    "AdamWFp8",
    "Adapter",
    "AdaptiveConfig",
    "Change",
    "CheckpointError",
    "LossScaler",
    "MasterWeights",
    "Recipe",
    "SkippedStep",
    "UnderflowRow",
    "keep_fp32_ops",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "store_activations",
    "underflow_report",
]
