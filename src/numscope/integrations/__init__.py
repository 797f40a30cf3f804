"""Callbacks that bring numscope into the training frameworks people use.

* :class:`numscope.integrations.huggingface.NumscopeCallback` — a ``transformers.TrainerCallback``.
* :class:`numscope.integrations.lightning.NumscopeLightningCallback` — a Lightning ``Callback``.

Both do the same through :class:`Numerics`: optionally convert the model to a plan when training begins,
observe its GEMM operands every ``every`` optimizer steps, and write the analysis when training ends, for
``numscope recommend``. Each module imports its framework; this package imports neither.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from numscope.analysis import Analysis
from numscope.observe import DEFAULT_CANDIDATES, Observer, observe
from numscope.plan import Plan
from numscope.train.adaptive import Adapter, AdaptiveConfig, observer_for, write_history


@dataclass
class Numerics:
    """What a callback does to the model it trains, framework aside.

    out: the folder the analysis is written to when training ends (``None``: kept in memory only, see
        :attr:`analysis`). candidates, every: as :func:`numscope.observe`. observe: measure at all (False
        with a plan: train under it only). plan: a :class:`numscope.Plan`, a preset or recipe name, or a
        YAML path; the model is converted to it when training begins (after the observer attaches, so the
        observer sees the high-precision operands and monitors the plan's).
    adaptive: train under ``plan`` with adaptive precision (:mod:`numscope.train.adaptive`; it observes
        itself, with its own candidates and interval): :attr:`adapter` holds the decisions, and ``out``
        receives ``plan_history.csv`` and ``plan.final.yaml`` when training ends.
    """

    out: str | os.PathLike[str] | None = None
    candidates: Sequence[str] = DEFAULT_CANDIDATES
    every: int = 10
    observe: bool = True
    plan: Plan | str | os.PathLike[str] | None = None
    adaptive: AdaptiveConfig | None = None
    analysis: Analysis | None = field(default=None, init=False)
    adapter: Adapter | None = field(default=None, init=False)
    _observer: Observer | None = field(default=None, init=False, repr=False)
    _steps: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.observe and self.plan is None:
            raise ValueError("a numscope callback with observe=False needs a plan; it would do nothing")
        if self.plan is not None and not isinstance(self.plan, Plan):
            text = os.fspath(self.plan)
            self.plan = Plan.load(text) if Path(text).suffix in (".yaml", ".yml") else Plan.named(text)
        if self.adaptive is not None and self.plan is None:
            raise ValueError("adaptive precision starts from a plan: give plan= with adaptive=")

    def begin(self, model: nn.Module) -> None:
        """Attach to ``model`` (its unwrapped module) when training begins."""
        from numscope.convert import convert

        self._steps = 0
        if self.adaptive is not None:
            assert isinstance(self.plan, Plan)
            self._observer = observer_for(model, self.plan, self.adaptive).attach()
        elif self.observe:
            self._observer = observe(model, self.candidates, every=self.every).__enter__()
        if self.plan is not None:
            assert isinstance(self.plan, Plan)
            convert(model, self.plan)  # the first forward checks the plan against the model's sites
        if self.adaptive is not None:
            assert isinstance(self.plan, Plan) and self._observer is not None
            self.adapter = Adapter(model, self.plan, self.adaptive, self._observer)

    def step(self) -> None:
        """After every optimizer step."""
        if self._observer is not None:
            self._observer.step()
        if self.adapter is not None:
            self.adapter.after_step(self._steps)
        self._steps += 1

    def end(self, is_main_process: bool = True) -> Analysis | None:
        """When training ends: detach the observer, keep its analysis and write it (main process only)."""
        observer, self._observer = self._observer, None
        if observer is None:
            return None
        observer.__exit__(None, None, None)
        if self.adapter is not None:
            if self.out is not None and is_main_process:
                Path(self.out).mkdir(parents=True, exist_ok=True)
                write_history(Path(self.out) / "plan_history.csv", self.adapter.history)
                self.adapter.current().save(Path(self.out) / "plan.final.yaml")
            return None
        self.analysis = observer.analysis()
        if self.out is not None and is_main_process:
            self.analysis.save(self.out)
        return self.analysis
