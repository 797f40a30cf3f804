"""Forecast a training stack's recipes on a user's model before any of them is trained: measure what each
plan does to an FP32-trained model (:mod:`~numscope.forecast.measure`), predict its loss gap
(:mod:`~numscope.forecast.predict`), for every recipe of the stack (:mod:`~numscope.forecast.stacks`) and
numscope's own plans (:mod:`~numscope.forecast.run`, ``numscope forecast``)."""

from numscope._callable import make_callable as _make_callable
from numscope.forecast.measure import PlanEffect, adam_preconditioner, measure_plans
from numscope.forecast.predict import Prediction, effective_lr, predict
from numscope.forecast.run import Forecast, ForecastError, ForecastSettings, forecast, forecast_folder
from numscope.forecast.stacks import StackPlan, stack_plans

__all__ = [
    "Forecast",
    "ForecastError",
    "ForecastSettings",
    "PlanEffect",
    "Prediction",
    "StackPlan",
    "adam_preconditioner",
    "effective_lr",
    "forecast",
    "forecast_folder",
    "measure_plans",
    "predict",
    "stack_plans",
]

_make_callable(__name__, "forecast")  # numscope.forecast(...) is forecast(...), the package stays importable
