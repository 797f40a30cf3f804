"""numscope inside a Hugging Face ``transformers.Trainer``::

    from numscope.integrations.huggingface import NumscopeCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[NumscopeCallback(out="runs/fp32/analysis", every=10)])
    trainer.train()                      # observed; the analysis is written when training ends
    # then: numscope recommend runs/fp32/analysis -o plan.yaml
    # and train under it: callbacks=[NumscopeCallback(plan="plan.yaml", observe=False)]

The callback attaches to the model the Trainer trains (unwrapped) at ``on_train_begin``, steps the observer
at every ``on_step_end`` (once per optimizer step, gradient accumulation included), and writes the analysis
at ``on_train_end`` on the main process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback

from numscope.analysis import Analysis
from numscope.integrations import Numerics
from numscope.observe import DEFAULT_CANDIDATES
from numscope.plan import Plan
from numscope.train.adaptive import AdaptiveConfig


class NumscopeCallback(TrainerCallback):
    """Observe (and optionally convert) the model a ``transformers.Trainer`` trains; see the module doc.

    out, candidates, every, observe, plan, adaptive: as :class:`numscope.integrations.Numerics`.
    """

    def __init__(
        self,
        out: str | os.PathLike[str] | None = None,
        *,
        candidates: Sequence[str] = DEFAULT_CANDIDATES,
        every: int = 10,
        observe: bool = True,
        plan: Plan | str | os.PathLike[str] | None = None,
        adaptive: AdaptiveConfig | None = None,
    ) -> None:
        self.numerics = Numerics(out, candidates, every, observe, plan, adaptive)

    @property
    def analysis(self) -> Analysis | None:
        """The analysis of the last training run (after it ended)."""
        return self.numerics.analysis

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            raise ValueError("NumscopeCallback needs the Trainer's model (transformers passes it as model=)")
        self.numerics.begin(model)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.numerics.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.numerics.end(is_main_process=state.is_world_process_zero)
