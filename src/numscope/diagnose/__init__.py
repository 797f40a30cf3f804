"""When a low-precision run drifts from FP32: which GEMMs made the gap (:func:`localize`, ``numscope
localize``), and whether a real run's gap is what the recipe's numerics do (:func:`band`, ``numscope band``;
:meth:`Band.compare` reads the loss logs of your own runs, :func:`read_loss_log`)."""

from numscope.diagnose.band import Band, BandError, BandSettings, Verdict, band
from numscope.diagnose.localize import (
    Attribution,
    Localization,
    LocalizeError,
    LocalizeSettings,
    localize,
    verdict,
)
from numscope.diagnose.lockstep import Drift, lockstep
from numscope.diagnose.logs import LogError, read_loss_log

__all__ = [
    "Attribution",
    "Band",
    "BandError",
    "BandSettings",
    "Drift",
    "Localization",
    "LocalizeError",
    "LocalizeSettings",
    "LogError",
    "Verdict",
    "band",
    "localize",
    "lockstep",
    "read_loss_log",
    "verdict",
]
