"""numscope inside a Lightning ``Trainer``::

    from numscope.integrations.lightning import NumscopeLightningCallback

    trainer = lightning.Trainer(max_steps=100, callbacks=[NumscopeLightningCallback(out="runs/analysis")])
    trainer.fit(module, loader)

The callback attaches at ``on_fit_start``, steps the observer after every optimizer step
(``on_train_batch_end`` whenever ``trainer.global_step`` advanced: gradient accumulation included) and
writes the analysis at ``on_fit_end`` on global rank 0. numscope intercepts the GEMMs inside the forward of
the module it attaches to: the ``LightningModule`` itself where it defines ``forward`` (and its
``training_step`` calls ``self(...)``), else its one child module (``self.model(...)``, the usual shape), or
the child named by ``submodule``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule

from numscope.analysis import Analysis
from numscope.integrations import Numerics
from numscope.observe import DEFAULT_CANDIDATES
from numscope.plan import Plan
from numscope.train.adaptive import AdaptiveConfig


class NumscopeLightningCallback(Callback):
    """Observe (and optionally convert) a ``LightningModule``; see the module doc and
    :class:`numscope.integrations.Numerics` for the arguments."""

    def __init__(
        self,
        out: str | os.PathLike[str] | None = None,
        *,
        candidates: Sequence[str] = DEFAULT_CANDIDATES,
        every: int = 10,
        observe: bool = True,
        plan: Plan | str | os.PathLike[str] | None = None,
        submodule: str | None = None,
        adaptive: AdaptiveConfig | None = None,
    ) -> None:
        self.numerics = Numerics(out, candidates, every, observe, plan, adaptive)
        self.submodule = submodule
        self._seen_step = 0

    def target(self, pl_module: Any) -> Any:
        """The module whose forward the training step calls (see the module docstring)."""
        if self.submodule is not None:
            return pl_module.get_submodule(self.submodule)
        if type(pl_module).forward is not LightningModule.forward:
            return pl_module
        children = list(pl_module.children())
        if len(children) != 1:
            raise ValueError(
                f"NumscopeLightningCallback: {type(pl_module).__name__} defines no forward and has "
                f"{len(children)} child modules; name the one training_step calls with submodule='...'"
            )
        return children[0]

    @property
    def analysis(self) -> Analysis | None:
        return self.numerics.analysis

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._seen_step = trainer.global_step
        self.numerics.begin(self.target(pl_module))

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self._seen_step:  # an optimizer step happened in this batch
            self._seen_step = trainer.global_step
            self.numerics.step()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.numerics.end(is_main_process=trainer.is_global_zero)
